"""The demo's UNet training step on a CPU at each thread count: what a second thread buys, and costs.

The tiny preset's UNet (random weights, fp32) at the demo's 32 px and batch 16: forward, MSE loss,
backward and an AdamW step on random latents and text states of the preset's shapes. The thread
counts alternate in one process (A B A B ..., `torch.set_num_threads` between rounds, a warm-up of
each first). Prints one JSON line per thread count and one comparing the last count with the first:
- train.cpu_step_ms_threads_<n>: wall ms a step, the median over --rounds, with the CPU ms a step
  (process time: every thread's) beside it;
- train.cpu_threads_speedup: the first count's wall / the last count's, with `cpu_ratio`, the last
  count's CPU a step / the first's (what the speed-up costs in CPU).

    .venv/bin/python bench/cpu_threads.py [--threads 1,2] [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

import torch  # noqa: E402

from bench.stamp import commit, versions  # noqa: E402
from trainer.models.loading import load_models  # noqa: E402


def step_function(model_config: str, resolution: int, batch: int):
    models = load_models(model_config, None, 0)
    unet = models.denoiser.train()
    side = resolution // models.vae_scale_factor
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, unet.config.in_channels, side, side, generator=generator)
    states = torch.randn(batch, 8, unet.config.cross_attention_dim, generator=generator)
    timesteps = torch.randint(0, 1000, (batch,), generator=generator)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)

    def step() -> None:
        loss = unet(latents, timesteps, states).sample.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def timed(step, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="tiny")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps a round")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]
    step = step_function(args.model_config, args.resolution, args.batch_size)
    for n in counts:  # warm-up of each
        torch.set_num_threads(n)
        timed(step, 3)
    walls: dict[int, list[float]] = {n: [] for n in counts}
    cpus: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n in counts:
            torch.set_num_threads(n)
            wall, cpu = timed(step, args.steps)
            walls[n].append(wall)
            cpus[n].append(cpu)
    common = {"commit": commit(), "machine": {"nproc": os.cpu_count(), "gpu": None}, "versions": versions(),
              "config": {"model_config": args.model_config, "resolution": args.resolution, "batch": args.batch_size,
                         "rounds": args.rounds, "steps_a_round": args.steps, "order": "A B A B, one process",
                         "step": "forward, MSE, backward, AdamW; fp32; random weights and inputs"}}
    wall = {n: statistics.median(walls[n]) for n in counts}
    cpu = {n: statistics.median(cpus[n]) for n in counts}
    for n in counts:
        print(json.dumps({"metric": f"train.cpu_step_ms_threads_{n}", "value": round(wall[n], 2), "unit": "ms",
                          "cpu_ms": round(cpu[n], 2), **common}), flush=True)
    first, last = counts[0], counts[-1]
    print(json.dumps({"metric": "train.cpu_threads_speedup", "value": float(f"{wall[first] / wall[last]:.3g}"), "unit": "x",
                      "threads": [first, last], "cpu_ratio": float(f"{cpu[last] / cpu[first]:.3g}"), **common}), flush=True)


if __name__ == "__main__":
    main()
