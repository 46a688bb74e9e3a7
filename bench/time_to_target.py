"""Time to quality on one GPU: our trainer against diffusers' train_text_to_image.py, the MLPerf way.

    PYTHONUNBUFFERED=1 python bench/time_to_target.py --peer-script .peer/train_text_to_image.py \\
        --work /tmp/ttt --out $OUT/ttt.jsonl

1. Data: the procedural catalogue (atelier/catalog.py: shapes x colours x backgrounds, captions from
   the attributes) at --size px, --images pictures, written twice: as shards in the packer's layout
   (ours) and as an imagefolder with metadata.jsonl (the peer's `--train_data_dir`). A held-out set
   from another seed, with none of the training bytes, is the eval shards.
2. A base pipeline both runs start from: the autoencoder job (trainer/jobs/autoencoder.py) trains the VAE on
   the training shards; the text encoder (random, frozen), tokenizer (CLIP BPE), scheduler and a UNet
   of --model-config with seed 0 come from trainer.models.loading. The scheduler is the demo's recipe
   (--prediction-type v_prediction with a zero-terminal-SNR schedule: with epsilon and SD's schedule
   no model of the catalogue draws its prompts' colours, docs/trainer.md), and both runs read it from
   the base. Same weights, same images, same objective for both runs.
3. Timed, one after the other, each from process start:
   - ours: the encode job (image shards -> latent shards) and then the training job on the latents,
     `--init-unet pretrained` (the base's seed-0 UNet);
   - peer: the script unmodified, `--pretrained_model_name_or_path` the base.
   Same batch, steps, constant learning rate without warm-up, AdamW defaults, gradient clipping 1,
   bf16 autocast, no EMA, no caption dropout, no flips, centred crops; checkpoints every
   --checkpoint-every steps. A checkpoint's time is when it is complete on disk (ours: the atomic
   rename of step-N/; peer: its "Saved state to" log line). Both stop after their last checkpoint.
4. Off the clock: every checkpoint's UNet (in the base pipeline) is scored by trainer/jobs/evaluate.py on the
   same held-out shards, timesteps and seeds (`val_loss`). The peer's checkpoints also draw the demo's
   twelve prompts, six of them combinations no training picture shows (atelier/prompt_match.py:
   `match`, the share whose picture has the prompt's colours), in step order until one reaches
   --match-goal; ours draw them at their time-to-target checkpoint (drawing is most of the scoring time).
5. The target (`--target match`, the default): the peer's held-out loss at its first checkpoint whose
   match rate reaches --match-goal (0.8), times --target-slack: the loss at which the script's model
   draws the prompts. `--target final`: the peer's loss after --steps steps. Time to target = the
   first checkpoint at or under it; each run's match rate there is reported beside it.

On the device tool (600 s a call, 30 min a session; the machine keeps --work only while warm, about
30 s idle, so issue the calls back to back): (1) `--prepare-only` (the VAE job takes about 200 s: copy a
VAE made earlier, 16 MB, carried, into --work/vae to skip it), a short job that fills the compile cache,
then `--runs ours`; (2) `--runs peer --score-losses` started with setsid in the background at the end of
that call, and a call that waits for it (the peer runs alone on the machine, and the waiting call keeps it
warm); (3) `--runs ours --score-losses`, then the same command without --runs, which reports (records in
--work make each call resume). bench/time_to_target_lease.sh is such a lease.

Prints one JSON line per checkpoint (`event`), then `train.time_to_target_s` (ours, with `phases`: when
each of its jobs' log events first showed, in seconds from the run's start: where its fixed costs go),
`train.diffusers_time_to_target_s` and `train.time_to_target_ratio_vs_diffusers` (peer / ours;
goal >= 2.0), and writes loss_vs_time.png into --plot-dir when matplotlib is there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]

from bench.time_to_target_runs import (Run, emit, emit_to, pipeline_with, prepare, progress, run_ours,  # noqa: E402
                                       run_peer, time_to, timed)


# ---------------------------------------------------------------- scoring


def scoring_pipeline(work: Path, run: Run, step: int) -> Path:
    """The base pipeline with `run`'s UNet of `step`."""
    return pipeline_with(work / "base", run.directories[step], work / "scoring" / f"{run.name}-{step}")


def score(run: Run, work: Path, samples: list, config, device, match_until: float | None = None) -> dict[int, dict]:
    """Each checkpoint's held-out loss and, with `match_until`, its prompt match rate, checkpoint by
    checkpoint until one reaches it (drawing the prompts is most of the scoring time). Kept in --work:
    a checkpoint is scored once."""
    from trainer.jobs.scoring import score_model
    record = work / f"{run.name}-scores.json"
    scores = {int(k): v for k, v in json.loads(record.read_text()).items()} if record.is_file() else {}
    matching = match_until is not None
    for step in sorted(run.checkpoints):
        draw = matching and "match" not in scores.get(step, {})
        if step not in scores or draw:  # the pipeline is linked only for what is still to score
            folder = scoring_pipeline(work, run, step)
            if step not in scores:
                scores[step] = {"val_loss": score_model(folder, samples, config, None, device)["val_loss"]}
            if draw:
                scores[step]["match"] = match_rate(folder, config, device)
        matching = matching and scores[step]["match"] < match_until
        record.write_text(json.dumps(scores))
        emit({"event": "checkpoint", "run": run.name, "step": step, "s": round(run.checkpoints[step], 1),
              "val_loss": round(scores[step]["val_loss"], 5), "match": scores[step].get("match")})
    return scores


def match_at(run: Run, step: int | None, work: Path, scores: dict[int, dict], config, device) -> float | None:
    """The match rate of `run` at `step` (its time-to-target checkpoint), drawn if not yet."""
    if step is None:
        return None
    if "match" not in scores[step]:
        scores[step]["match"] = match_rate(scoring_pipeline(work, run, step), config, device)
        (work / f"{run.name}-scores.json").write_text(json.dumps(scores))
    return scores[step]["match"]


def match_rate(pipeline: Path, config, device) -> float:
    """The share of the demo's prompts whose picture shows the prompt's colours (atelier/prompt_match.py)."""
    import io
    from atelier.prompt_match import DEMO_PROMPTS, GUIDANCE, STEPS, matches
    from trainer.jobs.scoring import EvalConfig, load_models, sample_images
    models = load_models(pipeline, device)
    drawn = sample_images(models, list(DEMO_PROMPTS), EvalConfig(config.timesteps, 0, config.resolution, STEPS, GUIDANCE))
    hits = []
    for prompt, image in zip(DEMO_PROMPTS, drawn):
        png = io.BytesIO()
        image.save(png, format="PNG")
        hits.append(matches(prompt, png.getvalue()))
    return round(sum(hits) / len(hits), 3)


def target_of(args, peer_scores: dict[int, dict]) -> tuple[float | None, str]:
    """(the target loss, the rule that gave it); None when the peer never reached --match-goal."""
    if args.target == "final":
        return peer_scores[args.steps]["val_loss"] * args.target_slack, \
            f"the peer's held-out val_loss at step {args.steps} x {args.target_slack:g}"
    reached = [step for step in sorted(peer_scores) if peer_scores[step].get("match", 0) >= args.match_goal]
    if not reached:
        return None, f"the peer never matched {args.match_goal:g} of the prompts in {args.steps} steps"
    return peer_scores[reached[0]]["val_loss"] * args.target_slack, \
        (f"the peer's held-out val_loss at its first checkpoint matching >= {args.match_goal:g} of the demo's "
         f"prompts (step {reached[0]}) x {args.target_slack:g}")


def drew_prompts(runs: list[tuple[Run, dict[int, dict]]]) -> bool:
    """Whether any checkpoint has a match rate (the plot's second panel)."""
    return any("match" in score for _, scores in runs for score in scores.values())


def plot(runs: list[tuple[Run, dict[int, dict]]], target: float | None, folder: Path) -> str | None:
    """Held-out loss and prompt match rate against seconds from process start, one line per run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    drew = drew_prompts(runs)
    if drew:  # the match panel only when some checkpoint drew the prompts (not with --skip-match)
        figure, (losses, matched) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 2])
    else:
        figure, losses = plt.subplots(figsize=(8, 4.5))
    for run, scores in runs:
        steps = sorted(scores)
        seconds = [run.checkpoints[step] for step in steps]
        losses.plot(seconds, [scores[step]["val_loss"] for step in steps], marker="o", label=run.name)
        drawn = [step for step in steps if "match" in scores[step]]
        if drawn:
            matched.plot([run.checkpoints[step] for step in drawn], [scores[step]["match"] for step in drawn], marker="o",
                         label=run.name)
    if target is not None:
        losses.axhline(target, color="grey", linestyle="--", label=f"target {target:.4f}")
    losses.set_ylabel("held-out val_loss (trainer/jobs/evaluate.py)")
    losses.set_yscale("log")
    losses.legend()
    losses.grid(True, which="both", alpha=0.3)
    if drew:
        matched.set_ylabel("prompt match rate (12 prompts)")
        matched.set_ylim(-0.05, 1.05)
        matched.grid(True, alpha=0.3)
    (matched if drew else losses).set_xlabel("seconds from process start (ours: the encode job included)")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "loss_vs_time.png"
    figure.savefig(path, dpi=120, bbox_inches="tight")
    return str(path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-script", type=Path, required=True, help="diffusers' examples/text_to_image/train_text_to_image.py")
    parser.add_argument("--work", type=Path, default=Path("/tmp/time-to-target"), help="data, models and checkpoints")
    parser.add_argument("--out", type=Path, default=None, help="append the JSON lines here too")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where loss_vs_time.png goes (default: --work)")
    parser.add_argument("--model-config", default="small", help="a preset in trainer/configs/")
    parser.add_argument("--size", type=int, default=256, help="picture side in px (the training resolution)")
    parser.add_argument("--images", type=int, default=20160, help="training pictures")
    parser.add_argument("--eval-images", type=int, default=256, help="held-out pictures scored")
    parser.add_argument("--per-shard", type=int, default=1000, help="samples per training shard")
    parser.add_argument("--vae-steps", type=int, default=3000, help="autoencoder job steps (setup, off the clock)")
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps of each run")
    parser.add_argument("--batch", type=int, default=128, help="images per step, both runs")
    parser.add_argument("--learning-rate", type=float, default=2e-4, help="constant, both runs")
    parser.add_argument("--checkpoint-every", type=int, default=150, help="steps between checkpoints, both runs")
    parser.add_argument("--encode-batch", type=int, default=128, help="images per VAE call in the encode job")
    parser.add_argument("--target", choices=["match", "final"], default="match",
                        help="the peer's loss at its first checkpoint matching --match-goal, or at its last")
    parser.add_argument("--match-goal", type=float, default=0.8, help="prompt match rate of --target match")
    parser.add_argument("--target-slack", type=float, default=1.0, help="the target loss is multiplied by this")
    parser.add_argument("--prediction-type", default="v_prediction", choices=["epsilon", "v_prediction"],
                        help="the base scheduler's (both runs read it)")
    parser.add_argument("--zero-terminal-snr", type=int, default=1, help="1: the base scheduler reaches pure noise")
    parser.add_argument("--vae-learning-rate", type=float, default=1e-3)
    parser.add_argument("--encode-args", default="", help="extra trainer.jobs.encode flags, e.g. '--compile false'")
    parser.add_argument("--peer-args", default="", help="extra script flags, e.g. '--report_to all' without tensorboard")
    parser.add_argument("--peer-path", default="", help="prepended to PYTHONPATH for the peer's process only")
    parser.add_argument("--ours", action="append", default=None, metavar="NAME=FLAGS",
                        help="a configuration of ours: its name (its records in --work) and extra trainer.jobs.train flags, "
                             "e.g. 'graphs=--cuda-graphs true'; repeat for several (default: 'ours=')")
    parser.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 16), help="data processes")
    parser.add_argument("--skip-match", action="store_true", help="do not draw the demo prompts")
    parser.add_argument("--prepare-only", action="store_true", help="make the data, the VAE and the base, then stop")
    parser.add_argument("--runs", choices=["all", "peer", "ours"], default="all",
                        help="peer or ours: only those timed runs, then stop (a device call each); all: both, then scoring")
    parser.add_argument("--score-losses", action="store_true",
                        help="with --runs peer|ours: then score their checkpoints' held-out losses (no drawing)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from bench.stamp import commit, versions
    from trainer.data.eval_set import find_eval_shards, read_eval_samples
    from trainer.jobs.scoring import EvalConfig

    args.work.mkdir(parents=True, exist_ok=True)
    if args.out:
        emit_to(args.out)
    prepare(args, args.work)
    if args.prepare_only:
        return
    if args.runs != "ours":
        peer = timed(args.work, "peer", lambda: run_peer(args, args.work))
        progress("peer trained", s=peer.checkpoints[args.steps])
    configurations = dict(entry.partition("=")[::2] for entry in args.ours or ["ours="])  # name -> trainer.jobs.train flags
    ours = []
    for name, extra in configurations.items():
        if args.runs != "peer":
            ours.append(timed(args.work, name, lambda: run_ours(args, args.work, name, extra)))
            progress(f"{name} trained", s=ours[-1].checkpoints[args.steps])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = EvalConfig(timesteps=[100, 300, 500, 700, 900], seed=0, resolution=args.size, steps=25, guidance=5.0)
    samples, _ = read_eval_samples(find_eval_shards(str(args.work / "eval")), args.size, args.eval_images)
    if args.runs != "all":  # with --score-losses, this call also scores the losses of what it trained
        for run in ([peer] if args.runs == "peer" else ours) if args.score_losses else []:
            score(run, args.work, samples, config, device)
        return
    # the peer's match rate until it reaches the goal (the target); ours' losses, then its match at the target
    scored = [(peer, score(peer, args.work, samples, config, device,
                           None if args.skip_match or args.target == "final" else args.match_goal))]
    scored += [(run, score(run, args.work, samples, config, device)) for run in ours]
    target, rule = target_of(args, scored[0][1])
    peer_step, peer_s = time_to(target, peer, scored[0][1])
    matched = {run.name: None if args.skip_match else match_at(run, time_to(target, run, scores)[0], args.work, scores,
                                                                config, device)
               for run, scores in scored}

    common = {"commit": commit(), "versions": versions(),
              "machine": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "nproc": os.cpu_count()}}
    setup = {"model_config": args.model_config, "resolution": args.size, "images": args.images, "eval_images": len(samples),
             "batch": args.batch, "steps": args.steps, "learning_rate": args.learning_rate,
             "checkpoint_every": args.checkpoint_every, "prediction_type": args.prediction_type,
             "zero_terminal_snr": bool(args.zero_terminal_snr), "encode_args": args.encode_args,
             "target": round(target, 5) if target is not None else None, "target_rule": rule,
             "note": "from process start; ours includes the encode job; checkpoint times when complete on disk; "
                     "losses and match rates scored off the clock"}
    emit({"metric": "train.diffusers_time_to_target_s", "value": peer_s, "unit": "s", "step": peer_step,
          "match_at_target": matched[peer.name],
          "baseline": "diffusers examples/text_to_image/train_text_to_image.py, unmodified", "config": setup, **common})
    for run, scores in scored[1:]:
        step, seconds = time_to(target, run, scores)
        ours_setup = {**setup, "ours": run.name, "ours_args": configurations[run.name]}
        emit({"metric": "train.time_to_target_s", "value": seconds, "unit": "s", "step": step,
              "match_at_target": matched[run.name],
              "encode_s": run.phases["encoded_s"], "phases": run.phases, "config": ours_setup, **common})
        emit({"metric": "train.time_to_target_ratio_vs_diffusers", "value": round(peer_s / seconds, 3) if seconds and peer_s else None,
              "unit": "ratio", "goal": 2.0, "config": ours_setup, **common})
    picture = plot(scored, target, args.plot_dir or args.work)
    if picture:
        progress("plot", path=picture)


if __name__ == "__main__":
    main()
