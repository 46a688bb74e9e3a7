"""Does fp8 train as well as what it speeds up: `train.lever.fp8_loss_parity`, two loss curves from the same start.

    python bench/train_fp8_parity.py --shards /tmp/shards --latent-dir /tmp/lat --encode 512 --parity-steps 200

`--parity-base` (`latent512+default` unless told) and the same with `+fp8`, `--parity-steps` N steps
each from the same weights, seed and data order; the line gives each loss curve's mean over its last
50 steps and their ratio (fp8 / without). Without torchao, or a CUDA device of compute capability
>= 8.9, a skipped line. Configurations of `--configs` (none by default) run first, as in
bench/train_throughput.py.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `trainer`, as under pytest

from bench.train_configs import apply_fast_default, fp8_unavailable, parse_config, release  # noqa: E402
from bench.train_harness import Bench, note, parse, parser, since_start, start  # noqa: E402
from bench.train_latents import prepare_latents  # noqa: E402
from bench.train_timing import measure, run_config  # noqa: E402

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


def main() -> None:
    arguments = parser(__doc__.splitlines()[0], "")
    arguments.add_argument("--parity-steps", type=int, default=200, metavar="N",
                           help="--parity-base and --parity-base+fp8 N steps each from the same weights, seed and data")
    arguments.add_argument("--parity-base", default="latent512+default",
                           help="the configuration the parity run compares +fp8 against (a smaller eager one is cheaper)")
    args = parse(arguments)
    session = start(args)
    prepare_latents(session)
    measure(session)
    left = args.deadline - since_start()
    if left < args.compile_needs:
        session.emit({"metric": "train.lever.fp8_loss_parity", "value": None,
                      "skipped": f"{left:.0f} s left before the deadline", **session.common})
    else:
        session.emit({**fp8_parity_line(session.bench, args.parity_base, args.parity_steps), **session.common})
    note(event="done", seconds=round(since_start(), 1))


if __name__ == "__main__":
    main()
