"""The configurations the training benchmarks measure: their names, and each lever switched on and off.

What a name of `--configs` means (comma-separated, run in order in one process; bench/train_timing.py runs them):
- `image512`, `image256`: image shards, VAE and text encoder online.
- `latent512`, `latent256`: latent shards written by trainer/jobs/encode.py (`--encode 512,256` first
  encodes the image shards with the same models and reports `train.encode_img_per_s_<res>`), read
  through the trainer's loader; the UNet and the text encoder (on the stored token ids) run.
- `resident512`, `resident256`: "unet-only, latents resident": random latents already on the GPU
  (`batch["latents"]`), no loader; the upper bound of the latent-shard path.
- `image1024`, `latent1024`, `resident1024`: the same at 1024 (`--model-config sdxl`, `--image-size 1024`
  shards, `--encode 1024`, `--batch-1024`).
- levers on a base config, measured one at a time: `<base>+cl` (channels_last UNet),
  `<base>+fused` (fused AdamW), `<base>+b<N>` (batch N), `<base>+compile` (torch.compile of the UNet,
  as `trainer.jobs.train --compile`), `<base>+cudnn` (cudnn.benchmark), `<base>+graphs` (CUDA graphs:
  torch.compile mode "reduce-overhead", implies compile; GPU only, a skipped line on a CPU),
  `<base>+nopin` (the loader without pinned memory), `<base>+accum<N>` (N micro-batches per optimizer
  step, as `trainer.jobs.train --gradient-accumulation N`: the loader plans N per step, the loss is
  scaled by 1/N, the all-reduce runs on the last; img/s counts N x batch per step),
  `<base>+accum<N>+sync` (the all-reduce on every micro-batch: meaningful under torchrun only),
  `<base>+fp32` (bf16 autocast off: the UNet and text encoder in fp32, to measure what bf16 gives),
  `<base>+mathattn` (diffusers' classic AttnProcessor instead of SDPA, to measure what SDPA gives),
  `<base>+vaec` (image shards: the VAE encoder compiled, trainer.speed.vae_compile.compile_vae_encoder),
  `<base>+vaecl` (the same with channels-last encoder weights),
  `<base>+lopt` (inductor's layout optimisation forced on: channels-last through the compiled graphs),
  `<base>+default` (what trainer/configs/defaults/fast.json gives a job with default parameters for `--model-config`
  at that resolution: compile, fused AdamW, batch, accumulation; also gives `train.img_per_s_<res>_default`),
  `<base>+bf16w` (the UNet's weights in bf16, their fp32 masters stepped by the optimizer, clipped and averaged
  by the EMA: trainer.speed.master_weights; single process only, a skipped line under torchrun),
  `<base>+fp8` (torchao float8 training, `convert_to_float8_training`, tensorwise dynamic scaling, on the
  linear layers of the UNet's Transformer2DModel blocks whose dims are multiples of 16, less the cross-attention
  key/value projections of the 77 text tokens; torchao imported in the lever: without it, or without a CUDA
  device of compute capability >= 8.9, a skipped line),
  `<base>+stepgraph` (trainer/speed/cuda_graphs.py, as `trainer.jobs.train --cuda-graphs true`: the UNet's forward, loss and
  backward captured once per shape and replayed, eager or compiled, the draws and the optimizer outside),
  `<base>+gnsilu` (each ResnetBlock2D's GroupNorm -> SiLU pairs as one op, trainer.speed.fused_norm: Triton kernels on
  a GPU, its PyTorch formulas on a CPU),
  combinations joined with `+`. Each lever line carries `ratio_vs_plain` against `<base>` and
  `ratio_vs_without` against its name less the last lever (`latent512+compile+graphs` against
  `latent512+compile`), each when measured earlier in the same process.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.train_harness import Bench

SOURCES = ("image", "latent", "resident")
LEVERS = ("cl", "fused", "compile", "cudnn", "graphs", "nopin", "sync", "fp32", "mathattn", "vaec", "vaecl", "lopt",
          "default", "bf16w", "fp8", "gnsilu", "stepgraph")
COUNTED_LEVERS = {"b": "batch", "accum": "accumulation"}  # lever prefix + a number -> config field


@dataclass(frozen=True)
class Configuration:
    """One name of `--configs`: its source, resolution and levers."""
    name: str  # 'latent512+fused+b64'
    base: str  # 'latent512'
    source: str  # one of SOURCES
    resolution: int
    channels_last: bool = False
    fused_adamw: bool = False
    compile: bool = False
    graphs: bool = False
    cudnn_benchmark: bool = False
    pin_memory: bool | None = None  # None: make_loader's own choice
    sync_every_micro_batch: bool = False
    batch: int | None = None  # None: --batch-<res>
    accumulation: int = 1
    fp32: bool = False
    math_attention: bool = False
    vae_compile: bool = False
    vae_channels_last: bool = False
    force_layout_opt: bool = False
    fast_default: bool = False
    bf16_weights: bool = False
    fp8: bool = False
    fused_groupnorm_silu: bool = False
    step_graphs: bool = False


def parse_config(name: str) -> Configuration:
    """'latent512+fused+b64' -> source, resolution, levers."""
    base, *levers = name.split("+")
    source = next(source for source in SOURCES if base.startswith(source))
    counted = {}
    for lever in levers:
        prefix = lever.rstrip("0123456789")
        if prefix in COUNTED_LEVERS and lever != prefix:
            counted[COUNTED_LEVERS[prefix]] = int(lever[len(prefix):])
        elif lever not in LEVERS:
            raise ValueError(f"unknown lever {lever!r} in {name!r}")
    config = Configuration(name=name, base=base, source=source, resolution=int(base[len(source):]),
                           channels_last="cl" in levers, fused_adamw="fused" in levers,
                           compile="compile" in levers or "graphs" in levers,  # CUDA graphs come through torch.compile
                           graphs="graphs" in levers, cudnn_benchmark="cudnn" in levers,
                           pin_memory=False if "nopin" in levers else None, sync_every_micro_batch="sync" in levers,
                           fp32="fp32" in levers, math_attention="mathattn" in levers,
                           vae_compile="vaec" in levers or "vaecl" in levers, vae_channels_last="vaecl" in levers,
                           force_layout_opt="lopt" in levers, fast_default="default" in levers,
                           bf16_weights="bf16w" in levers, fp8="fp8" in levers, fused_groupnorm_silu="gnsilu" in levers,
                           step_graphs="stepgraph" in levers, **counted)
    if config.accumulation < 1 or (config.sync_every_micro_batch and config.accumulation == 1):
        raise ValueError(f"{name!r}: accum<N> needs N >= 1, and sync needs accum<N> with N > 1 (one micro-batch always syncs)")
    if config.bf16_weights and config.fp32:
        raise ValueError(f"{name!r}: bf16w and fp32 contradict each other")
    return config


def apply_fast_default(config: Configuration, preset: str) -> Configuration:
    """`<base>+default`: what a job with default parameters runs (trainer/configs/defaults/fast.json) for the preset
    at the base's resolution: its compile, fused AdamW, batch and accumulation."""
    from trainer.speed.fast_defaults import lookup
    if not config.fast_default:
        return config
    fast = lookup(preset, config.resolution)
    if fast is None:
        raise ValueError(f"{config.name!r}: trainer/configs/defaults/fast.json has no entry for {preset} "
                         f"at {config.resolution}")
    return replace(config, compile=fast.compile, fused_adamw=fast.fused_adamw, batch=fast.batch_size,
                   accumulation=fast.gradient_accumulation)


def without_last_lever(name: str) -> str | None:
    """'latent512+compile+graphs' -> 'latent512+compile': the configuration a lever is measured against."""
    return name.rsplit("+", 1)[0] if "+" in name else None


def lever_unavailable(config: Configuration, device, world_size: int) -> str | None:
    """Why a configuration's lever cannot run on this machine (its line is emitted as skipped), or None."""
    if config.graphs and device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if config.step_graphs:
        from trainer.speed.cuda_graphs import usable
        if reason := usable(device, world_size):
            return reason
    if config.fp8:
        return fp8_unavailable(device)
    if config.bf16_weights and world_size > 1:
        return "bf16w moves gradients in hooks DDP does not expect: single process only"
    return None


def switch_precision_and_attention(bench: Bench, config: Configuration, on: bool) -> None:
    """The `fp32` and `mathattn` levers (switched on before a configuration, back off after it): they
    undo one of the trainer's defaults, bf16 autocast or SDPA attention, to measure what it gives."""
    import contextlib

    import torch
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    import trainer.objectives.diffusion as objective
    models = bench.models
    if config.fp32:
        if bench.trainer_autocast is None:
            bench.trainer_autocast = objective.autocast
        objective.autocast = (lambda device: contextlib.nullcontext()) if on else bench.trainer_autocast
        frozen_dtype = torch.float32 if on else (torch.bfloat16 if bench.device.type == "cuda" else torch.float32)
        for encoder in models.text_encoders:  # their output feeds the UNet: the same dtype as its weights
            encoder.to(frozen_dtype)
    if config.math_attention:
        models.denoiser.set_attn_processor(AttnProcessor() if on else AttnProcessor2_0())


def float8_linears(unet) -> dict[str, object]:
    """fqn -> nn.Linear of the UNet's Transformer2DModel blocks (attention projections, feed-forward, proj_in/out)
    that float8 matmuls take: both dims multiples of 16. The cross-attention key/value projections are left out:
    their rows are batch x 77 text tokens, which the weight-gradient float8 matmul needs divisible by 16, and they
    are a sliver of the FLOPs. Convolutions are never nn.Linear, so never converted."""
    import torch
    from diffusers.models.transformers.transformer_2d import Transformer2DModel
    chosen = {}
    for prefix, block in unet.named_modules():
        if isinstance(block, Transformer2DModel):
            for name, module in block.named_modules():
                if (type(module) is torch.nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0
                        and not name.endswith(("attn2.to_k", "attn2.to_v"))):
                    chosen[f"{prefix}.{name}"] = module
    return chosen


def fp8_unavailable(device) -> str | None:
    """Why the fp8 lever cannot run here, or None."""
    import torch
    if device.type != "cuda":
        return "float8 training needs a CUDA device"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"float8 matmuls need compute capability >= 8.9 (this GPU: {capability[0]}.{capability[1]})"
    try:
        import torchao.float8  # noqa: F401
    except ImportError as missing:
        return f"torchao is not installed ({missing}); bench/gpu_wheels.sh fetches it"
    return None


def apply_model_levers(bench: Bench, config: Configuration) -> dict:
    """The levers that change the UNet itself (release() undoes them): gnsilu, fp8, bf16w; what each did."""
    unet, detail = bench.models.denoiser, {}
    if config.fused_groupnorm_silu:
        from trainer.speed.fused_norm import fuse_groupnorm_silu, runs_triton
        detail["groupnorm_silu_blocks"] = fuse_groupnorm_silu(unet)
        probe = next(unet.parameters()).new_empty(1, 1, 1, 1)
        detail["groupnorm_silu_path"] = "triton" if runs_triton(probe) else "pytorch (no CUDA/Triton)"
    if config.fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        bench.float8_originals = float8_linears(unet)
        convert_to_float8_training(unet, module_filter_fn=lambda module, fqn: fqn in bench.float8_originals,
                                   config=Float8LinearConfig())
        detail["float8_linears"] = len(bench.float8_originals)
    if config.bf16_weights:
        from trainer.speed.master_weights import MasterWeights
        bench.master_weights = MasterWeights(unet)
    return detail


def release_model_levers(bench: Bench, config: Configuration) -> None:
    """The UNet back in fp32 (the masters' values), its nn.Linear and GroupNorm modules back in place."""
    unet = bench.models.denoiser
    if bench.master_weights is not None:
        bench.master_weights.restore()
        bench.master_weights = None
    for fqn, original in bench.float8_originals.items():  # the Float8Linear held the same parameter objects
        parent, _, name = fqn.rpartition(".")
        setattr(unet.get_submodule(parent), name, original)
    bench.float8_originals = {}
    if config.fused_groupnorm_silu:
        from trainer.speed.fused_norm import unfuse_groupnorm_silu
        unfuse_groupnorm_silu(unet)


def release(bench: Bench, config: Configuration) -> None:
    """Leave the UNet as the next configuration expects it (also after a failed one): fp32, its own modules,
    contiguous, no gradients, no compiled graphs or CUDA graph pools, the cached GPU memory returned."""
    import torch

    from trainer.speed.vae_compile import vae_encoder_eager
    unet = bench.models.denoiser
    unet.zero_grad(set_to_none=True)
    release_model_levers(bench, config)
    switch_precision_and_attention(bench, config, on=False)
    if config.channels_last:
        unet.to(memory_format=torch.contiguous_format)
    if config.vae_compile:
        vae_encoder_eager(bench.models)
    import torch._inductor.config
    torch._inductor.config.force_layout_optimization = False
    if config.compile or config.vae_compile:
        torch._dynamo.reset()  # also drops the CUDA graph trees
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
