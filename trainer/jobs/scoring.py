"""The evaluation's scores of one model (trainer/jobs/evaluate.py runs them on the candidate and the baseline).

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
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

from trainer.data.eval_set import EvalSample, EvaluationError
from trainer.models.bundle import Models
from trainer.models.loading import from_pretrained
from trainer.models.pipelines import build_pipeline
from trainer.models.families import condition, negative_prompt, predict, sampling_options
from trainer.models.text import encode_captions
from trainer.objectives.flow_matching import VALIDATION_TIMESTEPS
from trainer.objectives.flow_matching import noised as flow_noised

CLIP_BATCH = 16
NO_SCORER = "no scorer"


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
class Scorer:
    model: CLIPModel
    tokenizer: object
    image_processor: object


# ---------------------------------------------------------------- models


def load_models(path: Path, device: torch.device) -> Models:
    """The pipeline's components in fp32 on `device`, in eval mode."""
    return for_scoring(from_pretrained(path), device)


def for_scoring(models: Models, device: torch.device) -> Models:
    """`models` frozen, in eval mode, in fp32 on `device`."""
    for module in (models.vae, models.denoiser, *models.text_encoders):
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
        prediction = models.denoiser(noisy, timesteps, context, added_cond_kwargs=added).sample
        errors = F.mse_loss(prediction, target, reduction="none").mean(dim=(1, 2, 3))
        losses[start:start + len(chunk)] = errors.view(len(chunk), count).double().cpu()
    return losses


@torch.no_grad()
def flow_validation_losses(models: Models, samples: list[EvalSample], seed: int, device: torch.device,
                           times: tuple[float, ...] = VALIDATION_TIMESTEPS) -> torch.Tensor:
    """[samples, 8] squared errors of a flow model's velocity at MLPerf Flux.1's 8 equidistant timesteps
    (trainer/flow_matching.py), or at `times`, each sample's noise fixed by (seed, sample, timestep index)."""
    count = len(times)
    losses = torch.empty(len(samples), count, dtype=torch.float64)
    for number, sample in enumerate(samples):
        latents = models.latents(models.vae.encode(sample.pixels[None].to(device)).latent_dist.mean).repeat(count, 1, 1, 1)
        noise = torch.stack([torch.randn(latents.shape[1:], generator=torch.Generator("cpu").manual_seed(
            draw_seed(seed, number, index))) for index in range(count)]).to(device)
        t = torch.tensor(times, dtype=latents.dtype, device=device)
        noisy, target = flow_noised(latents, noise, t)
        conditioning = condition(models.family, models.text_pipeline(), [sample.caption], device).repeat_interleave(count)
        prediction = predict(models.denoiser, noisy, t, conditioning)
        losses[number] = F.mse_loss(prediction, target, reduction="none").mean(dim=(1, 2, 3)).double().cpu()
    return losses


def flow_loss_summary(losses: torch.Tensor) -> dict:
    """val_loss (the mean over samples and the 8 timesteps), val_loss_by_timestep and the definition."""
    by_timestep = {f"{t:g}": finite_or_none(losses[:, i].mean().item()) for i, t in enumerate(VALIDATION_TIMESTEPS)}
    return {"val_loss": finite_or_none(losses.mean().item()), "val_loss_by_timestep": by_timestep,
            "val_loss_note": f"flow matching: mean squared error of the velocity over {len(losses)} samples x 8 "
                             "equidistant timesteps t = 0, 1/8, ..., 7/8 with fixed noise (MLPerf Training's Flux.1 metric)",
            "val_loss_measure": "flow velocity at t = 0, 1/8, ..., 7/8"}


def loss_summary(losses: torch.Tensor, config: EvalConfig, prediction_type: str) -> dict:
    """val_loss, val_loss_by_timestep and a note; a non-finite mean is null and the note says where."""
    by_timestep = {str(t): finite_or_none(losses[:, i].mean().item()) for i, t in enumerate(config.timesteps)}
    overall = finite_or_none(losses.mean().item())
    note = f"mean squared error of the {prediction_type} prediction over {len(losses)} samples x {len(config.timesteps)} timesteps"
    if overall is None:
        bad = [t for t, value in by_timestep.items() if value is None]
        note = f"non-finite loss at timesteps {', '.join(bad)}; written as null"
    return {"val_loss": overall, "val_loss_by_timestep": by_timestep, "val_loss_note": note,
            "val_loss_measure": f"{prediction_type} at timesteps {','.join(str(t) for t in config.timesteps)}"}


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@torch.no_grad()
def sample_images(models: Models, prompts: list[str], config: EvalConfig) -> list[Image.Image]:
    """One image per prompt at the eval resolution (DDIM, or a family's flow sampler at the shift it was saved
    with, scaled for the resolution), prompt i from a generator seeded by (seed, i)."""
    pipeline = build_pipeline(models, models.denoiser, config.resolution)
    pipeline.set_progress_bar_config(disable=True)
    return [
        pipeline(prompt, negative_prompt=negative_prompt(pipeline, None), num_inference_steps=config.steps,
                 guidance_scale=config.guidance, height=config.resolution, width=config.resolution,
                 generator=torch.Generator("cpu").manual_seed(draw_seed(config.seed, number)),
                 **sampling_options(pipeline, config.guidance)).images[0]
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
    if models.family is not None:  # flow matching: MLPerf's definition, whatever `timesteps` says
        block = flow_loss_summary(flow_validation_losses(models, samples, config.seed, device))
    else:
        if not all(0 <= t < models.noise_scheduler.config.num_train_timesteps for t in config.timesteps):
            raise EvaluationError(f"timesteps {config.timesteps} must lie in [0, {models.noise_scheduler.config.num_train_timesteps})")
        losses = validation_losses(models, samples, config, device)
        block = loss_summary(losses, config, models.noise_scheduler.config.prediction_type)
    if scorer is None:
        return {**block, "clip_score": None, "clip_note": NO_SCORER}
    prompts = [sample.caption for sample in samples]
    score = finite_or_none(clip_score(scorer, sample_images(models, prompts, config), prompts, device))
    sampler = "DDIM" if models.family is None else "flow-matching"
    note = (f"mean over {len(prompts)} captions of 100 * max(cos, 0); {config.steps} {sampler} steps, guidance {config.guidance:g}"
            if score is not None else "non-finite CLIP score; written as null")
    return {**block, "clip_score": score, "clip_note": note}
