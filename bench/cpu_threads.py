"""The demo's UNet training step on a CPU at each thread count: what a second thread buys, and costs.

A preset's UNet (random weights, fp32; default the demo's, at its 32 px and batch 64): forward, MSE loss,
backward and an AdamW step on random latents and text states of the shapes a job feeds it (the text
encoder's whole context: the tokenizer pads to it). The thread counts, and the presets when several are
named, alternate in one process (A B A B ..., `torch.set_num_threads` between rounds, a warm-up of each
first). Prints one JSON line per preset and thread count and one comparing the last count with the first:
- train.cpu_step_ms_threads_<n>: wall ms a step, the median over --rounds, with the CPU ms a step
  (process time: every thread's) beside it;
- train.cpu_threads_speedup: the first count's wall / the last count's, with `cpu_ratio`, the last
  count's CPU a step / the first's (what the speed-up costs in CPU), for the first preset;
- with two presets, train.cpu_step_ratio_presets: the first preset's wall a step / the second's, one line a count.
With --busy N, N other processes spin on the CPU throughout (a loaded machine: a test suite beside the job).

    .venv/bin/python bench/cpu_threads.py [--model-config demo,tiny] [--threads 1,2] [--rounds 5] [--steps 20] [--busy 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

import torch  # noqa: E402

from bench.stamp import commit, versions  # noqa: E402
from trainer.models.loading import load_models, read_preset  # noqa: E402
from trainer.models.tokenizer import MODEL_MAX_LENGTH  # noqa: E402


def step_function(model_config: str, resolution: int, batch: int, wrap=None):
    """One training step of the preset's UNet on fixed random inputs; `wrap` (e.g. DistributedDataParallel)
    wraps the UNet the step calls."""
    models = load_models(model_config, None, 0)
    unet = models.denoiser.train()
    model = wrap(unet) if wrap else unet
    side = resolution // models.vae_scale_factor
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, unet.config.in_channels, side, side, generator=generator)
    context = read_preset(model_config)["text_encoder"].get("max_position_embeddings", MODEL_MAX_LENGTH)
    states = torch.randn(batch, context, unet.config.cross_attention_dim, generator=generator)
    timesteps = torch.randint(0, 1000, (batch,), generator=generator)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)

    def step() -> None:
        loss = model(latents, timesteps, states).sample.float().pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def vae_step_function(model_config: str, resolution: int, batch: int, wrap=None):
    """One step of the autoencoder job on the preset's VAE: its round trip (trainer.jobs.autoencoder.RoundTrip),
    MSE plus the KL term, backward, AdamW, on fixed random pixels; `wrap` wraps the round trip."""
    from diffusers import AutoencoderKL
    from trainer.jobs.autoencoder import RoundTrip
    torch.manual_seed(0)
    vae = AutoencoderKL(**read_preset(model_config)["vae"]).train()
    round_trip = RoundTrip(vae)
    model = wrap(round_trip) if wrap else round_trip
    pixels = torch.rand(batch, 3, resolution, resolution, generator=torch.Generator().manual_seed(0)) * 2 - 1
    optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-4)

    def step() -> None:
        reconstruction, posterior = model(pixels)
        loss = (reconstruction.float() - pixels).pow(2).mean() + 1e-6 * posterior.kl().mean() / pixels[0].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(100_000))


@contextlib.contextmanager
def busy(processes: int):
    """`processes` others spinning on the CPU while the block runs."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    spinners = [context.Process(target=spin, args=(stop,), daemon=True) for _ in range(processes)]
    for spinner in spinners:
        spinner.start()
    try:
        yield
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()


def timed(step, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return (time.perf_counter() - wall) / steps * 1e3, (time.process_time() - cpu) / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="demo", help="presets, comma-separated")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps a round")
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPU meanwhile")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.threads.split(",")]
    presets = args.model_config.split(",")
    steps = {preset: step_function(preset, args.resolution, args.batch_size) for preset in presets}
    runs = [(preset, n) for preset in presets for n in counts]
    for preset, n in runs:  # warm-up of each
        torch.set_num_threads(n)
        timed(steps[preset], 3)
    walls: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    cpus: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    with busy(args.busy):
        for _ in range(args.rounds):
            for preset, n in runs:
                torch.set_num_threads(n)
                wall, cpu = timed(steps[preset], args.steps)
                walls[preset, n].append(wall)
                cpus[preset, n].append(cpu)
    wall = {run: statistics.median(walls[run]) for run in runs}
    cpu = {run: statistics.median(cpus[run]) for run in runs}

    def common(preset: str) -> dict:
        return {"commit": commit(), "machine": {"nproc": os.cpu_count(), "gpu": None}, "versions": versions(),
                "config": {"model_config": preset, "resolution": args.resolution, "batch": args.batch_size,
                           "rounds": args.rounds, "steps_a_round": args.steps, "order": "A B A B, one process",
                           "busy_processes": args.busy,
                           "step": "forward, MSE, backward, AdamW; fp32; random weights and inputs"}}
    for preset, n in runs:
        print(json.dumps({"metric": f"train.cpu_step_ms_threads_{n}", "value": round(wall[preset, n], 2), "unit": "ms",
                          "cpu_ms": round(cpu[preset, n], 2), **common(preset)}), flush=True)
    first, last, preset = counts[0], counts[-1], presets[0]
    print(json.dumps({"metric": "train.cpu_threads_speedup", "value": float(f"{wall[preset, first] / wall[preset, last]:.3g}"),
                      "unit": "x", "threads": [first, last],
                      "cpu_ratio": float(f"{cpu[preset, last] / cpu[preset, first]:.3g}"), **common(preset)}), flush=True)
    if len(presets) == 2:
        for n in counts:
            print(json.dumps({"metric": "train.cpu_step_ratio_presets", "value": float(f"{wall[presets[0], n] / wall[presets[1], n]:.3g}"),
                              "unit": "x", "presets": presets, "threads": n, **common(",".join(presets))}), flush=True)

if __name__ == "__main__":
    main()
