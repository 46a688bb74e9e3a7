"""Score a candidate pipeline, and the production baseline, on held-out shards: the deploy gate's evidence.

Runbook
-------
SageMaker: a *training job* with the training image and the hyperparameter `task=evaluate`;
trainer/container.py then runs this module instead of trainer.jobs.train (one process, one GPU or the CPU).
Channels (`$SM_CHANNEL_<NAME>`):

    candidate  the model to judge: a saved diffusers pipeline directory, or the `model.tar.gz` a
               training job wrote (an S3 object input lands in the channel as that one file)
    baseline   optional: the production model, in either form; scored on exactly the same draws
    eval       held-out shards (`*.tar` at any depth, the packer's layout: `<key>.jpg|png|webp`,
               `<key>.txt` caption, `<key>.json`), read with trainer/data/shards.py's reader
    clip       optional: a transformers CLIPModel with its tokenizer and image processor
               (`save_pretrained`; or a model.tar.gz of them): the CLIP scorer; without it, no CLIP score

Hyperparameters (strings): contracts.recipe_jobs.EvaluateOptions, the recipe's evaluation options:
`timesteps` ("100,300,500,700,900"), `seed` (0), `max-samples` (also `max_samples`: 64), `resolution` (the
candidate's last training phase from atelier-training.json, else the size its UNet was built for), `steps`
(20: sampling steps for CLIP images), `guidance` (5.0).

By hand:

    python -m trainer.jobs.evaluate --candidate-dir out/model --eval-dir heldout/ --model-dir out/eval \\
        [--baseline-dir prod/model] [--clip-dir clip/]

What is measured, and how: trainer/jobs/scoring.py.

Output: `$SM_MODEL_DIR/evaluation.json` (SageMaker ships it in the job's model.tar.gz):

    {"schema": 1,
     "eval_set": {"digest", "samples", "shards"},
     "config": {"timesteps", "seed", "resolution", "steps", "guidance"},
     "models": {"candidate": {"val_loss", "val_loss_by_timestep": {"100": ...}, "val_loss_note",
                              "val_loss_measure", "clip_score", "clip_note"},
                "baseline": {... the same, only with a baseline channel}}}

`eval_set.digest` is the sha256 of the lines `<shard path in the channel>\\t<sha256 of its bytes>\\n`
sorted by path; `val_loss_measure` names what the loss measures (the prediction and timesteps: the gate
compares two models' losses only when they measure the same at the same resolution); `shards` lists those paths; `samples` counts the samples scored. A non-finite
loss is written as null and `val_loss_note` says where; `clip_score` is null with `clip_note`
"no scorer" without a `clip` channel. No eval channel, no shards in it or no readable sample,
and no candidate model fail the job with an EvaluationError (the container writes it to
`<root>/output/failure`).
"""

import argparse
import json
import os
import tarfile
import tempfile
from pathlib import Path

import torch

from contracts import s3_layout
from contracts.recipe_jobs import EvaluateOptions
from trainer.data.eval_set import EvaluationError, eval_set_digest, find_eval_shards, read_eval_samples
from trainer.jobs.hyperparameters import add_options, checked
from trainer.jobs.scoring import EvalConfig, load_scorer, score_model
from trainer.models.families import sample_size
from trainer.runtime.health import log

SCHEMA = 1


# ---------------------------------------------------------------- models


def channel_dir(channel: str | None, scratch: Path, name: str, marker: str = "model_index.json") -> Path | None:
    """The saved model a channel holds (`marker` at its root), its `model.tar.gz` unpacked under `scratch`
    when it holds that instead; None without a channel."""
    if not channel:
        return None
    path = Path(channel)
    if (path / marker).is_file():
        return path
    if (path / s3_layout.MODEL_ARCHIVE).is_file():
        unpacked = scratch / name
        with tarfile.open(path / s3_layout.MODEL_ARCHIVE) as archive:
            archive.extractall(unpacked, filter="data")
        if (unpacked / marker).is_file():
            return unpacked
    raise EvaluationError(f"the {name} channel {channel} holds neither a saved model ({marker}) "
                          f"nor a model.tar.gz with one at its root")


def trained_resolution(path: Path) -> int:
    """The resolution of the model's last training phase, else the size its denoiser was built for."""
    record_path = path / s3_layout.TRAINING_RECORD
    if record_path.is_file():
        stages = json.loads(record_path.read_text()).get("stages") or []
        if stages and isinstance(stages[-1].get("resolution"), int):
            return stages[-1]["resolution"]
    denoiser = path / "unet" / "config.json"
    denoiser = denoiser if denoiser.is_file() else path / "transformer" / "config.json"
    vae = json.loads((path / "vae" / "config.json").read_text())
    return sample_size(json.loads(denoiser.read_text())) * 2 ** (len(vae["block_out_channels"]) - 1)


# ---------------------------------------------------------------- main


def main(args: argparse.Namespace) -> dict:
    """Score the candidate (and baseline) on the eval set; write and return evaluation.json."""
    # setup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    timesteps = [int(part) for part in args.timesteps.split(",")]  # checked by EvaluateOptions
    shards = find_eval_shards(args.eval_dir)  # checked before any model loads
    with tempfile.TemporaryDirectory(prefix="atelier-evaluate-") as scratch_dir:  # unpacked model.tar.gz files
        scratch = Path(scratch_dir)

        # models: where they are (weights load one model at a time, below)
        candidate = channel_dir(args.candidate_dir, scratch, "candidate")
        if candidate is None:
            raise EvaluationError("the evaluation needs a `candidate` channel with the model to evaluate")
        baseline = channel_dir(args.baseline_dir, scratch, "baseline")
        config = EvalConfig(timesteps, args.seed, args.resolution or trained_resolution(candidate), args.steps, args.guidance)
        scorer = load_scorer(channel_dir(args.clip_dir, scratch, "clip", marker="config.json"), device)

        # data: the held-out samples, the same for every model
        samples, problems = read_eval_samples(shards, config.resolution, args.max_samples)
        if not samples:
            raise EvaluationError(f"no readable samples in {len(shards)} shard(s) under {args.eval_dir}; "
                                  f"problems: {problems[:5]}")
        eval_set = {"digest": eval_set_digest(args.eval_dir, shards), "samples": len(samples),
                    "shards": [shard.relative_to(args.eval_dir).as_posix() for shard in shards]}
        log(0, event="eval_set", **eval_set, skipped=len(problems), first_skipped=problems[:5], config=config.to_json())

        # scores
        scores = {}
        for name, path in (("candidate", candidate), ("baseline", baseline)):
            if path is not None:
                scores[name] = score_model(path, samples, config, scorer, device)
                log(0, event="evaluated", model=name, **scores[name])

    # save
    evaluation = {"schema": SCHEMA, "eval_set": eval_set, "config": config.to_json(), "models": scores}
    output = Path(args.model_dir) / s3_layout.EVALUATION_FILE
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(evaluation, indent=2) + "\n")
    log(0, event="saved", path=str(output))
    return evaluation


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Score a candidate (and baseline) pipeline on held-out shards.")
    where = parser.add_argument_group("where")
    where.add_argument("--candidate-dir", default=env.get("SM_CHANNEL_CANDIDATE"),
                       help="the model to evaluate: a pipeline directory or one holding model.tar.gz ($SM_CHANNEL_CANDIDATE)")
    where.add_argument("--baseline-dir", default=env.get("SM_CHANNEL_BASELINE"),
                       help="optional production model, same forms ($SM_CHANNEL_BASELINE)")
    where.add_argument("--eval-dir", default=env.get("SM_CHANNEL_EVAL"), help="held-out shards ($SM_CHANNEL_EVAL)")
    where.add_argument("--clip-dir", default=env.get("SM_CHANNEL_CLIP"),
                       help="optional CLIP model, tokenizer and image processor ($SM_CHANNEL_CLIP)")
    where.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                       help=f"where {s3_layout.EVALUATION_FILE} is written ($SM_MODEL_DIR)")
    add_options(parser, EvaluateOptions)  # the recipe (contracts.recipe_jobs); the paths above are not in it
    return checked(parser, EvaluateOptions, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args())
