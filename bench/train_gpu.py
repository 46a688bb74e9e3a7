"""Benchmark the trainer's real training step on one GPU: one JSON line per configuration.

    PYTHONUNBUFFERED=1 python bench/train_gpu.py --shards /tmp/shards --make-shards 2048 --out $OUT/train.jsonl

Run it through the device tool (bench/gpu_wheels.sh fetches the wheels the GPU machine lacks).
Everything is the trainer's own code: models from `trainer.models.loading.load_models` (a preset, random
init), the step `trainer.jobs.train.main` runs, `trainer.jobs.step.train_step` (trainer.objectives.diffusion.diffusion_loss
with the trainer's default noise offset and min-SNR settings, backward, gradient clipping, the
all-ranks finiteness check, AdamW, the EMA, the LR schedule) and, for image shards,
the trainer's loader (`index_shards`, `BatchPlan`, `StepBatches`, `make_loader`) with its own
data-wait timing (`trainer.runtime.health.Window`).

Configurations (`--configs`, comma-separated, run in order in this one process):
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
- `--parity-steps N`: after the configurations, `--parity-base` (`latent512+default` unless told) and the same
  with `+fp8`, N steps each from the same weights, seed and data order; a `train.lever.fp8_loss_parity` line gives
  each loss curve's mean over its last 50 steps and their ratio (fp8 / without).
- `--profile NAME,...`: after those configurations' timed steps, 3 more under torch.profiler; a
  `train.profile.<name>` line gives the top CUDA kernels and the shares of attention, convolution,
  matmul, normalisation, elementwise and optimizer kernels.

FLOPs and MFU: the fixed per-image figures of ../shared/BENCHMARKS.md (`UNET_TFLOP`, `VAE_TFLOP`) hold
for the SD-1/2 UNet alone, so only `--model-config sd2` uses them. `--count-flops` counts the UNet's
forward + backward (and, for image configurations, the VAE encoder's forward) per image with
torch.utils.flop_counter.FlopCounterMode, once per resolution on a batch of one, outside the timed
steps: `unet_tflop_per_image_counted`, and MFU from it where no fixed figure applies (`flops_basis`
says which); for sd2 it is a cross-check beside the fixed figure.

`--decode-bench N` (after the configurations): the image loader's CPU work per JPEG (trainer.data.images'
decode_image + crop_to_bucket, one process, one thread as in a loader worker) against
torchvision.io.decode_jpeg on the GPU (batched, then scaled and cropped with interpolate) on N
JPEGs of the shards; a `train.lever.gpu_jpeg_decode` line with both, the loader's capacity
(num_workers / CPU s per image), the fastest image configuration's img/s and a verdict.

`--compile-cache DIR`: a compiled first configuration loads its shape's trainer.speed.compile_cache file before
its first step and saves it after, and its first step is also reported as
`train.first_step_s_compiled_warm` (a file was loaded) or `_cold`. Run it twice, each process with its
own empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so only the file carries the compile.

The first configuration also gives `train.first_step_s`: process start to the first optimizer step,
with the same setup order as trainer.jobs.train.main (models built, the UNet on the GPU already, the frozen
parts moved there, optimizer, EMA, shards indexed, loader started).

Under torchrun every rank prints its own lines (`rank`, `world_size`); make the shards in a single
process first (`--make-shards N --configs ""`); rank 0 alone encodes.
"""

from __future__ import annotations

import time

WALL_START = time.time()

import argparse  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from multiprocessing import Pool  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Callable  # noqa: E402

if TYPE_CHECKING:  # the trainer and torch are imported late: their import time counts in train.first_step_s
    from trainer.data.loader import StepBatches
    from trainer.data.shards import ShardIndex
    from trainer.models.bundle import Models
    from trainer.runtime.distributed import Processes
    from trainer.speed.compile_cache import CacheKey, JobCache
    from trainer.speed.master_weights import MasterWeights

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "functions")]  # the trainer and what it shares with the Lambdas, as for pytest

# FLOPs per image (../shared/BENCHMARKS.md): UNet forward + backward; VAE encoder forward. They are
# the SD-1/2 UNet's and VAE's, so they hold for these presets alone (an sd1 preset would join them).
UNET_TFLOP = {256: 0.54, 512: 2.41, 1024: 14.0}
VAE_TFLOP = {256: 0.28, 512: 1.12}
FIXED_FLOPS_PRESETS = frozenset({"sd2"})
PEAK_SPEC, PEAK_MEASURED = 989.0, 790.0
GOALS = {("latent", 512): ("train.img_per_s_512_latent", 200), ("latent", 256): ("train.img_per_s_256_latent", 900),
         ("image", 512): ("train.img_per_s_512_image", 110), ("latent", 1024): ("train.img_per_s_1024_latent", 20)}
GOAL_PRESETS = {"train.img_per_s_1024_latent": "sdxl"}  # a goal stated for one preset's UNet (BENCHMARKS.md)
DEFAULT_GOALS = {512: 150}  # train.img_per_s_<res>_default: the `+default` configuration
CAPTIONS = ["a red dog on the beach", "a photo of a city street at night", "a bowl of fruit on a table",
            "a mountain lake at sunrise", "a small boat on a blue sea", "two people walking in a green forest"]


def process_start_time() -> float:
    """This process's start (wall clock), from psutil or /proc."""
    try:
        import psutil
        return psutil.Process().create_time()
    except ImportError:
        ticks = os.sysconf("SC_CLK_TCK")
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return boot + start_ticks / ticks


PROCESS_START = process_start_time()


def note(**fields) -> None:
    print(json.dumps({"progress": True, "t": round(time.time() - PROCESS_START, 1), **fields}), file=sys.stderr, flush=True)


# ---------------------------------------------------------------- synthetic shards


def synthetic_jpeg(seed: int, size: int) -> bytes:
    """A smooth random picture with some grain, saved as a q90 JPEG (about the size of a photo's)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.Resampling.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (size, size, 3), dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=90)
    return out.getvalue()


def write_shard(job: tuple) -> int:
    """One shard in the packer's layout (<sha256>.jpg, .json, .txt); the same JPEGs in an imagefolder."""
    path, first, count, size, folder = job
    metadata = []
    from contracts import shard_members
    with tarfile.open(path, "w", format=shard_members.TAR_FORMAT) as tar:
        for number in range(first, first + count):
            data = synthetic_jpeg(number, size)
            key = hashlib.sha256(data).hexdigest()
            caption = CAPTIONS[number % len(CAPTIONS)]
            record = json.dumps({"width": size, "height": size, "format": "JPEG", "partner": "bench",
                                 "license": "synthetic"}).encode()
            members = (("jpg", data), (shard_members.RECORD, record), (shard_members.CAPTION, caption.encode()))
            for extension, body in members:
                tar.addfile(shard_members.tarinfo(shard_members.member_name(key, extension), len(body)), io.BytesIO(body))
            if folder:
                (Path(folder) / f"{key}.jpg").write_bytes(data)
                metadata.append(json.dumps({"file_name": f"{key}.jpg", "text": caption}))
    if folder:
        (Path(folder) / f"metadata-{first:08d}.part").write_text("\n".join(metadata) + "\n")
    return count


def make_shards(directory: Path, samples: int, size: int, per_shard: int, folder: Path | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
    jobs = [(str(directory / f"shard-{first // per_shard:05d}.tar"), first, min(per_shard, samples - first), size,
             str(folder) if folder else None) for first in range(0, samples, per_shard)]
    with Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.map(write_shard, jobs)
    if folder:
        parts = sorted(folder.glob("metadata-*.part"))
        (folder / "metadata.jsonl").write_text("".join(part.read_text() for part in parts))
        for part in parts:
            part.unlink()


# ---------------------------------------------------------------- the step


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


@dataclass
class Bench:
    """What every configuration of this process shares, and what the earlier ones left for the later ones."""
    args: argparse.Namespace
    models: Models
    processes: Processes
    marks: dict[str, float]  # seconds from process start to each setup phase (train.first_step_s)
    profile: set[str]  # the configurations to profile (--profile)
    batch_default: dict[int, int]  # resolution -> batch when the configuration names none
    latent_dirs: dict[int, str] = field(default_factory=dict)  # resolution -> the latent shards --encode wrote
    identity: str | None = None  # trainer.data.latents.models_identity, hashed once
    image_index: ShardIndex | None = None  # the image shards, indexed once
    latent_indexes: dict[int, ShardIndex] = field(default_factory=dict)  # resolution -> its latent shards, indexed
    # (part, resolution) -> (TFLOP per image, by kind), counted once with --count-flops
    counted: dict[tuple[str, int], tuple[float, dict]] = field(default_factory=dict)
    trainer_autocast: Callable | None = None  # trainer.objectives.numerics.autocast while the fp32 lever replaces it
    master_weights: MasterWeights | None = None  # the bf16w lever's, until release() restores fp32 weights
    float8_originals: dict[str, object] = field(default_factory=dict)  # the fp8 lever: fqn -> the nn.Linear it swapped

    @property
    def device(self):
        return self.processes.device

    def batch_of(self, config: Configuration) -> int:
        return config.batch or self.batch_default[config.resolution]


@dataclass
class FirstCache:
    """The compile cache of the first configuration's shape, as trainer.jobs.train keys and loads it."""
    key: CacheKey
    job: JobCache
    outcome: dict  # JobCache.load's account of what it loaded


def without_last_lever(name: str) -> str | None:
    """'latent512+compile+graphs' -> 'latent512+compile': the configuration a lever is measured against."""
    return name.rsplit("+", 1)[0] if "+" in name else None


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


def resident_latents(models, batch: int, resolution: int, device, pool: int = 4):
    """Batches of precomputed latents already on the GPU, cycled (unet-only, latents resident)."""
    import torch
    side = resolution // models.vae_scale_factor
    tensors = [torch.randn(batch, models.denoiser.config.in_channels, side, side, device=device) for _ in range(pool)]
    # SDXL's size/crop conditioning of an uncropped square: original size, crop top-left, target size
    time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]] * batch, dtype=torch.float32)
    number = 0
    while True:
        yield {"latents": tensors[number % pool], "caption": [CAPTIONS[(number + i) % len(CAPTIONS)] for i in range(batch)],
               "time_ids": time_ids, "key": [str(i) for i in range(batch)], "corrupt": [], "shard": []}
        number += 1


def latent_batches(bench: Bench, resolution: int, plan, accumulation: int) -> StepBatches:
    """The trainer's own latent-shard dataset over the shards `--encode` wrote at this resolution."""
    from trainer.data.latents import check_latent_shards
    from trainer.data.loader import StepBatches
    from trainer.data.plan import BatchPlan
    from trainer.data.shards import index_shards
    from trainer.models.text import caption_ids
    models, processes = bench.models, bench.processes
    if resolution not in bench.latent_indexes:
        index = index_shards(bench.latent_dirs[resolution], processes.local_rank, processes.local_world_size)
        check_latent_shards(index, models, {resolution})  # as trainer.jobs.train does (hashes the VAE and text encoder)
        bench.latent_indexes[resolution] = index
    index = bench.latent_indexes[resolution]
    batch_plan = BatchPlan(index.aspect, plan, bench.args.seed, processes.rank, accumulation, models.size_multiple,
                           True)
    return StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False, caption_ids(models, [""])[0].numpy())


def step_module(model, config: Configuration):
    """What the step calls: the model itself, compiled as `trainer.jobs.train --compile`, or compiled with CUDA graphs."""
    import torch
    if config.graphs:  # one graph per bucket shape, replayed; the step's inputs are copied into its static buffers
        return torch.compile(model, dynamic=False, mode="reduce-overhead")
    return torch.compile(model, dynamic=False) if config.compile else model


def start_batches(bench: Bench, config: Configuration, plan, batch: int) -> tuple:
    """(the micro-batches in step order, whether the loader pins them): the trainer's loader over image or
    latent shards, planned for `accumulation` micro-batches per step as trainer.jobs.train plans them; or resident latents."""
    from trainer.data.loader import StepBatches, make_loader
    from trainer.data.plan import BatchPlan
    from trainer.data.shards import index_shards
    args, models, processes = bench.args, bench.models, bench.processes
    if config.source == "resident":
        return resident_latents(models, batch, config.resolution, bench.device), None
    if config.source == "image":
        if bench.image_index is None:
            bench.image_index = index_shards(args.shards, processes.local_rank, processes.local_world_size)
            bench.marks["shards_indexed"] = time.time() - PROCESS_START
        index = bench.image_index
        batch_plan = BatchPlan(index.aspect, plan, args.seed, processes.rank, config.accumulation, models.size_multiple,
                               True)
        dataset = StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False)
    else:
        dataset = latent_batches(bench, config.resolution, plan, config.accumulation)
    loader = make_loader(dataset, args.num_workers, pin_memory=config.pin_memory)
    return iter(loader), loader.pin_memory


def first_marked(batches, marks: dict[str, float]):
    """The batches, the first one's arrival marked as the `first_batch` phase of train.first_step_s."""
    first = next(batches)
    marks["first_batch"] = time.time() - PROCESS_START
    yield first
    yield from batches


def run_config(bench: Bench, config: Configuration, steps: int, warmup: int, first: bool) -> dict:
    """`warmup` steps, `steps` timed ones and, with --profile, 3 profiled ones of trainer.jobs.step.train_step."""
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from trainer.data.stages import plan_from_args
    from trainer.jobs.step import StepSettings, Trainee, train_step
    from trainer.runtime import distributed
    from trainer.runtime.ema import EMA
    from trainer.runtime.health import Window
    from trainer.speed.cuda_graphs import GraphedBackward
    from trainer.speed.vae_compile import compile_vae_encoder

    args, models, processes, device = bench.args, bench.models, bench.processes, bench.device
    unet = models.denoiser
    resolution, batch, accumulation = config.resolution, bench.batch_of(config), config.accumulation
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    if config.channels_last:
        unet.to(memory_format=torch.channels_last)
    switch_precision_and_attention(bench, config, on=True)
    # inductor leaves the UNet's training graph in NCHW (its heuristic skips convolutions with twice as many
    # input as output channels, the decoder's skip concatenations), so cuDNN transposes around each conv
    import torch._inductor.config
    torch._inductor.config.force_layout_optimization = config.force_layout_opt
    if config.vae_compile:
        compile_vae_encoder(models, channels_last=config.vae_channels_last)
    detail = apply_model_levers(bench, config)
    model = distributed.wrap(unet, processes, "ddp")
    torch.backends.cudnn.benchmark = config.cudnn_benchmark
    profile_steps = 3 if config.name in bench.profile else 0
    plan = plan_from_args(None, warmup + steps + profile_steps, batch, resolution, None, 0, models.default_resolution)
    # what clipping, AdamW and the EMA update: the UNet's parameters, or with bf16w their fp32 masters
    trained = bench.master_weights.masters if bench.master_weights else unet
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1.0, fused=True if config.fused_adamw else None)
    if bench.master_weights:
        bench.master_weights.track(optimizer)  # each step copies the masters into the bf16 weights
    # `model` keeps DDP's gradient-sync switch and the step calls step_module(model), as in trainer.jobs.train
    step_model = step_module(model, config)
    trainee = Trainee(trained, model, step_model, optimizer,
                      LambdaLR(optimizer, lambda steps_done: plan.learning_rate(steps_done + 1)),
                      EMA(trained.named_parameters(), 0.9999),
                      GraphedBackward(step_model, list(trained.parameters())) if config.step_graphs else None)
    del model, optimizer
    settings = StepSettings(seed=args.seed, gradient_accumulation=accumulation,
                            sync_every_micro_batch=config.sync_every_micro_batch)
    batches, pinned = start_batches(bench, config, plan, batch)
    if first:
        bench.marks["loader_started"] = time.time() - PROCESS_START
        batches = first_marked(batches, bench.marks)

    step_times, skipped, window, losses = [], 0, Window(), []
    figures, profiler = None, None
    for step in range(1, plan.total_steps + 1):
        if step == warmup + 1:
            window = Window()  # the timed steps only
        if step == warmup + steps + 1:  # the profiled steps, after the timed ones
            torch.cuda.synchronize() if device.type == "cuda" else None
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        started = time.perf_counter()
        if config.graphs:  # a new step: the graphs' output buffers from the last one may be reused
            torch.compiler.cudagraph_mark_step_begin()
        outcome = train_step(trainee, models, batches, window, settings, step, processes)
        skipped += not outcome.finite
        losses.append(outcome.loss)
        elapsed = time.perf_counter() - started  # the step ends in host syncs (.item()), so this is its wall time
        if first and step == 1:
            bench.marks["first_step"] = time.time() - PROCESS_START
        if warmup < step <= warmup + steps:
            step_times.append(elapsed)
        if step == warmup + steps:
            figures = window.figures(window.loss_sum.item() / max(window.good_steps, 1))
        if step == 1 or step == warmup or step == plan.total_steps:
            note(config=config.name, step=step, step_s=round(elapsed, 3), loss=round(outcome.loss.item(), 4))
    profile = None
    if profiler is not None:
        torch.cuda.synchronize() if device.type == "cuda" else None
        profiler.__exit__(None, None, None)
        profile = profile_summary(profiler, profile_steps)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    losses = [round(loss, 5) for loss in torch.stack(losses).tolist()]
    del trainee, batches, profiler, outcome, trained
    release(bench, config)
    median = statistics.median(step_times)
    images_per_step = batch * accumulation
    return {"batch": batch, "accumulation": accumulation, "images_per_step": images_per_step, "resolution": resolution,
            "pin_memory": pinned, "median_step_s": round(median, 4),
            "img_per_s": round(images_per_step / median, 2), "img_per_s_window_mean": figures["img_per_s"],
            "data_wait_share": figures["data_wait_share"], "peak_gpu_mem_gib": round(peak_gib, 2) if peak_gib else None,
            "timed_steps": len(step_times), "warmup_steps": warmup, "skipped_steps": skipped,
            "step_s_min_max": [round(min(step_times), 4), round(max(step_times), 4)], "loss": figures["loss"],
            **detail, "profile": profile, "losses": losses}


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


# ---------------------------------------------------------------- GPU JPEG decode


def shard_jpegs(shards: str, count: int, resolution: int, size_multiple: int) -> tuple[list[bytes], list[tuple[int, int]]]:
    """(the first `count` JPEG members of the image shards, the bucket the loader crops each to at `resolution`)."""
    from trainer.data.plan import buckets_of
    from trainer.data.shards import ShardReader, index_shards
    index = index_shards(shards)
    sizes, assignment = buckets_of(index.aspect, resolution, size_multiple, True)
    reader, jpegs, buckets = ShardReader(index), [], []
    for row in range(len(index)):
        members = reader.read(row)
        data = members.get("jpg") or members.get("jpeg")
        if data:
            jpegs.append(data)
            buckets.append(sizes[assignment[row]])
        if len(jpegs) == count:
            break
    return jpegs, buckets


def cpu_decode_s(jpegs: list[bytes], buckets: list[tuple[int, int]]) -> float:
    """Seconds per image of the image loader's work, one process on one thread (as a DataLoader worker
    runs): trainer.data.images' decode_image + crop_to_bucket (scale to cover, crop, to a [-1, 1] tensor)."""
    import torch

    from trainer.data.images import crop_to_bucket, decode_image
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # DataLoader workers run torch on one thread each
    try:
        crop_to_bucket(decode_image(jpegs[0], "JPEG"), buckets[0], (0.5, 0.5))  # first-call costs out of the figure
        started = time.perf_counter()
        for data, bucket in zip(jpegs, buckets):
            crop_to_bucket(decode_image(data, "JPEG"), bucket, (0.5, 0.5))
        return (time.perf_counter() - started) / len(jpegs)
    finally:
        torch.set_num_threads(threads)


def gpu_crop_to_bucket(image, bucket: tuple[int, int]):
    """crop_to_bucket on the GPU: an image [3, H, W] uint8 scaled to cover the bucket (bicubic, antialiased,
    clamped as Pillow's 8-bit result is), centre-cropped, in [-1, 1]."""
    import torch.nn.functional as F

    from trainer.data.buckets import cover_and_crop
    (width, height), (left, top) = cover_and_crop(image.shape[2], image.shape[1], bucket, (0.5, 0.5))
    resized = F.interpolate(image[None].float(), size=(height, width), mode="bicubic", antialias=True).clamp_(0, 255)
    return resized[0, :, top:top + bucket[1], left:left + bucket[0]] / 127.5 - 1.0


def gpu_decode_s(jpegs: list[bytes], buckets: list[tuple[int, int]], device, chunk: int) -> float:
    """Seconds per image (wall, the GPU otherwise idle) of torchvision.io.decode_jpeg on the GPU, `chunk`
    JPEGs per call (a step's batch), then gpu_crop_to_bucket; the median of three passes after a warm-up."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg  # missing, it is the decode line's error, not the run's
    if device.type != "cuda":
        raise RuntimeError("no CUDA device: torchvision's GPU decode needs one")
    encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in jpegs]

    def one_pass() -> None:
        for first in range(0, len(encoded), chunk):
            images = decode_jpeg(encoded[first:first + chunk], mode=ImageReadMode.RGB, device=device)  # as decode_image
            for image, bucket in zip(images, buckets[first:first + chunk]):
                gpu_crop_to_bucket(image, bucket)
        torch.cuda.synchronize(device)

    one_pass()  # nvJPEG's handles and the kernels' first launches
    times = []
    for _ in range(3):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return statistics.median(times) / len(jpegs)


def decode_verdict(capacity: float, consumption: float | None, workers_needed: int | None, gpu_busy: float | None) -> str:
    """What the figures say about moving JPEG decode onto the GPU."""
    gpu_cost = f"~{gpu_busy:.1%} of the GPU's time at that rate" if gpu_busy is not None else "a GPU cost not measured here"
    if consumption is None:
        return f"no image configuration ran: the CPU loader can deliver {capacity:.0f} img/s; nothing to compare it with"
    if capacity >= consumption:
        return (f"the CPU loader keeps up ({capacity:.0f} img/s capacity >= {consumption:.0f} img/s consumed, "
                f"{capacity / consumption:.1f}x headroom): GPU decode would only add GPU work ({gpu_cost})")
    return (f"the CPU loader is short ({capacity:.0f} img/s capacity < {consumption:.0f} img/s consumed; "
            f"{workers_needed} workers would keep up): GPU decode would relieve it for {gpu_cost}")


def decode_bench(bench: Bench, lines: list[dict], count: int) -> dict:
    """The `train.lever.gpu_jpeg_decode` line: CPU loader vs GPU decode on `count` JPEGs of the shards."""
    args, models, device = bench.args, bench.models, bench.device
    image_lines = [line for line in lines if line.get("value") and line["metric"].startswith("train.config.")
                   and parse_config(line["config"]["name"]).source == "image"]
    fastest = max(image_lines, key=lambda line: line["value"]) if image_lines else None
    resolution = fastest["config"]["resolution"] if fastest else args.image_size
    jpegs, buckets = shard_jpegs(args.shards, count, resolution, models.size_multiple)
    cpu_s = cpu_decode_s(jpegs, buckets)
    capacity = args.num_workers / cpu_s
    consumption = fastest["value"] if fastest else None
    gpu_s, error = None, None
    try:
        gpu_s = gpu_decode_s(jpegs, buckets, device, fastest["config"]["batch"] if fastest else 32)
    except ImportError as missing:
        error = f"torchvision is not installed ({missing})"
    except RuntimeError as failed:
        error = f"{type(failed).__name__}: {str(failed)[:200]}"
    gpu_busy = consumption * gpu_s if consumption and gpu_s else None
    workers_needed = math.ceil(consumption * cpu_s) if consumption else None
    line = {"metric": "train.lever.gpu_jpeg_decode", "value": round(gpu_s * 1000, 3) if gpu_s else None,
            "unit": "GPU ms/image", "gpu_ms_per_image": round(gpu_s * 1000, 3) if gpu_s else None,
            "cpu_ms_per_image": round(cpu_s * 1000, 3), "cpu_loader_capacity_img_per_s": round(capacity, 1),
            "consumption_img_per_s": consumption, "consumption_config": fastest["config"]["name"] if fastest else None,
            "data_wait_share": fastest["config"]["data_wait_share"] if fastest else None,
            "workers_needed": workers_needed, "gpu_busy_share_at_consumption": round(gpu_busy, 4) if gpu_busy else None,
            "verdict": decode_verdict(capacity, consumption, workers_needed, gpu_busy)}
    if error:
        line["error"] = error
    line["config"] = {"images": len(jpegs), "resolution": resolution, "buckets": sorted({f"{w}x{h}" for w, h in buckets}),
                      "jpeg_kib_mean": round(sum(map(len, jpegs)) / len(jpegs) / 1024, 1), "num_workers": args.num_workers,
                      "nproc": os.cpu_count(),
                      "cpu": "trainer.data.images.decode_image + crop_to_bucket (Pillow bicubic), 1 process, 1 torch thread",
                      "gpu": "torchvision.io.decode_jpeg(list, device='cuda') per batch + interpolate (bicubic, antialias) "
                             "+ crop; wall time with the GPU otherwise idle",
                      "capacity": "num_workers / CPU s per image (reading the tar members and collating left out)"}
    return line


# ---------------------------------------------------------------- main


def versions() -> dict:
    import diffusers
    import torch
    found = {"python": platform.python_version(), "torch": torch.__version__, "diffusers": diffusers.__version__,
             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None}
    try:
        import wids  # noqa: F401
        from importlib.metadata import version
        found["wids"] = version("wids")
    except Exception:  # noqa: BLE001
        pass
    return found


def commit() -> str:
    def git(*words):
        return subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if os.environ.get("BENCH_COMMIT"):  # the device machine's copy has no git history: pass it in
        return os.environ["BENCH_COMMIT"]
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="/tmp/bench-shards")
    parser.add_argument("--make-shards", type=int, default=0, help="write this many synthetic --image-size JPEG samples first")
    parser.add_argument("--imagefolder", default=None, help="also write the same JPEGs here (for the diffusers baseline)")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--model-config", default="sd2")
    parser.add_argument("--configs", default="image512,image256,latent512,latent256,latent512+cl,latent512+fused,latent512+b64")
    parser.add_argument("--batch-512", type=int, default=32)
    parser.add_argument("--batch-256", type=int, default=128)
    parser.add_argument("--batch-1024", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--compile-warmup", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds after process start; later configs are skipped")
    parser.add_argument("--compile-needs", type=float, default=150, help="seconds a compile config needs before the deadline")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    parser.add_argument("--encode", default="", help="resolutions to encode the image shards at first (trainer/jobs/encode.py)")
    parser.add_argument("--latent-dir", default="/tmp/bench-latents")
    parser.add_argument("--compile-cache", default=None,
                        help="trainer.speed.compile_cache's directory: the first configuration (compiled) loads its shape's "
                             "file before its first step and saves it after; gives train.first_step_s_compiled_warm/cold")
    parser.add_argument("--encode-batch", type=int, default=32)
    parser.add_argument("--encode-compile", action="store_true",
                        help="after each --encode resolution, encode again with the VAE encoder compiled and every call "
                             "padded (trainer.jobs.encode --compile), twice: train.encode_img_per_s_<res>_compiled (cold, "
                             "compile included) and _compiled_warm, each with its ratio to the eager encode")
    parser.add_argument("--parity-steps", type=int, default=0, metavar="N",
                        help="after the configurations, --parity-base and --parity-base+fp8 N steps each from the same "
                             "weights, seed and data: train.lever.fp8_loss_parity (the last 50 steps' loss means)")
    parser.add_argument("--parity-base", default="latent512+default",
                        help="the configuration the parity run compares +fp8 against (a smaller eager one is cheaper)")
    parser.add_argument("--profile", default="", help="configurations to profile (3 steps after the timed ones)")
    parser.add_argument("--count-flops", action="store_true",
                        help="count the UNet's (and VAE encoder's) FLOPs per image with FlopCounterMode, once per resolution")
    parser.add_argument("--decode-bench", type=int, default=0, metavar="N",
                        help="after the configurations, CPU loader vs GPU (torchvision) JPEG decode on N JPEGs of the shards")
    args = parser.parse_args()
    if args.make_shards and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--make-shards writes the shards from one process: make them first without torchrun")
    return args


def encode_line(bench: Bench, resolution: int, common: dict) -> dict | None:
    """Encode the image shards at `resolution` (rank 0; the other ranks wait and read them): the encode line, on rank 0."""
    from trainer.data.latents import latent_dir, models_identity
    from trainer.jobs.encode import encode_shards
    from trainer.runtime import distributed
    args, models, processes = bench.args, bench.models, bench.processes
    started = time.time()
    identity = bench.identity or models_identity(models)
    hashed = time.time() - started
    bench.identity = identity
    bench.latent_dirs[resolution] = str(latent_dir(args.latent_dir, identity, resolution))
    summary = None
    if processes.rank == 0:  # ranks writing the same shards would overwrite each other's
        summary = encode_shards(args.shards, args.latent_dir, models, resolution, bench.device, args.encode_batch,
                                args.num_workers, True, identity)
    distributed.barrier()
    if summary is None:
        return None
    if not summary["samples_encoded"]:  # every latent shard was there already (an earlier call on this machine)
        print(json.dumps({"progress": True, "event": "encode_skipped", "resolution": resolution,
                          "note": "latent shards already present; no rate to report"}), flush=True)
        return None
    rate = summary["samples_encoded"] / max(summary["seconds"], 1e-9)
    line = {"metric": f"train.encode_img_per_s_{resolution}", "value": round(rate, 1), "unit": "img/s",
            "config": {"samples": summary["samples_encoded"], "shards": summary["shards_written"],
                       "seconds": summary["seconds"], "identity_hash_s": round(hashed, 1), "batch": args.encode_batch,
                       "num_workers": args.num_workers, "corrupt": len(summary["corrupt"]), "vae": "bf16, eager",
                       "note": "trainer.jobs.encode.encode_shards: decode + bucket crop (loader workers), VAE encoder, "
                               "tokenizer, safetensors + tar writing"}, **common}
    vae_tflop, basis = vae_figure(bench, resolution)
    if vae_tflop:
        line["vae_tflop_per_s"], line["vae_flops_basis"] = significant(rate * vae_tflop), basis
    return line


def compiled_encode_lines(bench: Bench, resolution: int, common: dict, eager: dict | None) -> list[dict]:
    """The same encode with the VAE encoder compiled and padded calls, twice in this process: the first
    pays the compile (one graph per bucket shape), the second is the steady rate."""
    from trainer.jobs.encode import encode_shards
    from trainer.speed.vae_compile import compile_vae_encoder, vae_encoder_eager
    args, models = bench.args, bench.models
    compile_vae_encoder(models)
    lines = []
    for run in ("compiled", "compiled_warm"):
        summary = encode_shards(args.shards, f"{args.latent_dir}-{run}", models, resolution, bench.device,
                                args.encode_batch, args.num_workers, True, bench.identity, padded=True)
        rate = summary["samples_encoded"] / max(summary["seconds"], 1e-9)
        lines.append({"metric": f"train.encode_img_per_s_{resolution}_{run}", "value": round(rate, 1), "unit": "img/s",
                      "ratio_vs_eager": round(rate / eager["value"], 3) if eager else None,
                      "config": {"samples": summary["samples_encoded"], "seconds": summary["seconds"], "batch": args.encode_batch,
                                 "vae": "bf16, encoder compiled (trainer.speed.vae_compile.compile_vae_encoder), calls padded",
                                 "note": "compile included" if run == "compiled" else "graphs compiled by the run before"},
                      **common})
    vae_encoder_eager(models)
    return lines


SOURCE_LABELS = {"image": "image shards, VAE + text encoder online",
                 "latent": "latent shards (trainer/jobs/encode.py) through the trainer's loader; text encoder online on stored ids",
                 "resident": "unet-only, latents resident (random latents on the GPU; NOT latent shards)"}


def config_line(bench: Bench, config: Configuration, result: dict, measured: dict[str, float], wall_s: float) -> dict:
    """A configuration's line: img/s, its ratios to the configurations it is measured against, FLOPs and MFU."""
    name, base, value = config.name, config.base, result["img_per_s"]
    line = {"metric": f"train.config.{name}", "value": value, "unit": "img/s"}
    if name != base and base in measured:
        line["ratio_vs_plain"], line["plain_img_per_s"] = round(value / measured[base], 3), measured[base]
    without = without_last_lever(name)
    if without in measured:
        line["ratio_vs_without"] = round(value / measured[without], 3)
        line["without"], line["without_img_per_s"] = without, measured[without]
    line.update(flops_fields(bench, config.source, result["resolution"], value))
    line["config"] = {"name": name, "source": SOURCE_LABELS[config.source],
                      "channels_last": config.channels_last, "fused_adamw": config.fused_adamw,
                      "torch_compile": config.compile, "cuda_graphs": config.graphs, "step_graphs": config.step_graphs,
                      "cudnn_benchmark": config.cudnn_benchmark, "vae_compile": config.vae_compile,
                      "vae_channels_last": config.vae_channels_last, "force_layout_opt": config.force_layout_opt,
                      "gradient_sync": "every micro-batch" if config.sync_every_micro_batch else "last micro-batch",
                      "weights": ("bf16 + fp32 master (trainer.speed.master_weights)" if config.bf16_weights
                                  else "fp32" if config.fp32 else "fp32 under bf16 autocast"),
                      "fp8": (f"torchao float8, tensorwise dynamic scaling, {result.get('float8_linears')} "
                              "transformer-block linears" if config.fp8 else None),
                      "groupnorm_silu": (f"fused {result.get('groupnorm_silu_path')}, "
                                         f"{result.get('groupnorm_silu_blocks')} ResnetBlock2D"
                                         if config.fused_groupnorm_silu else "GroupNorm then SiLU"),
                      "world_size": bench.processes.world_size, **result, "config_wall_s": round(wall_s, 1)}
    if config.sync_every_micro_batch and bench.processes.world_size == 1:
        line["config"]["note"] = "world size 1: no all-reduce either way; sync means something under torchrun only"
    return line


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


PARITY_TAIL = 50  # the steps at the end of each loss curve that are compared


def fp8_parity_line(bench: Bench, base: str, steps: int) -> dict:
    """`base` and `base+fp8`, `steps` steps each from the same weights, seed and data order: their loss curves'
    means over the last PARITY_TAIL steps and the ratio (fp8 / without)."""
    import torch
    names = [base, f"{base}+fp8"]
    line = {"metric": "train.lever.fp8_loss_parity", "value": None, "unit": "fp8 loss / loss without, tail means"}
    skip = fp8_unavailable(bench.device)
    if skip:
        return {**line, "skipped": skip, "config": {"names": names, "steps": steps}}
    unet = bench.models.denoiser
    start = {key: value.detach().clone() for key, value in unet.state_dict().items()}  # both runs start here
    curves, results = {}, {}
    for name in names:
        config = apply_fast_default(parse_config(name), bench.args.model_config)
        unet.load_state_dict(start)
        torch.manual_seed(bench.args.seed)  # whatever draws from the global generator (resident latents) draws the same
        try:
            result = run_config(bench, config, steps, 0, first=False)
        except (torch.OutOfMemoryError, RuntimeError) as error:
            release(bench, config)
            return {**line, "error": f"{name}: {type(error).__name__}: {str(error)[:300]}", "config": {"names": names}}
        result.pop("profile")
        curves[name], results[name] = result.pop("losses"), result
    unet.load_state_dict(start)
    del start
    tail = min(PARITY_TAIL, steps)
    means = [statistics.fmean(curves[name][-tail:]) for name in names]
    stride = max(steps // 20, 1)
    return {**line, "value": round(means[1] / means[0], 4), "tail_steps": tail,
            "tail_mean_loss": dict(zip(names, [round(mean, 5) for mean in means])),
            "img_per_s": {name: results[name]["img_per_s"] for name in names},
            "curves_every_n_steps": stride, "curves": {name: curves[name][::stride] for name in names},
            "config": {"names": names, "steps": steps, "batch": results[names[0]]["batch"],
                       "accumulation": results[names[0]]["accumulation"],
                       "float8_linears": results[names[1]].get("float8_linears"), "seed": bench.args.seed,
                       "note": "same initial weights, seed, noise and data order; random-init UNet"}}


def first_config_cache(bench: Bench, config: Configuration) -> FirstCache:
    """The compile cache of the first configuration's shape, as trainer.jobs.train keys and loads it."""
    from trainer.speed.compile_cache import JobCache, cache_key
    key = cache_key(bench.models.denoiser, bench.device, "image" if config.source == "image" else "latent",
                    config.resolution, bench.batch_of(config), config.channels_last, bench.processes.world_size)
    job = JobCache(Path(bench.args.compile_cache), [key], bench.processes.rank, environ={})
    return FirstCache(key, job, job.load())


def main() -> None:
    global PROCESS_START
    args = parse_args()
    if args.make_shards:
        made = time.time()
        make_shards(Path(args.shards), args.make_shards, args.image_size, 256, Path(args.imagefolder) if args.imagefolder else None)
        note(event="shards", samples=args.make_shards, seconds=round(time.time() - made, 1))
        if not args.configs:
            return
        PROCESS_START = time.time()  # first_step_s counts from here: shard making is the benchmark's, not the trainer's

    import torch

    from trainer.models.loading import load_models
    from trainer.runtime import distributed
    marks = {"imports": time.time() - PROCESS_START}
    processes = distributed.setup()
    device = processes.device
    models = load_models(args.model_config, None, args.seed, device=device)  # the UNet built on the GPU
    marks["models_built"] = time.time() - PROCESS_START
    torch.manual_seed(args.seed)
    models.frozen_to(device)
    marks["models_on_device"] = time.time() - PROCESS_START
    params = sum(p.numel() for p in models.denoiser.parameters())
    note(event="models", unet_params=params, marks=marks)

    machine = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "nproc": os.cpu_count(),
               "host": platform.node()}
    common = {"commit": commit(), "machine": machine, "versions": versions(), "model_config": args.model_config,
              "unet_params_m": round(params / 1e6, 1), "precision": "bf16 autocast, fp32 weights/AdamW/EMA",
              "num_workers": args.num_workers, "ema": True, "attention": "SDPA (diffusers AttnProcessor2_0)",
              "rank": processes.rank, "world_size": processes.world_size}
    batch_default = {512: args.batch_512, 256: args.batch_256, 1024: args.batch_1024, 64: 4, 32: 8, 128: 8, 16: 8}
    bench = Bench(args, models, processes, marks, set(filter(None, args.profile.split(","))), batch_default)
    measured: dict[str, float] = {}  # img/s of every configuration run so far, by name
    profiles: dict[str, dict | None] = {}  # their profiles (--profile), by name
    lines = []

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        lines.append(line)
        if args.out:
            with open(args.out, "a") as out:
                out.write(text + "\n")

    for resolution in [int(r) for r in args.encode.split(",") if r]:
        started = time.time()
        line = encode_line(bench, resolution, common)
        if line:
            emit(line)
        if args.encode_compile:
            for compiled in compiled_encode_lines(bench, resolution, common, line):
                emit(compiled)
        PROCESS_START += time.time() - started  # the encode job is its own job: first_step_s leaves it out

    cache = None  # --compile-cache: the first configuration's compiled shape, loaded before its first step
    for number, name in enumerate(name for name in args.configs.split(",") if name):
        config = apply_fast_default(parse_config(name), args.model_config)
        if number == 0 and config.compile and args.compile_cache:
            cache = first_config_cache(bench, config)
            emit({"metric": "train.compile_cache_load", "value": len(cache.outcome["loaded"]), "unit": "files",
                  "config": {"name": name, **cache.outcome}, **common})
        left = args.deadline - (time.time() - PROCESS_START)
        skip = lever_unavailable(config, device, processes.world_size)
        if not skip and left < (args.compile_needs if config.compile else 20):
            skip = f"{left:.0f} s left before the deadline"
        if skip:
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "skipped": skip, **common})
            continue
        warmup = args.compile_warmup if config.compile else args.warmup
        started, failure = time.time(), None
        try:
            result = run_config(bench, config, args.steps, warmup, first=number == 0)
        except torch.OutOfMemoryError as error:
            failure = f"OOM: {str(error)[:200]}"
        except RuntimeError as error:  # a lever that fails (CUDA graphs, say) leaves the other configurations their run
            if name == config.base:
                raise
            failure = f"{type(error).__name__}: {str(error)[:300]}"
        if failure:
            release(bench, config)  # out here, where no traceback holds the failed step's tensors any more
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "error": failure, **common})
            continue
        profile, _ = result.pop("profile"), result.pop("losses")
        line = config_line(bench, config, result, measured, time.time() - started)
        measured[name], profiles[name] = result["img_per_s"], profile
        emit({**line, **common})
        if profile:
            emit({"metric": f"train.profile.{name}", "value": profile["gpu_ms_per_step"], "unit": "GPU ms/step (kernels)",
                  "config": {"name": name, "batch": result["batch"], "profiled_steps": 3}, **profile,
                  "commit": common["commit"], "machine": machine})
        if number == 0:
            emit({"metric": "train.first_step_s", "value": round(marks["first_step"], 1), "unit": "s", "goal": 45,
                  "config": {"name": name, "phases_s": {k: round(v, 1) for k, v in marks.items()},
                             "note": "process start -> first optimizer step, trainer.jobs.train.main's setup order"}, **common})
            if cache is not None:  # a compiled first configuration with --compile-cache: warm or cold
                warm = bool(cache.outcome["loaded"])
                emit({"metric": f"train.first_step_s_compiled_{'warm' if warm else 'cold'}", "value": round(marks["first_step"], 1),
                      "unit": "s", "goal": 45 if warm else None,
                      "config": {"name": name, "cache_file": cache.key.file_name, "loaded": warm,
                                 "saved": cache.job.save(0), "phases_s": {k: round(v, 1) for k, v in marks.items()},
                                 "note": "process start -> first optimizer step; warm: trainer.speed.compile_cache's file from "
                                         "an earlier process, its own Inductor and Triton directories empty"}, **common})
            emit({"metric": "train.data_wait_share", "value": result["data_wait_share"], "unit": "share of step time",
                  "goal": 0.005, "config": {"name": name, "num_workers": args.num_workers, "batch": result["batch"],
                                            "timed_steps": result["timed_steps"]}, **common})
    # each goal's figure: the fastest configuration of its source and resolution in this run
    for (source, resolution), (metric, goal) in GOALS.items():
        candidates = [line for line in lines if line.get("value") and line["metric"].startswith("train.config.")
                      and parse_config(line["config"]["name"]).source == source
                      and line["config"]["resolution"] == resolution]
        if GOAL_PRESETS.get(metric, args.model_config) != args.model_config:
            continue
        if candidates:
            best = max(candidates, key=lambda line: line["value"])
            summary = {**best, "metric": metric, "goal": goal, "best_of": [line["config"]["name"] for line in candidates]}
            if best["value"] < goal:  # a missed goal's row says what bounds it
                vae = vae_figure(bench, resolution)[0] if source == "image" else None
                summary["bound"] = bound_of(best, profiles.get(best["config"]["name"]), unet_figure(bench, resolution),
                                            vae)
            emit(summary)
    # what a job gets is `<base>+default` itself: a lever measured on top of it is not the default
    for line in [line for line in lines if line["metric"].startswith("train.config.") and line.get("value")
                 and line["config"]["name"].endswith("+default")]:
        resolution = line["config"]["resolution"]
        emit({**line, "metric": f"train.img_per_s_{resolution}_default", "goal": DEFAULT_GOALS.get(resolution),
              "note": "the configuration trainer/configs/defaults/fast.json gives a job with default parameters"})
    if args.decode_bench:
        emit({**decode_bench(bench, lines, args.decode_bench), **common})
    if args.parity_steps:
        left = args.deadline - (time.time() - PROCESS_START)
        if left < args.compile_needs:
            emit({"metric": "train.lever.fp8_loss_parity", "value": None,
                  "skipped": f"{left:.0f} s left before the deadline", **common})
        else:
            emit({**fp8_parity_line(bench, args.parity_base, args.parity_steps), **common})
    note(event="done", seconds=round(time.time() - PROCESS_START, 1))


if __name__ == "__main__":
    main()
