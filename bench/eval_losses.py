"""The evaluation's held-out losses: several samples per model call against one at a time.

trainer/jobs/evaluate.py's `validation_losses` on random pictures with the preset's models (random
weights, fp32, as the evaluation runs them), timed with `per_call=1` (one sample a call, as before)
and with its default (`samples_per_call`, or --per-call), alternately in one process (A B A B ..., after a warm-up
of each). Prints one JSON line per figure:
- evaluate.val_loss_s: seconds for --samples samples at the default, the median over --rounds;
- evaluate.batched_ratio_vs_per_sample: the per-sample median over the default's; its
  `max_rel_diff` is the largest relative difference between the two losses tables.

    .venv/bin/python bench/eval_losses.py [--model-config small] [--resolution 256] [--samples 32] [--rounds 3]
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
from trainer.data.eval_set import EvalSample  # noqa: E402
from trainer.jobs.scoring import EvalConfig, for_scoring, samples_per_call, validation_losses
from trainer.models.loading import load_models  # noqa: E402


def timed(models, samples, config, device, per_call: int | None) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    losses = validation_losses(models, samples, config, device, per_call)
    return time.perf_counter() - started, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-config", default="small")
    parser.add_argument("--resolution", type=int, default=256)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-call", type=int, default=None,
                        help="samples per call of the batched arm (default: samples_per_call, which is 1 on a CPU)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = for_scoring(load_models(args.model_config, None, seed=0), device)
    generator = torch.Generator().manual_seed(0)
    samples = [EvalSample(f"s{number}", f"a red circle on a blue background, picture {number}",
                          torch.rand(3, args.resolution, args.resolution, generator=generator) * 2 - 1,
                          [args.resolution, args.resolution, 0, 0, args.resolution, args.resolution])
               for number in range(args.samples)]
    config = EvalConfig([100, 300, 500, 700, 900], seed=0, resolution=args.resolution, steps=25, guidance=5.0)

    arms = {"per_sample": 1, "batched": args.per_call}
    times: dict[str, list[float]] = {name: [] for name in arms}
    tables: dict[str, torch.Tensor] = {}
    for name, per_call in arms.items():  # warm-up
        validation_losses(models, samples[:2], config, device, per_call)
    for _ in range(args.rounds):
        for name, per_call in arms.items():
            seconds, tables[name] = timed(models, samples, config, device, per_call)
            times[name].append(seconds)
            print(json.dumps({"progress": name, "s": round(seconds, 3)}), file=sys.stderr, flush=True)

    common = {"commit": commit(), "versions": versions(),
              "machine": {"nproc": os.cpu_count(), "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None},
              "config": {"model_config": args.model_config, "resolution": args.resolution, "samples": args.samples,
                         "timesteps": len(config.timesteps), "samples_per_call": args.per_call or samples_per_call(len(config.timesteps), args.resolution, device),
                         "rounds": args.rounds, "order": "A B A B (per sample, batched), one process", "precision": "fp32"}}
    batched, per_sample = statistics.median(times["batched"]), statistics.median(times["per_sample"])
    difference = ((tables["batched"] - tables["per_sample"]).abs() / tables["per_sample"].abs()).max().item()
    print(json.dumps({"metric": "evaluate.val_loss_s", "value": round(batched, 3), "unit": "s", **common}))
    print(json.dumps({"metric": "evaluate.batched_ratio_vs_per_sample", "value": round(per_sample / batched, 2), "unit": "x",
                      "per_sample_s": round(per_sample, 3), "batched_s": round(batched, 3), "max_rel_diff": difference,
                      "baseline": "validation_losses with per_call=1 (ours, one sample a call, labelled)", **common}))


if __name__ == "__main__":
    main()
