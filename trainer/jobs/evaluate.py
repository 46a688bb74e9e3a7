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

Hyperparameters (strings): `timesteps` ("100,300,500,700,900"), `seed` (0), `max-samples` or
`max_samples` (64), `resolution` (the candidate's last training stage from atelier-training.json,
else the size its UNet was built for), `steps` (20: sampling steps for CLIP images), `guidance` (5.0).

By hand:

    python -m trainer.jobs.evaluate --candidate-dir out/model --eval-dir heldout/ --model-dir out/eval \\
        [--baseline-dir prod/model] [--clip-dir clip/]

What is measured
----------------
- Validation loss at fixed timesteps and seeds. Each eval sample (its image cropped to a centred
  square of `resolution`) is encoded by the model's VAE (the posterior mean: no draw), noised at
  every timestep with noise from a CPU generator seeded by (seed, sample number, timestep), and
  the UNet, conditioned on the caption, predicts the scheduler's target (the noise for `epsilon`,
  the velocity for `v_prediction`). `val_loss` is the mean squared error over samples and
  timesteps, `val_loss_by_timestep` the mean over samples at each. The candidate and the baseline
  see the same images, captions and noise, so their losses compare sample for sample.
- CLIP score (with a `clip` channel): one image per eval caption, sampled with DDIM at `steps` and
  `guidance` from a CPU generator seeded by (seed, sample number); score = the mean over captions
  of 100 * max(cos(image embedding, caption embedding), 0).

Everything runs in fp32 with seeded CPU generators: the same inputs give the same numbers.

Output: `$SM_MODEL_DIR/evaluation.json` (SageMaker ships it in the job's model.tar.gz):

    {"schema": 1,
     "eval_set": {"digest", "samples", "shards"},
     "config": {"timesteps", "seed", "resolution", "steps", "guidance"},
     "models": {"candidate": {"val_loss", "val_loss_by_timestep": {"100": ...}, "val_loss_note",
                              "clip_score", "clip_note"},
                "baseline": {... the same, only with a baseline channel}}}

`eval_set.digest` is the sha256 of the lines `<shard path in the channel>\\t<sha256 of its bytes>\\n`
sorted by path; `shards` lists those paths; `samples` counts the samples scored. A non-finite
loss is written as null and `val_loss_note` says where; `clip_score` is null with `clip_note`
"no scorer" without a `clip` channel. No eval channel, no shards in it or no readable sample,
and no candidate model fail the job with an EvaluationError (the container writes it to
`<root>/output/failure`).
"""

import argparse
import hashlib
import json
import math
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel
from wids.wids import IndexedTarSamples

from contracts import s3_layout
from contracts.shard_members import IMAGE_FORMATS
from trainer.data.buckets import cover_and_crop
from trainer.data.shards import decode_image, scan_shard, to_tensor
from trainer.runtime.health import log
from trainer.models.loading import Models, build_pipeline, encode_captions, from_pretrained

SCHEMA = 1
DEFAULT_TIMESTEPS = "100,300,500,700,900"
CLIP_BATCH = 16
NO_SCORER = "no scorer"


class EvaluationError(ValueError):
    """The evaluation cannot run as configured; the message says what is missing."""


@dataclass(frozen=True)
class EvalConfig:
    timesteps: list[int]
    seed: int
    resolution: int
    steps: int
    guidance: float

    def to_json(self) -> dict:
        return {"timesteps": self.timesteps, "seed": self.seed, "resolution": self.resolution, "steps": self.steps,
                "guidance": self.guidance}


@dataclass(frozen=True)
class EvalSample:
    key: str
    caption: str
    pixels: torch.Tensor  # [3, R, R] in [-1, 1]
    time_ids: list[int]  # SDXL's (original h, w, crop top, left, target h, w)


@dataclass(frozen=True)
class Scorer:
    model: CLIPModel
    tokenizer: object
    image_processor: object


# ---------------------------------------------------------------- the eval set


def find_eval_shards(eval_dir: str | None) -> list[Path]:
    """Every `*.tar` under the eval channel, sorted by path; EvaluationError when there is none."""
    if not eval_dir or not Path(eval_dir).is_dir():
        raise EvaluationError(f"the evaluation needs an `eval` channel of held-out shards; got {eval_dir!r}")
    shards = sorted(path for path in Path(eval_dir).rglob("*.tar") if path.is_file())
    if not shards:
        raise EvaluationError(f"no shards (*.tar) under the eval channel {eval_dir}")
    return shards


def eval_set_digest(eval_dir: str, shards: list[Path]) -> str:
    """sha256 over the sorted lines `<path in the channel>\\t<sha256 of the shard>\\n`."""
    lines = sorted(f"{shard.relative_to(eval_dir).as_posix()}\t{file_sha256(shard)}\n" for shard in shards)
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_eval_samples(shards: list[Path], resolution: int, max_samples: int) -> tuple[list[EvalSample], list[str]]:
    """The first `max_samples` readable samples in shard order, centre-cropped squares; and what was skipped."""
    samples, problems = [], []
    for shard in shards:
        rows, shard_problems = scan_shard(str(shard))
        problems += shard_problems
        if not rows:
            continue
        reader = IndexedTarSamples(path=str(shard))
        try:
            for number, key, _ in rows:
                if len(samples) == max_samples:
                    return samples, problems
                try:
                    samples.append(load_sample(reader[number], key, resolution))
                except Exception as error:  # noqa: BLE001 - an undecodable sample is skipped, as in training
                    problems.append(f"{shard.name}/{key}: {type(error).__name__}: {error}")
        finally:
            reader.close()
    return samples, problems


def load_sample(members: dict, key: str, resolution: int) -> EvalSample:
    """One sample's image as a centred square of `resolution`, and its caption."""
    members = {extension[1:].lower(): data.getvalue() for extension, data in members.items() if extension != "__key__"}
    extension = next(extension for extension in IMAGE_FORMATS if extension in members)
    image = decode_image(members[extension], IMAGE_FORMATS[extension])
    width, height = image.size
    resized, (left, top) = cover_and_crop(width, height, (resolution, resolution), (0.5, 0.5))
    image = image.resize(resized, Image.Resampling.BICUBIC).crop((left, top, left + resolution, top + resolution))
    return EvalSample(key, members["txt"].decode("utf-8"), to_tensor(image), [height, width, top, left, resolution, resolution])


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
    """The resolution of the model's last training stage, else the size its UNet was built for."""
    record_path = path / "atelier-training.json"
    if record_path.is_file():
        stages = json.loads(record_path.read_text()).get("stages") or []
        if stages and isinstance(stages[-1].get("resolution"), int):
            return stages[-1]["resolution"]
    unet = json.loads((path / "unet" / "config.json").read_text())
    vae = json.loads((path / "vae" / "config.json").read_text())
    return unet["sample_size"] * 2 ** (len(vae["block_out_channels"]) - 1)


def load_models(path: Path, device: torch.device) -> Models:
    """The pipeline's components in fp32 on `device`, in eval mode."""
    return for_scoring(from_pretrained(path), device)


def for_scoring(models: Models, device: torch.device) -> Models:
    """`models` frozen, in eval mode, in fp32 on `device`."""
    for module in (models.vae, models.unet, *models.text_encoders):
        module.requires_grad_(False)
        module.eval()
        module.to(device, torch.float32)
    return models


def load_scorer(clip_dir: Path | None, device: torch.device) -> Scorer | None:
    """The CLIP model, tokenizer and image processor saved in the `clip` channel, or None without one."""
    if clip_dir is None:
        return None
    model = CLIPModel.from_pretrained(clip_dir).to(device, torch.float32).eval()
    return Scorer(model, AutoTokenizer.from_pretrained(clip_dir), AutoImageProcessor.from_pretrained(clip_dir))


# ---------------------------------------------------------------- scores


def draw_seed(*numbers: int) -> int:
    """A 63-bit seed that is a pure function of the numbers."""
    return int(np.random.SeedSequence(list(numbers)).generate_state(1, np.uint64)[0]) & (2**63 - 1)


# On a GPU, UNet rows (samples x timesteps) per call at 512 px, scaled by the inverse of the area:
# 40 rows of an SD-2-size UNet in fp32 fit a 24 GB GPU, and one sample per call leaves a GPU
# waiting on kernel launches. A CPU is compute-bound: bench/eval_losses.py measured no gain from
# batching there (small@256: 2 samples per call 0.96x, 32 per call 0.72x), so it takes one.
LOSS_ROWS_AT_512 = 40


def samples_per_call(timesteps: int, resolution: int, device: torch.device) -> int:
    """How many eval samples one VAE, text-encoder and UNet call takes in `validation_losses`."""
    if device.type == "cpu":
        return 1
    rows = int(LOSS_ROWS_AT_512 * (512 / resolution) ** 2)
    return max(1, rows // max(timesteps, 1))


@torch.no_grad()
def validation_losses(models: Models, samples: list[EvalSample], config: EvalConfig, device: torch.device,
                      per_call: int | None = None) -> torch.Tensor:
    """[samples, timesteps] squared errors of the UNet's prediction of the scheduler's target.
    `per_call` samples go through the models at once (default `samples_per_call`); each sample's
    noise is drawn from its own seed, so the losses do not depend on it beyond rounding."""
    scheduler, count = models.noise_scheduler, len(config.timesteps)
    per_call = per_call or samples_per_call(count, config.resolution, device)
    losses = torch.empty(len(samples), count, dtype=torch.float64)
    for start in range(0, len(samples), per_call):
        chunk = samples[start:start + per_call]
        pixels = torch.stack([sample.pixels for sample in chunk]).to(device)
        latents = models.vae.encode(pixels).latent_dist.mean * models.vae.config.scaling_factor
        latents = latents.repeat_interleave(count, dim=0)  # rows: sample-major, then timestep
        timesteps = torch.tensor(config.timesteps * len(chunk), dtype=torch.long, device=device)
        noise = torch.stack([
            torch.randn(latents.shape[1:], generator=torch.Generator("cpu").manual_seed(draw_seed(config.seed, number, t)))
            for number in range(start, start + len(chunk)) for t in config.timesteps
        ]).to(device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        target = scheduler.get_velocity(latents, noise, timesteps) if scheduler.config.prediction_type == "v_prediction" else noise
        context, pooled = encode_captions(models, [sample.caption for sample in chunk], device)  # once a caption
        context = context.repeat_interleave(count, dim=0)
        added = None
        if models.sdxl:
            time_ids = torch.tensor([sample.time_ids for sample in chunk], dtype=torch.float32, device=device)
            added = {"text_embeds": pooled.repeat_interleave(count, dim=0), "time_ids": time_ids.repeat_interleave(count, dim=0)}
        prediction = models.unet(noisy, timesteps, context, added_cond_kwargs=added).sample
        errors = F.mse_loss(prediction, target, reduction="none").mean(dim=(1, 2, 3))
        losses[start:start + len(chunk)] = errors.view(len(chunk), count).double().cpu()
    return losses


def loss_summary(losses: torch.Tensor, config: EvalConfig, prediction_type: str) -> dict:
    """val_loss, val_loss_by_timestep and a note; a non-finite mean is null and the note says where."""
    by_timestep = {str(t): finite_or_none(losses[:, i].mean().item()) for i, t in enumerate(config.timesteps)}
    overall = finite_or_none(losses.mean().item())
    note = f"mean squared error of the {prediction_type} prediction over {len(losses)} samples x {len(config.timesteps)} timesteps"
    if overall is None:
        bad = [t for t, value in by_timestep.items() if value is None]
        note = f"non-finite loss at timesteps {', '.join(bad)}; written as null"
    return {"val_loss": overall, "val_loss_by_timestep": by_timestep, "val_loss_note": note}


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@torch.no_grad()
def sample_images(models: Models, prompts: list[str], config: EvalConfig) -> list[Image.Image]:
    """One DDIM image per prompt at the eval resolution, prompt i from a generator seeded by (seed, i)."""
    pipeline = build_pipeline(models, models.unet)
    pipeline.set_progress_bar_config(disable=True)
    return [
        pipeline(prompt, num_inference_steps=config.steps, guidance_scale=config.guidance, height=config.resolution,
                 width=config.resolution, generator=torch.Generator("cpu").manual_seed(draw_seed(config.seed, number))).images[0]
        for number, prompt in enumerate(prompts)
    ]


@torch.no_grad()
def clip_score(scorer: Scorer, images: list[Image.Image], prompts: list[str], device: torch.device) -> float:
    """The mean over prompts of 100 * max(cos(image embedding, prompt embedding), 0)."""
    max_length = scorer.model.config.text_config.max_position_embeddings
    scores = []
    for start in range(0, len(prompts), CLIP_BATCH):
        tokens = scorer.tokenizer(prompts[start:start + CLIP_BATCH], padding=True, truncation=True,
                                  max_length=max_length, return_tensors="pt").to(device)
        pixels = scorer.image_processor(images=images[start:start + CLIP_BATCH], return_tensors="pt").pixel_values
        output = scorer.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, pixel_values=pixels.to(device))
        cosine = F.cosine_similarity(output.image_embeds, output.text_embeds, dim=-1)
        scores.append(100 * cosine.clamp(min=0).double().cpu())
    return torch.cat(scores).mean().item()


def score_model(path: Path, samples: list[EvalSample], config: EvalConfig, scorer: Scorer | None,
                device: torch.device) -> dict:
    """One model's block of evaluation.json."""
    models = load_models(path, device)
    if config.resolution % models.size_multiple:
        raise EvaluationError(f"resolution {config.resolution} is not a multiple of {models.size_multiple}, "
                              f"the size multiple of the model in {path}")
    if not all(0 <= t < models.noise_scheduler.config.num_train_timesteps for t in config.timesteps):
        raise EvaluationError(f"timesteps {config.timesteps} must lie in [0, {models.noise_scheduler.config.num_train_timesteps})")
    losses = validation_losses(models, samples, config, device)
    block = loss_summary(losses, config, models.noise_scheduler.config.prediction_type)
    if scorer is None:
        return {**block, "clip_score": None, "clip_note": NO_SCORER}
    prompts = [sample.caption for sample in samples]
    score = finite_or_none(clip_score(scorer, sample_images(models, prompts, config), prompts, device))
    note = (f"mean over {len(prompts)} captions of 100 * max(cos, 0); {config.steps} DDIM steps, guidance {config.guidance:g}"
            if score is not None else "non-finite CLIP score; written as null")
    return {**block, "clip_score": score, "clip_note": note}


# ---------------------------------------------------------------- main


def main(args: argparse.Namespace) -> dict:
    """Score the candidate (and baseline) on the eval set; write and return evaluation.json."""
    # setup
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    timesteps = parse_timesteps(args.timesteps)
    if args.max_samples < 1:
        raise EvaluationError(f"max_samples must be at least 1, got {args.max_samples}")
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


def parse_timesteps(text: str) -> list[int]:
    """Parse "100,300" into [100, 300]; EvaluationError unless distinct non-negative integers."""
    try:
        timesteps = [int(part) for part in text.split(",")]
    except ValueError:
        raise EvaluationError(f"timesteps must be comma-separated integers, got {text!r}") from None
    if len(set(timesteps)) != len(timesteps) or min(timesteps) < 0:
        raise EvaluationError(f"timesteps must be distinct non-negative integers, got {text!r}")
    return timesteps


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
    what = parser.add_argument_group("what")
    what.add_argument("--timesteps", default=DEFAULT_TIMESTEPS, help="comma-separated noise timesteps for the loss")
    what.add_argument("--seed", type=int, default=0, help="seeds every noise draw and sampled image")
    what.add_argument("--max-samples", "--max_samples", dest="max_samples", type=int, default=64,
                      help="the first N readable eval samples")
    what.add_argument("--resolution", type=int, default=None,
                      help="square image side (default: the candidate's last training stage, else its built size)")
    what.add_argument("--steps", type=int, default=20, help="DDIM steps for the CLIP images")
    what.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance for the CLIP images")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
