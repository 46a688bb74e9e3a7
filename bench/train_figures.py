"""The figures a configuration's line carries beside its img/s: FLOPs, MFU, its kernels' profile and, for a
missed goal, what bounds it.

FLOPs and MFU: the fixed per-image figures of ../shared/BENCHMARKS.md (`UNET_TFLOP`, `VAE_TFLOP`) hold
for the SD-1/2 UNet alone, so only `--model-config sd2` uses them. `--count-flops` counts the UNet's
forward + backward (and, for image configurations, the VAE encoder's forward) per image with
torch.utils.flop_counter.FlopCounterMode, once per resolution on a batch of one, outside the timed
steps: `unet_tflop_per_image_counted`, and MFU from it where no fixed figure applies (`flops_basis`
says which); for sd2 it is a cross-check beside the fixed figure.

`--profile NAME,...`: after those configurations' timed steps, 3 more under torch.profiler; a
`train.profile.<name>` line gives the top CUDA kernels and the shares of attention, convolution,
matmul, normalisation, elementwise and optimizer kernels.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bench.train_harness import note
from bench.train_shards import CAPTIONS

if TYPE_CHECKING:
    from bench.train_harness import Bench

# FLOPs per image (../shared/BENCHMARKS.md): UNet forward + backward; VAE encoder forward. They are
# the SD-1/2 UNet's and VAE's, so they hold for these presets alone (an sd1 preset would join them).
UNET_TFLOP = {256: 0.54, 512: 2.41, 1024: 14.0}
VAE_TFLOP = {256: 0.28, 512: 1.12}
FIXED_FLOPS_PRESETS = frozenset({"sd2"})
PEAK_SPEC, PEAK_MEASURED = 989.0, 790.0


# ---------------------------------------------------------------- FLOPs


def counted_tflop(run, device) -> tuple[float, dict]:
    """(TFLOP of the ops `run()` dispatches, by kind), from torch's FlopCounterMode (matmuls, convolutions,
    attention; forward and backward)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    # the CPU's flash kernel for SDPA has no FLOP formula; the math backend's matmuls are the same work, counted
    backend = sdpa_kernel(SDPBackend.MATH) if device.type == "cpu" else contextlib.nullcontext()
    with backend, counter:
        run()
    kinds: dict[str, float] = {}
    for op, flops in counter.get_flop_counts().get("Global", {}).items():
        kind = "attention" if "attention" in str(op) else "convolution" if "conv" in str(op) else "matmul"
        kinds[kind] = kinds.get(kind, 0.0) + flops / 1e12
    return counter.get_total_flops() / 1e12, {kind: significant(tflop) for kind, tflop in sorted(kinds.items())}


def significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits (a tiny test model's TFLOP rounds to 0 at fixed decimals)."""
    return float(f"{value:.{digits}g}")


def count_unet(models, resolution: int, device) -> tuple[float, dict]:
    """The UNet's forward + backward on one image at `resolution`, as diffusion_loss calls it (bf16 autocast on a GPU)."""
    import torch

    from trainer.models.text import encode_captions
    from trainer.objectives.numerics import autocast
    side = resolution // models.vae_scale_factor
    latents = torch.randn(1, models.denoiser.config.in_channels, side, side, device=device)
    context, pooled = encode_captions(models, CAPTIONS[:1], device)  # outside the count: the text encoder is not the UNet's
    added = None
    if models.sdxl:
        added = {"text_embeds": pooled, "time_ids": torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]],
                                                                 dtype=torch.float32, device=device)}

    def step() -> None:
        with autocast(device):
            prediction = models.denoiser(latents, torch.tensor([500], device=device), context, added_cond_kwargs=added).sample
        prediction.float().square().mean().backward()

    try:
        return counted_tflop(step, device)
    finally:
        models.denoiser.zero_grad(set_to_none=True)  # the next configuration starts from no gradients


def count_vae_encoder(models, resolution: int, device) -> tuple[float, dict]:
    """The VAE encoder's forward on one image at `resolution`, as the image path calls it."""
    import torch

    from trainer.objectives.numerics import autocast
    pixels = torch.rand(1, 3, resolution, resolution, device=device) * 2 - 1

    def encode() -> None:
        with torch.no_grad(), autocast(device):
            models.vae.encode(pixels.to(models.vae.dtype))

    return counted_tflop(encode, device)


def counted_figure(bench: Bench, part: str, resolution: int) -> tuple[float, dict] | None:
    """The counted TFLOP per image of the UNet ('unet') or the VAE encoder ('vae'): once per resolution, with --count-flops."""
    if not bench.args.count_flops:
        return None
    counted = bench.counted
    if (part, resolution) not in counted:
        started = time.time()
        count = count_unet if part == "unet" else count_vae_encoder
        counted[(part, resolution)] = count(bench.models, resolution, bench.device)
        note(event="flops_counted", part=part, resolution=resolution, tflop=round(counted[(part, resolution)][0], 4),
             seconds=round(time.time() - started, 1))
    return counted[(part, resolution)]


def vae_figure(bench: Bench, resolution: int) -> tuple[float | None, str | None]:
    """(VAE encoder TFLOP per image, its basis): the fixed figure for an SD-1/2 preset, else the counted one."""
    if bench.args.model_config in FIXED_FLOPS_PRESETS and resolution in VAE_TFLOP:
        return VAE_TFLOP[resolution], "fixed: BENCHMARKS.md, SD-1/2 VAE encoder"
    counted = counted_figure(bench, "vae", resolution)
    return (significant(counted[0]), "counted: FlopCounterMode, VAE encoder forward, batch 1") if counted else (None, None)


def unet_figure(bench: Bench, resolution: int) -> float | None:
    """UNet forward + backward TFLOP per image: the fixed SD-1/2 figure, else the counted one, else None."""
    fixed = UNET_TFLOP.get(resolution) if bench.args.model_config in FIXED_FLOPS_PRESETS else None
    counted = counted_figure(bench, "unet", resolution)
    return fixed or (counted[0] if counted else None)


def flops_fields(bench: Bench, source: str, resolution: int, img_per_s: float) -> dict:
    """A configuration line's FLOP figures and MFU: from the fixed SD-1/2 figures, else from --count-flops."""
    fixed = UNET_TFLOP.get(resolution) if bench.args.model_config in FIXED_FLOPS_PRESETS else None
    counted = counted_figure(bench, "unet", resolution)
    fields = {}
    if counted:
        fields["unet_tflop_per_image_counted"] = significant(counted[0])
        fields["unet_tflop_counted_by_kind"] = counted[1]
    if fixed and counted:
        fields["unet_tflop_per_image_fixed"] = fixed
        fields["counted_vs_fixed"] = round(counted[0] / fixed, 3)
    unet_tflop = unet_figure(bench, resolution)
    if not unet_tflop:
        fields["flops_basis"] = "none: no fixed figure for this model config and resolution; pass --count-flops"
        return fields
    fields["flops_basis"] = ("fixed: BENCHMARKS.md, SD-1/2 UNet" if fixed
                             else "counted: FlopCounterMode, UNet forward + backward, batch 1")
    achieved = img_per_s * unet_tflop
    fields.update(unet_tflop_per_s=significant(achieved), mfu_989=significant(achieved / PEAK_SPEC),
                  mfu_790=significant(achieved / PEAK_MEASURED))
    if source == "image":
        vae_tflop, vae_basis = vae_figure(bench, resolution)
        if vae_tflop:
            fields["mfu_989_incl_vae"] = significant(img_per_s * (unet_tflop + vae_tflop) / PEAK_SPEC)
            fields["vae_flops_basis"] = vae_basis
    return fields


# ---------------------------------------------------------------- profile and bound


KERNEL_KINDS = [  # (kind, substrings of a CUDA kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "sdpa", "mha")),
    ("optimizer", ("adam", "foreach", "multi_tensor", "lerp", "norm_kernel_launcher")),
    ("normalization", ("group_norm", "groupnorm", "layer_norm", "layernorm", "native_norm", "welford", "batch_norm")),
    ("convolution", ("conv", "implicit", "dgrad", "wgrad", "fprop", "cudnn", "winograd", "xmma_fprop")),
    ("matmul", ("gemm", "cutlass", "matmul", "sm90_xmma", "nvjet", "cublas")),
    ("triton (fused elementwise/norm)", ("triton",)),
    ("elementwise", ("elementwise", "vectorized", "reduce", "copy", "fill", "cat", "index", "unrolled")),
]


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(mark in lowered for mark in marks)), "other")


def profile_summary(profiler, steps: int) -> dict:
    """Top CUDA kernels and the share of each kind of kernel, per step."""
    kernels = {}
    for event in profiler.events():
        if event.device_type.name == "CUDA":  # a kernel (or memcpy/memset) on the GPU
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total  # microseconds
    if not kernels:  # older event layouts: the self device time of every op
        for event in profiler.key_averages():
            if event.self_device_time_total > 0:
                kernels[event.key] = kernels.get(event.key, 0.0) + event.self_device_time_total
    total = sum(kernels.values()) or 1.0
    shares = {}
    for name, micros in kernels.items():
        shares[kernel_kind(name)] = shares.get(kernel_kind(name), 0.0) + micros / total
    top = sorted(kernels.items(), key=lambda item: -item[1])[:12]
    return {"gpu_ms_per_step": round(total / 1000 / steps, 1),
            "kind_share": {kind: round(share, 3) for kind, share in sorted(shares.items(), key=lambda item: -item[1])},
            "top_kernels": [{"name": name[:90], "ms_per_step": round(micros / 1000 / steps, 2),
                             "share": round(micros / total, 3), "kind": kernel_kind(name)} for name, micros in top]}


COMPUTE_KINDS = ("convolution", "matmul", "attention")  # tensor-core kernels; the rest move memory more than they compute


def bound_of(line: dict, profile: dict | None, unet_tflop: float | None, vae_tflop: float | None) -> dict:
    """What bounds a configuration that misses its goal, from its profile in the same run: data wait, the
    host (GPU idle between kernels), memory-bound kernels or the tensor-core kernels themselves.

    `ceiling_img_per_s` is the rate if only the tensor-core kernels ran, at the speed they ran: no goal
    above it is reachable without faster convolutions, matmuls or attention.
    """
    config = line["config"]
    if profile is None:
        return {"verdict": f"not profiled in this run (--profile {config['name']})"}
    step_s, images = config["median_step_s"], config["images_per_step"]
    kernels_s = profile["gpu_ms_per_step"] / 1000
    shares = profile["kind_share"]
    compute_share = sum(shares.get(kind, 0.0) for kind in COMPUTE_KINDS)
    bound = {"gpu_busy_share": round(min(kernels_s / step_s, 1.0), 3), "data_wait_share": config["data_wait_share"],
             "compute_kernel_share": round(compute_share, 3), "memory_bound_kernel_share": round(1 - compute_share, 3),
             "ceiling_img_per_s": round(images / (kernels_s * compute_share), 1) if compute_share else None}
    flops = (unet_tflop or 0.0) + (vae_tflop or 0.0)
    if flops and compute_share:  # the tensor-core kernels' own speed against the measured peak
        bound["compute_kernel_tflop_per_s"] = round(images * flops / (kernels_s * compute_share), 1)
    kinds = ", ".join(f"{kind} {share:.0%}" for kind, share in list(shares.items())[:4])
    if config["data_wait_share"] > 0.005:
        bound["verdict"] = f"data wait: {config['data_wait_share']:.1%} of the step waits for the loader"
    elif bound["gpu_busy_share"] < 0.9:
        bound["verdict"] = f"host/launch: the GPU runs kernels {bound['gpu_busy_share']:.0%} of the step"
    else:
        bound["verdict"] = (f"GPU kernels ({bound['gpu_busy_share']:.0%} busy): {kinds}; tensor-core kernels are "
                            f"{compute_share:.0%} of the time, so removing every other kernel would give at most "
                            f"{bound['ceiling_img_per_s']} img/s")
    return bound
