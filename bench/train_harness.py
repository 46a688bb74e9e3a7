"""What the training benchmarks share: one process's clock, its models and state, its arguments, its JSON lines.

The bench/train_*.py scripts each answer one question about the trainer's real training step on a
GPU (train_throughput.py: img/s per configuration; train_first_step.py: process start to the first
step, and what a compile-cache file saves; train_encode.py: the encode job's rate; train_decode.py:
GPU against CPU JPEG decode; train_fp8_parity.py: fp8's loss curve), each printing one JSON line
per figure (and with `--out`, appending it there). Run them through the device tool
(bench/gpu_wheels.sh fetches the wheels the GPU machine lacks). Everything measured is the
trainer's own code: models from `trainer.models.loading.load_models` (a preset, random init), the
step `trainer.jobs.train.main` runs (bench/train_timing.py), for shards the trainer's loader.

The trainer and torch are imported late, inside functions: their import time counts in
`train.first_step_s`, which runs from process start (bench/train_timing.py).
Under torchrun every rank prints its own lines (`rank`, `world_size`); make the shards in a single
process first (bench/train_shards.py); rank 0 alone encodes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bench.stamp import commit, versions
from bench.train_shards import make_shards

if TYPE_CHECKING:  # the trainer and torch are imported late: their import time counts in train.first_step_s
    from bench.train_configs import Configuration
    from trainer.data.shards import ShardIndex
    from trainer.models.bundle import Models
    from trainer.runtime.distributed import Processes
    from trainer.speed.master_weights import MasterWeights

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "functions")]  # the trainer and what it shares with the Lambdas, as for pytest


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


def since_start() -> float:
    """Seconds since this process started (or since the clock last moved past the bench's own work)."""
    return time.time() - PROCESS_START


def skip_clock(seconds: float) -> None:
    """Leave `seconds` of the bench's own work (shards, an encode job) out of every figure timed from process start."""
    global PROCESS_START
    PROCESS_START += seconds


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
    trainer_autocast: Callable | None = None  # the autocast trainer.objectives.diffusion calls, while fp32 replaces it
    master_weights: MasterWeights | None = None  # the bf16w lever's, until release() restores fp32 weights
    float8_originals: dict[str, object] = field(default_factory=dict)  # the fp8 lever: fqn -> the nn.Linear it swapped

    @property
    def device(self):
        return self.processes.device

    def batch_of(self, config: Configuration) -> int:
        return config.batch or self.batch_default[config.resolution]


# ---------------------------------------------------------------- arguments


def parser(description: str, configs: str | None) -> argparse.ArgumentParser:
    """The arguments every training benchmark takes; `configs` is the script's default `--configs` (None: a
    script that runs no configuration has none)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shards", default="/tmp/bench-shards")
    parser.add_argument("--make-shards", type=int, default=0, help="write this many synthetic --image-size JPEG samples first")
    parser.add_argument("--imagefolder", default=None, help="also write the same JPEGs here (for the diffusers baseline)")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--model-config", default="sd2")
    if configs is not None:
        parser.add_argument("--configs", default=configs, help="comma-separated configurations (bench/train_configs.py)")
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
    parser.add_argument("--encode", default="",
                        help="resolutions to encode the image shards at first (trainer/jobs/encode.py), for latent configurations")
    parser.add_argument("--encode-batch", type=int, default=32)
    parser.add_argument("--latent-dir", default="/tmp/bench-latents")
    parser.add_argument("--profile", default="", help="configurations to profile (3 steps after the timed ones)")
    parser.add_argument("--count-flops", action="store_true",
                        help="count the UNet's (and VAE encoder's) FLOPs per image with FlopCounterMode, once per resolution")
    return parser


def parse(parser: argparse.ArgumentParser) -> argparse.Namespace:
    args = parser.parse_args()
    if args.make_shards and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--make-shards writes the shards from one process: make them first without torchrun")
    return args


def names(args: argparse.Namespace) -> list[str]:
    """The configurations of `--configs`, in order."""
    return [name for name in getattr(args, "configs", "").split(",") if name]


# ---------------------------------------------------------------- the session


@dataclass
class Session:
    """One benchmark process: its shared state, what every line carries, and the lines printed so far."""
    bench: Bench
    common: dict  # commit, machine, versions, model, rank: merged into every figure's line
    lines: list[dict] = field(default_factory=list)

    @property
    def args(self) -> argparse.Namespace:
        return self.bench.args

    def emit(self, line: dict) -> None:
        """Print one JSON line (and append it to --out)."""
        text = json.dumps(line)
        print(text, flush=True)
        self.lines.append(line)
        if self.args.out:
            with open(self.args.out, "a") as out:
                out.write(text + "\n")


def start(args: argparse.Namespace, work: bool = True) -> Session | None:
    """Shards made first when asked (outside every figure timed from process start), then, unless there is no
    `work`, the models built as trainer.jobs.train.main builds them, each setup phase marked for train.first_step_s."""
    if args.make_shards:
        made = time.time()
        make_shards(Path(args.shards), args.make_shards, args.image_size, 256, Path(args.imagefolder) if args.imagefolder else None)
        note(event="shards", samples=args.make_shards, seconds=round(time.time() - made, 1))
        skip_clock(since_start())  # first_step_s counts from here: shard making is the benchmark's
    if not work:
        return None

    import torch

    from trainer.models.loading import load_models
    from trainer.runtime import distributed
    marks = {"imports": since_start()}
    processes = distributed.setup()
    device = processes.device
    models = load_models(args.model_config, None, args.seed, device=device)  # the UNet built on the GPU
    marks["models_built"] = since_start()
    torch.manual_seed(args.seed)
    models.frozen_to(device)
    marks["models_on_device"] = since_start()
    params = sum(p.numel() for p in models.denoiser.parameters())
    note(event="models", unet_params=params, marks=marks)

    machine = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "nproc": os.cpu_count(),
               "host": platform.node()}
    common = {"commit": commit(), "machine": machine, "versions": versions(), "model_config": args.model_config,
              "unet_params_m": round(params / 1e6, 1), "precision": "bf16 autocast, fp32 weights/AdamW/EMA",
              "num_workers": args.num_workers, "ema": True, "attention": "SDPA (diffusers AttnProcessor2_0)",
              "rank": processes.rank, "world_size": processes.world_size}
    batch_default = {512: args.batch_512, 256: args.batch_256, 1024: args.batch_1024, 64: 4, 32: 8, 128: 8, 16: 8}
    profile = set(filter(None, args.profile.split(",")))
    return Session(Bench(args, models, processes, marks, profile, batch_default), common)
