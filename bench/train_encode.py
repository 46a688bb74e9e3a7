"""How fast the encode job turns image shards into latent shards: `train.encode_img_per_s_<res>`, one line a resolution.

    PYTHONUNBUFFERED=1 python bench/train_encode.py --model-config sd2 --shards /tmp/shards --latent-dir /tmp/lat \\
        --encode 512 --encode-compile --encode-batch 32 --num-workers 8

The trainer's own encode (trainer.jobs.encode.encode_shards) with the benchmark's models, eager
(bench/train_latents.py). `--encode-compile`: after each resolution, the same encode with the VAE
encoder compiled and every call padded (trainer.jobs.encode --compile), twice in this process:
`train.encode_img_per_s_<res>_compiled` (cold, the compile included) and `_compiled_warm`, each with
its ratio to the eager encode. The latent shards stay for the latent configurations of the other
bench/train_*.py scripts (the same `--latent-dir`, `--model-config` and `--seed`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `trainer`, as under pytest

from bench.train_harness import Bench, note, parse, parser, since_start, start  # noqa: E402
from bench.train_latents import prepare_latents  # noqa: E402


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


def main() -> None:
    arguments = parser(__doc__.splitlines()[0], None)
    arguments.add_argument("--encode-compile", action="store_true",
                           help="after each --encode resolution, encode again with the VAE encoder compiled and every "
                                "call padded, twice: train.encode_img_per_s_<res>_compiled (cold) and _compiled_warm")
    args = parse(arguments)
    session = start(args, work=bool(args.encode))
    if session is None:
        return

    def compiled(resolution: int, eager: dict | None) -> None:
        if args.encode_compile:
            for line in compiled_encode_lines(session.bench, resolution, session.common, eager):
                session.emit(line)

    prepare_latents(session, then=compiled)
    note(event="done", seconds=round(since_start(), 1))


if __name__ == "__main__":
    main()
