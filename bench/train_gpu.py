"""Benchmark the trainer's real training step on one GPU: one JSON line per configuration.

    PYTHONUNBUFFERED=1 python bench/train_gpu.py --shards /tmp/shards --make-shards 2048 --out $OUT/train.jsonl

Run it through the device tool (bench/gpu_wheels.sh fetches the wheels the GPU machine lacks).
Everything is the trainer's own code: models from `trainer.models.load_models` (a preset, random
init), the step of `trainer.train.main` (trainer.objective.diffusion_loss, backward, gradient
clipping, the all-ranks finiteness check, AdamW, the EMA, the LR schedule) and, for image shards,
the trainer's loader (`index_shards`, `BatchPlan`, `StepBatches`, `make_loader`) with its own
data-wait timing (`trainer.health.Window`).

Configurations (`--configs`, comma-separated, run in order in this one process):
- `image512`, `image256`: image shards, VAE and text encoder online.
- `latent512`, `latent256`: latent shards written by trainer/encode.py (`--encode 512,256` first
  encodes the image shards with the same models and reports `train.encode_img_per_s_<res>`), read
  through the trainer's loader; the UNet and the text encoder (on the stored token ids) run.
- `resident512`, `resident256`: "unet-only, latents resident": random latents already on the GPU
  (`batch["latents"]`), no loader; the upper bound of the latent-shard path.
- levers on a base config, measured one at a time: `<base>+cl` (channels_last UNet),
  `<base>+fused` (fused AdamW), `<base>+b<N>` (batch N), `<base>+compile` (torch.compile of the UNet,
  as `trainer.train --compile`), `<base>+cudnn` (cudnn.benchmark), combinations joined with `+`.
  Each lever line carries `ratio_vs_plain` against `<base>` measured earlier in the same process.
- `--profile NAME,...`: after those configurations' timed steps, 3 more under torch.profiler; a
  `train.profile.<name>` line gives the top CUDA kernels and the shares of attention, convolution,
  matmul, normalisation, elementwise and optimizer kernels.

The first configuration also gives `train.first_step_s`: process start to the first optimizer step,
with the same setup order as trainer.train.main (models built, moved to the GPU, optimizer, EMA,
shards indexed, loader started).
"""

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
from multiprocessing import Pool  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# FLOPs per image (../shared/BENCHMARKS.md): UNet forward + backward; VAE encoder forward.
UNET_TFLOP = {256: 0.54, 512: 2.41, 1024: 14.0}
VAE_TFLOP = {256: 0.28, 512: 1.12}
PEAK_SPEC, PEAK_MEASURED = 989.0, 790.0
GOALS = {("latent", 512): ("train.img_per_s_512_latent", 200), ("latent", 256): ("train.img_per_s_256_latent", 900),
         ("image", 512): ("train.img_per_s_512_image", 110)}
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
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for number in range(first, first + count):
            data = synthetic_jpeg(number, size)
            key = hashlib.sha256(data).hexdigest()
            caption = CAPTIONS[number % len(CAPTIONS)]
            record = json.dumps({"width": size, "height": size, "format": "JPEG", "partner": "bench",
                                 "license": "synthetic"}).encode()
            for extension, body in (("jpg", data), ("json", record), ("txt", caption.encode())):
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mtime, info.mode = len(body), 0, 0o644
                tar.addfile(info, io.BytesIO(body))
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
LEVERS = ("cl", "fused", "compile", "cudnn")


def parse_config(name: str) -> dict:
    """'latent512+fused+b64' -> source, resolution, levers."""
    base, *levers = name.split("+")
    source = next(source for source in SOURCES if base.startswith(source))
    config = {"name": name, "base": base, "source": source, "resolution": int(base[len(source):]),
              "channels_last": "cl" in levers, "fused_adamw": "fused" in levers, "compile": "compile" in levers,
              "cudnn_benchmark": "cudnn" in levers, "batch": None}
    for lever in levers:
        if lever.startswith("b") and lever[1:].isdigit():
            config["batch"] = int(lever[1:])
        elif lever not in LEVERS:
            raise ValueError(f"unknown lever {lever!r} in {name!r}")
    return config


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


def resident_latents(models, batch: int, resolution: int, device, pool: int = 4):
    """Batches of precomputed latents already on the GPU, cycled (unet-only, latents resident)."""
    import torch
    side = resolution // models.vae_scale_factor
    tensors = [torch.randn(batch, models.unet.config.in_channels, side, side, device=device) for _ in range(pool)]
    number = 0
    while True:
        yield {"latents": tensors[number % pool], "caption": [CAPTIONS[(number + i) % len(CAPTIONS)] for i in range(batch)],
               "key": [str(i) for i in range(batch)], "corrupt": [], "shard": []}
        number += 1


def latent_batches(ctx: dict, resolution: int, plan, batch_plan_args) -> "StepBatches":
    """The trainer's own latent-shard loader over the shards `--encode` wrote at this resolution."""
    from trainer.data import BatchPlan, StepBatches, index_shards
    from trainer.encode import check_latent_shards
    from trainer.models import caption_ids
    models, processes = ctx["models"], ctx["processes"]
    key = f"latent_index_{resolution}"
    if key not in ctx:
        ctx[key] = index_shards(ctx["latent_dirs"][resolution], processes.local_rank, processes.local_world_size)
        check_latent_shards(ctx[key], models, {resolution})  # as trainer.train does (hashes the VAE and text encoder)
    index = ctx[key]
    batch_plan = BatchPlan(index.aspect, plan, *batch_plan_args, models.size_multiple, True)
    return StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False, caption_ids(models, [""])[0].numpy())


def run_config(ctx: dict, config: dict, steps: int, warmup: int, batch_default: dict, first: bool) -> dict:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from trainer import distributed
    from trainer.data import BatchPlan, StepBatches, make_loader
    from trainer.ema import EMA
    from trainer.health import Window
    from trainer.objective import diffusion_loss, step_generator
    from trainer.stages import plan_from_args
    from trainer.train import whole

    args, models, processes, device = ctx["args"], ctx["models"], ctx["processes"], ctx["device"]
    unet = models.unet
    resolution, batch = config["resolution"], config["batch"] or batch_default[config["resolution"]]
    torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
    if config["channels_last"]:
        unet.to(memory_format=torch.channels_last)
    model = distributed.wrap(unet, processes, "ddp")
    torch.backends.cudnn.benchmark = config["cudnn_benchmark"]
    step_model = torch.compile(model, dynamic=False) if config["compile"] else model  # as trainer.train --compile
    profile_steps = 3 if config["name"] in ctx["profile"] else 0
    plan = plan_from_args(None, warmup + steps + profile_steps, batch, resolution, None, 0, models.default_resolution)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1.0, fused=True if config["fused_adamw"] else None)
    lr_schedule = LambdaLR(optimizer, lambda steps_done: plan.learning_rate(steps_done + 1))
    ema = EMA(unet.named_parameters(), 0.9999)
    loader_iter = None
    if config["source"] == "image":
        if "index" not in ctx:
            from trainer.data import index_shards
            ctx["index"] = index_shards(args.shards, processes.local_rank, processes.local_world_size)
            ctx["marks"]["shards_indexed"] = time.time() - PROCESS_START
        index = ctx["index"]
        batch_plan = BatchPlan(index.aspect, plan, args.seed, processes.rank, 1, models.size_multiple, True)
        dataset = StepBatches(index, batch_plan, 1, plan.total_steps, 0.1, False)
        loader_iter = batches = iter(make_loader(dataset, args.num_workers))
    elif config["source"] == "latent":
        dataset = latent_batches(ctx, resolution, plan, (args.seed, processes.rank, 1))
        loader_iter = batches = iter(make_loader(dataset, args.num_workers))
    else:
        batches = resident_latents(models, batch, resolution, device)
    if first:
        ctx["marks"]["loader_started"] = time.time() - PROCESS_START

    step_times, skipped, window = [], 0, Window()
    figures, profiler = None, None
    for step in range(1, plan.total_steps + 1):
        if step == warmup + 1:
            window = Window()  # the timed steps only
        if step == warmup + steps + 1:  # the profiled steps, after the timed ones
            torch.cuda.synchronize() if device.type == "cuda" else None
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.__enter__()
        started = time.perf_counter()
        # ---- trainer.train.main's step, gradient_accumulation = 1
        step_loss = torch.zeros((), device=device)
        batch_data = window.wait_for(batches)
        if first and step == 1:
            ctx["marks"]["first_batch"] = time.time() - PROCESS_START
        with distributed.gradient_sync(model, True):
            loss = diffusion_loss(step_model, models, batch_data, device, step_generator(args.seed, step, processes.rank, 0, device))
            loss.backward()
        step_loss += loss.detach()
        window.images += len(batch_data["key"]) * processes.world_size
        grad_norm = whole(torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0))
        if distributed.all_finite(step_loss, grad_norm):
            optimizer.step()
            ema.update(unet.named_parameters())
            window.loss_sum += step_loss.cpu()
            window.good_steps, window.grad_norm = window.good_steps + 1, grad_norm.item()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        lr_schedule.step()
        # ----
        elapsed = time.perf_counter() - started  # the step ends in host syncs (.item()), so this is its wall time
        if first and step == 1:
            ctx["marks"]["first_step"] = time.time() - PROCESS_START
        if warmup < step <= warmup + steps:
            step_times.append(elapsed)
        if step == warmup + steps:
            figures = window.figures(window.loss_sum.item() / max(window.good_steps, 1))
        if step == 1 or step == warmup or step == plan.total_steps:
            note(config=config["name"], step=step, step_s=round(elapsed, 3), loss=round(loss.item(), 4))
    profile = None
    if profiler is not None:
        torch.cuda.synchronize() if device.type == "cuda" else None
        profiler.__exit__(None, None, None)
        profile = profile_summary(profiler, profile_steps)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    del optimizer, lr_schedule, ema, batches, loader_iter, model, step_model, profiler
    if config["channels_last"]:
        unet.to(memory_format=torch.contiguous_format)
    if config["compile"]:
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    median = statistics.median(step_times)
    return {"batch": batch, "resolution": resolution, "median_step_s": round(median, 4),
            "img_per_s": round(batch / median, 2), "img_per_s_window_mean": figures["img_per_s"],
            "data_wait_share": figures["data_wait_share"], "peak_gpu_mem_gib": round(peak_gib, 2) if peak_gib else None,
            "timed_steps": len(step_times), "warmup_steps": warmup, "skipped_steps": skipped,
            "step_s_min_max": [round(min(step_times), 4), round(max(step_times), 4)], "loss": figures["loss"],
            "profile": profile}


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


def main() -> None:
    global PROCESS_START
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="/tmp/bench-shards")
    parser.add_argument("--make-shards", type=int, default=0, help="write this many synthetic 512-px JPEG samples first")
    parser.add_argument("--imagefolder", default=None, help="also write the same JPEGs here (for the diffusers baseline)")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--model-config", default="sd2")
    parser.add_argument("--configs", default="image512,image256,latent512,latent256,latent512+cl,latent512+fused,latent512+b64")
    parser.add_argument("--batch-512", type=int, default=32)
    parser.add_argument("--batch-256", type=int, default=128)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--compile-warmup", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=1e9, help="seconds after process start; later configs are skipped")
    parser.add_argument("--compile-needs", type=float, default=150, help="seconds a compile config needs before the deadline")
    parser.add_argument("--out", default=None, help="also append the JSON lines here")
    parser.add_argument("--encode", default="", help="resolutions to encode the image shards at first (trainer/encode.py)")
    parser.add_argument("--latent-dir", default="/tmp/bench-latents")
    parser.add_argument("--encode-batch", type=int, default=32)
    parser.add_argument("--profile", default="", help="configurations to profile (3 steps after the timed ones)")
    args = parser.parse_args()

    if args.make_shards:
        made = time.time()
        make_shards(Path(args.shards), args.make_shards, args.image_size, 256, Path(args.imagefolder) if args.imagefolder else None)
        note(event="shards", samples=args.make_shards, seconds=round(time.time() - made, 1))
        if not args.configs:
            return
        PROCESS_START = time.time()  # first_step_s counts from here: shard making is the benchmark's, not the trainer's

    import torch

    from trainer import distributed
    from trainer.models import load_models
    marks = {"imports": time.time() - PROCESS_START}
    processes = distributed.setup()
    device = processes.device
    models = load_models(args.model_config, None, args.seed)
    marks["models_built"] = time.time() - PROCESS_START
    torch.manual_seed(args.seed)
    models.frozen_to(device)
    models.unet.to(device)
    marks["models_on_device"] = time.time() - PROCESS_START
    params = sum(p.numel() for p in models.unet.parameters())
    note(event="models", unet_params=params, marks=marks)

    machine = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "nproc": os.cpu_count(),
               "host": platform.node()}
    common = {"commit": commit(), "machine": machine, "versions": versions(), "model_config": args.model_config,
              "unet_params_m": round(params / 1e6, 1), "precision": "bf16 autocast, fp32 weights/AdamW/EMA",
              "num_workers": args.num_workers, "ema": True, "attention": "SDPA (diffusers AttnProcessor2_0)"}
    ctx = {"args": args, "models": models, "processes": processes, "device": device, "marks": marks,
           "profile": set(filter(None, args.profile.split(","))), "latent_dirs": {}}
    batch_default = {512: args.batch_512, 256: args.batch_256, 1024: 8, 64: 4, 32: 8, 128: 8, 16: 8}
    plain: dict[str, float] = {}
    lines = []

    def emit(line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        lines.append(line)
        if args.out:
            with open(args.out, "a") as out:
                out.write(text + "\n")

    for resolution in [int(r) for r in args.encode.split(",") if r]:
        from trainer.encode import encode_shards, models_identity
        started = time.time()
        identity = ctx.get("identity") or models_identity(models)
        hashed = time.time() - started
        ctx["identity"] = identity
        summary = encode_shards(args.shards, args.latent_dir, models, resolution, device, args.encode_batch,
                                args.num_workers, True, identity)
        ctx["latent_dirs"][resolution] = summary["dir"]
        rate = summary["samples_encoded"] / max(summary["seconds"], 1e-9)
        line = {"metric": f"train.encode_img_per_s_{resolution}", "value": round(rate, 1), "unit": "img/s",
                "config": {"samples": summary["samples_encoded"], "shards": summary["shards_written"],
                           "seconds": summary["seconds"], "identity_hash_s": round(hashed, 1), "batch": args.encode_batch,
                           "num_workers": args.num_workers, "corrupt": len(summary["corrupt"]), "vae": "bf16, eager",
                           "note": "trainer.encode.encode_shards: decode + bucket crop (loader workers), VAE encoder, "
                                   "tokenizer, safetensors + tar writing"}, **common}
        if resolution in VAE_TFLOP:
            line["vae_tflop_per_s"] = round(rate * VAE_TFLOP[resolution], 1)
        emit(line)
        PROCESS_START += time.time() - started  # the encode job is its own job: first_step_s leaves it out

    for number, name in enumerate(args.configs.split(",")):
        config = parse_config(name)
        left = args.deadline - (time.time() - PROCESS_START)
        if left < (args.compile_needs if config["compile"] else 20):
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "skipped": f"{left:.0f} s left before the deadline",
                  **common})
            continue
        warmup = args.compile_warmup if config["compile"] else args.warmup
        started = time.time()
        try:
            result = run_config(ctx, config, args.steps, warmup, batch_default, first=number == 0)
        except torch.OutOfMemoryError as error:
            gc.collect()
            torch.cuda.empty_cache()
            emit({"metric": f"train.config.{name}", "value": None, "unit": "img/s", "error": f"OOM: {str(error)[:200]}", **common})
            continue
        resolution = result["resolution"]
        unet_tflop = UNET_TFLOP.get(resolution)
        line = {"metric": f"train.config.{name}", "value": result["img_per_s"], "unit": "img/s"}
        is_plain = config["name"] == config["base"]
        if is_plain:
            plain[config["base"]] = result["img_per_s"]
        elif config["base"] in plain:
            line["ratio_vs_plain"] = round(result["img_per_s"] / plain[config["base"]], 3)
            line["plain_img_per_s"] = plain[config["base"]]
        if unet_tflop:
            achieved = result["img_per_s"] * unet_tflop
            line["unet_tflop_per_s"] = round(achieved, 1)
            line["mfu_989"] = round(achieved / PEAK_SPEC, 4)
            line["mfu_790"] = round(achieved / PEAK_MEASURED, 4)
            if config["source"] == "image" and resolution in VAE_TFLOP:
                with_vae = result["img_per_s"] * (unet_tflop + VAE_TFLOP[resolution])
                line["mfu_989_incl_vae"] = round(with_vae / PEAK_SPEC, 4)
        source_label = {"image": "image shards, VAE + text encoder online",
                        "latent": "latent shards (trainer/encode.py) through the trainer's loader; text encoder online on stored ids",
                        "resident": "unet-only, latents resident (random latents on the GPU; NOT latent shards)"}[config["source"]]
        profile = result.pop("profile")
        line["config"] = {"name": name, "source": source_label,
                          "channels_last": config["channels_last"], "fused_adamw": config["fused_adamw"],
                          "torch_compile": config["compile"], "cudnn_benchmark": config["cudnn_benchmark"], **result,
                          "config_wall_s": round(time.time() - started, 1)}
        line.update(common)
        emit(line)
        if profile:
            emit({"metric": f"train.profile.{name}", "value": profile["gpu_ms_per_step"], "unit": "GPU ms/step (kernels)",
                  "config": {"name": name, "batch": result["batch"], "profiled_steps": 3}, **profile,
                  "commit": common["commit"], "machine": machine})
        if number == 0:
            emit({"metric": "train.first_step_s", "value": round(marks["first_step"], 1), "unit": "s", "goal": 45,
                  "config": {"name": name, "phases_s": {k: round(v, 1) for k, v in marks.items()},
                             "note": "process start -> first optimizer step, trainer.train.main's setup order"}, **common})
            emit({"metric": "train.data_wait_share", "value": result["data_wait_share"], "unit": "share of step time",
                  "goal": 0.005, "config": {"name": name, "num_workers": args.num_workers, "batch": result["batch"],
                                            "timed_steps": result["timed_steps"]}, **common})
    # each goal's figure: the fastest configuration of its source and resolution in this run
    for (source, resolution), (metric, goal) in GOALS.items():
        candidates = [line for line in lines if line.get("value") and line["metric"].startswith("train.config.")
                      and parse_config(line["config"]["name"])["source"] == source and line["config"]["resolution"] == resolution]
        if candidates:
            best = max(candidates, key=lambda line: line["value"])
            emit({**best, "metric": metric, "goal": goal, "best_of": [line["config"]["name"] for line in candidates]})
    note(event="done", seconds=round(time.time() - PROCESS_START, 1))


if __name__ == "__main__":
    main()
