"""The demo's UNet (or VAE) training step on a CPU: one process, the same process on more threads, or data-parallel
processes of one thread each (the container's `cpu-processes`), at the same pictures a step.

A preset's UNet (bench/cpu_threads.py's step: random weights and inputs, fp32, forward, MSE, backward, AdamW;
default the demo's, 32 px, 64 pictures a step), or with --part vae the autoencoder job's step on the preset's VAE
(its metrics named autoencoder.* instead of train.*). Three ways to spend --processes cores on it, alternating in
rounds (A B C A B C ..., each a fresh set of processes, warmed up, then --steps timed steps):
- `one`: one process, one thread, the whole batch;
- `threads`: one process, --processes threads (OpenMP: they meet at every operation);
- `ddp`: --processes processes of one thread, gloo DistributedDataParallel, the batch split between them (they
  meet once a step, in the gradients' all-reduce).
With --busy N, N other processes spin on the CPU throughout (the local stack and a test suite beside the job).
Prints train.cpu_step_ms_<way> (wall ms a step, median over --rounds, rank 0's clock) and
train.cpu_processes_speedup (`one`'s ms / `ddp`'s, with `threads`' speed-up beside it).

    .venv/bin/python bench/cpu_processes.py [--part unet|vae] [--batch-size 64] [--processes 2] [--busy 0] [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

WAYS = ("one", "threads", "ddp")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(rank: int, world: int, threads: int, port: int, args: argparse.Namespace, results) -> None:
    import torch
    import torch.distributed as dist
    from bench.cpu_threads import step_function, vae_step_function
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    step = (vae_step_function if args.part == "vae" else step_function)(args.model_config, args.resolution, args.batch_size // world,
                         wrap=torch.nn.parallel.DistributedDataParallel if world > 1 else None)
    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    if rank == 0:  # with the process group's size: what the step ran across
        results.put(((time.perf_counter() - started) / args.steps * 1e3, dist.get_world_size() if world > 1 else 1))
    if world > 1:
        dist.destroy_process_group()


def timed(way: str, args: argparse.Namespace, context) -> tuple[float, int]:
    """One round of `way`: its processes started, warmed up and timed; rank 0's ms a step, and the ranks."""
    world, threads = (args.processes, 1) if way == "ddp" else (1, args.processes if way == "threads" else 1)
    results, port = context.Queue(), free_port()
    processes = [context.Process(target=worker, args=(rank, world, threads, port, args, results)) for rank in range(world)]
    for process in processes:
        process.start()
    measured = results.get(timeout=1800)
    for process in processes:
        process.join()
    return measured


def main(argv: list[str] | None = None) -> None:
    import multiprocessing
    from bench.cpu_threads import busy
    from bench.stamp import commit, versions
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", default="demo")
    parser.add_argument("--part", choices=("unet", "vae"), default="unet", help="the UNet's step, or the autoencoder job's")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64, help="pictures a step, over all processes")
    parser.add_argument("--processes", type=int, default=2, help="cores spent: threads of one process, or processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed steps a round")
    parser.add_argument("--busy", type=int, default=0, help="other processes spinning on the CPU meanwhile")
    args = parser.parse_args(argv)
    if args.processes < 2 or args.batch_size % args.processes:
        raise SystemExit("--processes is 2 or more and divides --batch-size")
    context = multiprocessing.get_context("spawn")
    walls: dict[str, list[float]] = {way: [] for way in WAYS}
    ranks: dict[str, int] = {}
    with busy(args.busy):
        for _ in range(args.rounds):
            for way in WAYS:
                ms, ranks[way] = timed(way, args, context)
                walls[way].append(ms)
    wall = {way: statistics.median(walls[way]) for way in WAYS}
    common = {"commit": commit(), "machine": {"nproc": os.cpu_count(), "gpu": None}, "versions": versions(),
              "config": {"model_config": args.model_config, "resolution": args.resolution, "batch": args.batch_size,
                         "processes": args.processes, "rounds": args.rounds, "steps_a_round": args.steps,
                         "busy_processes": args.busy, "order": "one, threads, ddp in turn; fresh processes a round",
                         "part": args.part, "step": "forward, MSE, backward, AdamW; fp32; random weights and inputs"}}
    family = "autoencoder" if args.part == "vae" else "train"
    for way in WAYS:
        print(json.dumps({"metric": f"{family}.cpu_step_ms_{way}", "value": round(wall[way], 2), "unit": "ms",
                          "ranks": ranks[way], "rounds_ms": [round(ms, 1) for ms in walls[way]], **common}), flush=True)
    print(json.dumps({"metric": f"{family}.cpu_processes_speedup", "value": float(f"{wall['one'] / wall['ddp']:.3g}"),
                      "unit": "x", "threads_speedup": float(f"{wall['one'] / wall['threads']:.3g}"), **common}), flush=True)


if __name__ == "__main__":
    main()
