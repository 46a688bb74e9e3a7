"""Which family learns faster (issue 42.7): a small DiT with flow matching against the small UNet with
v-prediction, the same images and the same GPU time, from scratch.

    PYTHONUNBUFFERED=1 python bench/family_ttt.py --work /tmp/fttt --out $OUT/family.jsonl --plot-dir $OUT \\
        [--families dit,unet] [--budget-s 200] [--score]

1. Data (bench/time_to_target.py's): the procedural catalogue at --size px, --images pictures as shards, and a
   held-out set from another seed. One VAE for both (the autoencoder job on the training shards, --vae-steps),
   so both families see the same latents.
2. Two bases, each the family's pipeline with that VAE, a 1-layer 256-wide text encoder (random, frozen) with a
   tokenizer learned from the training captions, and its denoiser at --seed (default 0):
   - `unet`: --unet-config (default `small`, 0.14 B), the demo's scheduler (v-prediction, zero-terminal SNR);
   - `dit`: --dit-config (default `small-pixart`, a PixArt-layout DiT-B/2, 0.12 B, T5), flow matching.
3. Timed, one family at a time, each from process start: the encode job (image shards -> latent shards, the
   DiT's with its text embeddings) and the training job, same batch, constant learning rate without warm-up,
   AdamW, clipping 1, bf16 autocast, no EMA, no caption dropout, eager (no compile, no CUDA graphs: the
   families, not our levers). The run is stopped --budget-s seconds after its start (equal GPU time); its
   checkpoints (every --checkpoint-every steps) are stamped when complete on disk.
4. Off the clock (--score), every checkpoint: the held-out velocity loss both families are measured by
   (bench/family_scores.py: MLPerf Flux.1's 8 equidistant timesteps, the UNet's prediction turned into the
   velocity it implies) and the catalogue grid's match rate (colours and shape, 2 seeds).
5. The target: the worse of the two runs' last losses (the loss both reach within the budget). Time to
   target = the first checkpoint at or under it. Records `train.time_to_target_s_dit`,
   `train.time_to_target_s_unet` and `train.ttt_ratio_dit_vs_unet` (UNet's time / DiT's: above 1, the DiT
   gets there first), each with the grid match rate at the target and at the end; loss_and_grid.png.

Each step is recorded in --work, so a call that ran out of time resumes where it stopped (device calls are
600 s): prepare + `--families dit`, then `--families unet --score` on the same warm machine. Where the machine
does not stay warm, one family per call: `--families dit --score` keeps the DiT's records and its VAE (the lease
script brings them back in $OUT), and a later call given those records and `--vae` trains and scores the UNet on
the same VAE and reports (data and bases are rebuilt from the same seeds).

A second seed (`--seed 1`, its own --work): every random part of both bases and the training jobs' draws (order,
noise, timesteps) change; the pictures, the held-out set and, given `--vae`, the VAE stay the same.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]

from bench.catalog_shards import write_shards  # noqa: E402
from bench.time_to_target_runs import (Run, emit, emit_to, encode_then_train, make_catalogue, pipeline_with,  # noqa: E402
                                       progress, recipe, time_to, timed, train_vae)

FAMILIES = ("dit", "unet")


def prepare(args, work: Path) -> None:
    """The data, the VAE and the two bases, each made once per --work (for one --seed)."""
    marker = work / "seed"
    if marker.is_file() and int(marker.read_text()) != args.seed:
        raise SystemExit(f"--work {work} holds the runs of seed {marker.read_text().strip()}, not {args.seed}: "
                         "give each seed its own --work")
    marker.write_text(str(args.seed))
    if not (work / "eval").is_dir():
        started = time.monotonic()
        items = make_catalogue(args.images, args.size, 0, args.workers)
        seen = {item.image for item in items}
        held_out = [item for item in make_catalogue(args.eval_images * 2, args.size, 1, 2) if item.image not in seen]
        write_shards(items, work / "shards", args.per_shard, args.size)
        (work / "captions.json").write_text(json.dumps(sorted({item.sidecar["caption"] for item in items})))
        write_shards(held_out[:args.eval_images], work / "eval.tmp", args.eval_images, args.size)
        os.replace(work / "eval.tmp", work / "eval")
        progress("data", images=len(items), s=time.monotonic() - started)
    if args.vae and not (work / "vae" / "config.json").is_file():
        shutil.copytree(args.vae, work / "vae")  # the VAE an earlier call trained: both families on one VAE
    if not (work / "vae" / "config.json").is_file():
        train_vae(argparse.Namespace(**{**vars(args), "model_config": args.unet_config}), work)
    for family in FAMILIES:
        if not (work / f"base-{family}" / "model_index.json").is_file():
            build_base(args, work, family)


def build_base(args, work: Path, family: str) -> None:
    import torch
    from trainer.models.loading import load_models
    from trainer.models.pipelines import build_pipeline
    from trainer.objectives.diffusion import zero_terminal_snr
    captions = json.loads((work / "captions.json").read_text())
    models = load_models(preset(args, family), None, args.seed, vae=str(work / "vae"), captions=lambda: captions)
    if family == "unet":
        models.noise_scheduler.register_to_config(prediction_type="v_prediction")
        models.noise_scheduler = zero_terminal_snr(models.noise_scheduler)
    build_pipeline(models, models.denoiser, args.size).save_pretrained(work / f"base-{family}.tmp")
    os.replace(work / f"base-{family}.tmp", work / f"base-{family}")
    progress(f"base {family}", parameters_m=sum(p.numel() for p in models.denoiser.parameters()) / 1e6)
    del models
    torch.cuda.empty_cache()


def preset(args, family: str) -> str:
    return args.dit_config if family == "dit" else args.unet_config


def run_family(args, work: Path, family: str) -> Run:
    """The encode job, then the training job, stopped --budget-s seconds after the encode job started."""
    run, checkpoints, latents = Run(family), work / f"{family}-checkpoints", work / f"latents-{family}"
    for stale in (checkpoints, latents, work / f"{family}-model"):
        shutil.rmtree(stale, ignore_errors=True)
    common = ["--pretrained", str(work / f"base-{family}"), "--model-config", preset(args, family),
              "--resolution", str(args.size)]
    # eager (no compile, no CUDA graphs): the families, not our levers. The budget stops the training job, so
    # the run is judged by the checkpoints it wrote, not by the job's exit code
    encode_then_train(
        run, work / f"{family}.log",
        ["--train-dir", str(work / "shards"), "--output-dir", str(latents), *common, "--aspect-buckets", "false",
         "--batch-size", str(args.encode_batch), "--num-workers", str(args.workers), "--compile", "false"],
        ["--train-dir", str(latents), "--model-dir", str(work / f"{family}-model"), "--checkpoint-dir", str(checkpoints),
         "--resume", "none", "--init-unet", "pretrained", *common, "--steps", str(args.max_steps), *recipe(args, args.seed),
         "--compile", "false", "--cuda-graphs", "false"],
        checkpoints, done=lambda: time.monotonic() - run.started > args.budget_s)
    if not run.checkpoints:
        raise RuntimeError(f"the {family} run wrote no checkpoint in {args.budget_s} s; see {work / (family + '.log')}")
    progress(f"{family} trained", checkpoints=len(run.checkpoints), last_step=max(run.checkpoints),
             last_s=max(run.checkpoints.values()))
    return run


def score(work: Path, runs: dict[str, Run], samples, device) -> dict[str, dict[int, dict]]:
    """Each checkpoint's velocity loss and grid match rate, kept in --work (a checkpoint is scored once): each
    run's last first (they set the target), then the others in time order across the runs, so a call cut short
    leaves scores that still say something. A checkpoint whose folder is gone (a report away from the machine
    that trained it) is left out."""
    from bench.family_scores import common_times, grid_match, velocity_loss
    times = common_times(work / "base-unet") if samples else ()
    records = {family: work / f"{family}-scores.json" for family in runs}
    scores = {family: {int(k): v for k, v in json.loads(records[family].read_text()).items()}
              if records[family].is_file() else {} for family in runs}
    lasts = [(family, max(run.checkpoints)) for family, run in runs.items()]
    rest = sorted(((family, step) for family, run in runs.items() for step in run.checkpoints if (family, step) not in lasts),
                  key=lambda entry: runs[entry[0]].checkpoints[entry[1]])
    for family, step in lasts + rest:
        run = runs[family]
        if step not in scores[family] and run.directories[step].is_dir():
            folder = pipeline_with(work / f"base-{family}", run.directories[step], work / "scoring" / f"{family}-{step}")
            scores[family][step] = {**velocity_loss(folder, samples, 0, device, times), **grid_match(folder)}
            records[family].write_text(json.dumps(scores[family]))
        if step in scores[family]:
            emit({"event": "checkpoint", "family": family, "step": step, "s": round(run.checkpoints[step], 1),
                  "val_loss": round(scores[family][step]["val_loss"], 5), "grid": scores[family][step]["grid"]})
    return {family: {step: scores[family][step] for step in sorted(run.checkpoints) if step in scores[family]}
            for family, run in runs.items()}


def report(args, runs: dict[str, Run], scores: dict[str, dict[int, dict]], eval_count: int) -> None:
    import torch
    from bench.stamp import commit, versions
    finals = {family: scores[family][max(scores[family])]["val_loss"] for family in runs}  # each run's last scored
    target = max(finals.values())
    common = {"commit": commit(), "versions": versions(),
              "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "nproc": os.cpu_count()}}
    setup = {"families": {"unet": f"{args.unet_config} (v-prediction, zero-terminal SNR)",
                          "dit": f"{args.dit_config} (flow matching, logit-normal t)"},
             "resolution": args.size, "images": args.images, "eval_images": eval_count, "batch": args.batch,
             "learning_rate": args.learning_rate, "budget_s": args.budget_s, "seed": args.seed, "checkpoint_every": args.checkpoint_every,
             "target": round(target, 5), "target_rule": "the worse of the two runs' last held-out velocity losses",
             "loss": "velocity MSE at the flow times of the UNet schedule's timesteps nearest t = 0, 1/8, ..., 7/8, "
                     "both families, fixed noise (bench/family_scores.py)",
             "note": "from process start, the encode job included; eager; scored off the clock"}
    seconds = {}
    for family, run in runs.items():
        step, seconds[family] = time_to(target, run, scores[family])
        last = max(scores[family])
        emit({"metric": f"train.time_to_target_s_{family}", "value": seconds[family], "unit": "s", "step": step,
              "grid_at_target": scores[family][step]["grid"] if step is not None else None,
              "final": {"step": last, "s": round(run.checkpoints[last], 1), "val_loss": round(finals[family], 5),
                        "grid": scores[family][last]["grid"]},
              "encode_s": run.phases.get("encoded_s"), "config": setup, **common})
    ratio = round(seconds["unet"] / seconds["dit"], 3) if seconds.get("unet") and seconds.get("dit") else None
    emit({"metric": "train.ttt_ratio_dit_vs_unet", "value": ratio, "unit": "ratio",
          "definition": "the UNet's time to target / the DiT's (above 1: the DiT gets there first)", "config": setup, **common})
    picture = plot(runs, scores, target, args.plot_dir or args.work)
    if picture:
        progress("plot", path=picture)


def plot(runs: dict[str, Run], scores: dict[str, dict[int, dict]], target: float, folder: Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (losses, grid) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 2])
    for family, run in runs.items():
        steps = sorted(scores[family])
        seconds = [run.checkpoints[step] for step in steps]
        losses.plot(seconds, [scores[family][s]["val_loss"] for s in steps], marker="o", label=family)
        grid.plot(seconds, [scores[family][s]["grid"] for s in steps], marker="o", label=family)
    losses.axhline(target, color="grey", linestyle="--", label=f"target {target:.4f}")
    losses.set_ylabel("held-out velocity loss (8 t)")
    losses.legend()
    losses.grid(True, alpha=0.3)
    grid.set_ylabel("grid match (colours + shape)")
    grid.set_ylim(-0.05, 1.05)
    grid.grid(True, alpha=0.3)
    grid.set_xlabel("seconds from process start (the encode job included)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "loss_and_grid.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return str(path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/family-ttt"), help="data, models and records")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where loss_and_grid.png goes (default: --work)")
    parser.add_argument("--families", default="dit,unet", help="which runs this call trains (recorded runs are kept)")
    parser.add_argument("--score", action="store_true", help="then score every recorded run and report")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--report-only", action="store_true", help="report from the run and score records in --work")
    parser.add_argument("--unet-config", default="small")
    parser.add_argument("--dit-config", default="small-pixart")
    parser.add_argument("--seed", type=int, default=0, help="the bases' random parts and the training jobs' draws")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--images", type=int, default=20160)
    parser.add_argument("--eval-images", type=int, default=256)
    parser.add_argument("--per-shard", type=int, default=1000)
    parser.add_argument("--vae", type=Path, default=None,
                        help="a VAE folder to use instead of training one (an earlier call's, so calls share it)")
    parser.add_argument("--vae-steps", type=int, default=1000)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-learning-rate", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--budget-s", type=float, default=200.0, help="seconds from process start each run gets")
    parser.add_argument("--max-steps", type=int, default=100000, help="the job's --steps (the budget stops it first)")
    parser.add_argument("--checkpoint-every", type=int, default=150)
    parser.add_argument("--encode-batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.out:
        emit_to(args.out)
    if args.report_only:  # the records a device call brought back: no data, no models
        runs = {family: timed(args.work, family, None) for family in FAMILIES}
        report(args, runs, score(args.work, runs, [], None), args.eval_images)
        return
    prepare(args, args.work)
    if args.prepare_only:
        return
    runs = {}
    for family in [f for f in args.families.split(",") if f]:
        if family not in FAMILIES:
            raise SystemExit(f"--families: {family!r} is not one of {', '.join(FAMILIES)}")
        runs[family] = timed(args.work, family, lambda: run_family(args, args.work, family))
    if not args.score:
        return
    import torch
    from trainer.data.eval_set import find_eval_shards, read_eval_samples
    runs = {family: timed(args.work, family, None) for family in FAMILIES if (args.work / f"{family}-run.json").is_file()}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    samples, _ = read_eval_samples(find_eval_shards(str(args.work / "eval")), args.size, args.eval_images)
    scores = score(args.work, runs, samples, device)
    if len(runs) == len(FAMILIES):
        report(args, runs, scores, len(samples))
    else:  # one family per device call: its scores are kept for the call that trains the other
        progress("scored", families=",".join(runs), report="when every family has run")


if __name__ == "__main__":
    main()
