"""How many images a second the trainer's step trains, per configuration: one JSON line per configuration.

    PYTHONUNBUFFERED=1 python bench/train_throughput.py --shards /tmp/shards --make-shards 2048 --encode 512,256 \\
        --configs image512,latent512,latent512+compile --out $OUT/train.jsonl

`--configs` names what runs, in order, in this one process (bench/train_configs.py: each name's source,
resolution and levers). Each configuration's line has its img/s, `ratio_vs_plain` and `ratio_vs_without`
(against its base, and its name less the last lever, each when measured earlier in the run), FLOPs and
MFU (bench/train_figures.py); the first configuration also gives `train.first_step_s` and
`train.data_wait_share` (bench/train_timing.py). `--encode RES,...` encodes the image shards first, for
latent configurations (its rate: bench/train_encode.py). After the configurations: each goal's figure,
the fastest configuration of its source and resolution in this run, with what bounds it when it misses
(`--profile` that configuration to say why), and `train.img_per_s_<res>_default` for each `<base>+default`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `trainer`, as under pytest

from bench.train_configs import parse_config  # noqa: E402
from bench.train_figures import bound_of, unet_figure, vae_figure  # noqa: E402
from bench.train_harness import Session, note, parse, parser, since_start, start  # noqa: E402
from bench.train_latents import prepare_latents  # noqa: E402
from bench.train_timing import measure  # noqa: E402

DEFAULT_CONFIGS = "image512,image256,latent512,latent256,latent512+cl,latent512+fused,latent512+b64"
GOALS = {("latent", 512): ("train.img_per_s_512_latent", 200), ("latent", 256): ("train.img_per_s_256_latent", 900),
         ("image", 512): ("train.img_per_s_512_image", 110), ("latent", 1024): ("train.img_per_s_1024_latent", 20)}
GOAL_PRESETS = {"train.img_per_s_1024_latent": "sdxl"}  # a goal stated for one preset's UNet (BENCHMARKS.md)
DEFAULT_GOALS = {512: 150}  # train.img_per_s_<res>_default: the `+default` configuration


def goal_lines(session: Session, profiles: dict[str, dict | None]) -> None:
    """Each goal's figure: the fastest configuration of its source and resolution in this run; a missed goal's
    line says what bounds it."""
    args, bench, lines, emit = session.args, session.bench, session.lines, session.emit
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


def default_lines(session: Session) -> None:
    """`train.img_per_s_<res>_default`: what a job gets is `<base>+default` itself (a lever measured on top of it is
    not the default)."""
    for line in [line for line in session.lines if line["metric"].startswith("train.config.") and line.get("value")
                 and line["config"]["name"].endswith("+default")]:
        resolution = line["config"]["resolution"]
        session.emit({**line, "metric": f"train.img_per_s_{resolution}_default", "goal": DEFAULT_GOALS.get(resolution),
              "note": "the configuration trainer/configs/defaults/fast.json gives a job with default parameters"})


def main() -> None:
    args = parse(parser(__doc__.splitlines()[0], DEFAULT_CONFIGS))
    session = start(args, work=bool(args.configs or args.encode))
    if session is None:
        return
    prepare_latents(session)
    profiles = measure(session)
    goal_lines(session, profiles)
    default_lines(session)
    note(event="done", seconds=round(since_start(), 1))


if __name__ == "__main__":
    main()
