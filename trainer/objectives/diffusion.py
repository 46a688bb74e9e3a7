"""The latent-diffusion training objective, the diffusers recipe: noise the image latents at random
timesteps and regress the UNet's prediction onto the scheduler's target.

Options:
- prediction type (the noise scheduler's `prediction_type`): `epsilon` targets the noise,
  `v_prediction` the velocity `alpha_t * noise - sigma_t * x0`.
- noise offset: adds `offset * N(0, 1)` per image and channel to the noise, so the model can learn
  to change an image's overall brightness (Guttenberg, "Diffusion with offset noise", 2023).
- min-SNR weighting: each sample's loss weighted by `min(SNR_t, gamma) / SNR_t` (epsilon) or
  `/ (SNR_t + 1)` (v-prediction), so the many easy low-noise timesteps do not dominate
  (Hang et al., "Efficient Diffusion Training via Min-SNR Weighting Strategy", 2023).
- zero terminal SNR (`zero_terminal_snr`): the noise schedule rescaled so its last timestep is pure
  noise (v-prediction only).

A batch brings `pixel_values` (image shards: the VAE encodes them), `latent_dist` (latent shards: the
posterior trainer/jobs/encode.py stored) or `latents` (already sampled and scaled), and `caption`,
`input_ids` (token ids, a UNet's latent shards) or `prompt_embeds` and the rest of a transformer family's
stored conditioning (its latent shards: no text encoder runs).

Every random draw of a micro-batch (VAE posterior sample, noise, timesteps) comes from a generator
seeded by (seed, step, rank, micro-batch): a step computes the same loss whether or not the job
was resumed before it (trainer/objectives/numerics.py: the generator, and bf16 autocast).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from trainer.models.bundle import Models
from trainer.models.families import STORED_NAMES, Conditioning, condition, layout, predict
from trainer.objectives import flow_matching
from trainer.objectives.flow_matching import sample_timesteps
from trainer.models.text import encode_captions, encode_token_ids
from trainer.objectives.numerics import autocast


@dataclass
class Noised:
    """One micro-batch made ready for the UNet: every random draw done, nothing left but its forward."""
    noisy_latents: torch.Tensor
    timesteps: torch.Tensor
    context: torch.Tensor  # the text encoders' hidden states
    target: torch.Tensor  # the noise (epsilon) or the velocity (v-prediction)
    weights: torch.Tensor | None  # per sample (min-SNR), or None: a plain mean
    added_conditions: dict | None  # SDXL's pooled text embedding and time ids
    conditioning: Conditioning | None = None  # a transformer family's text conditioning (timesteps then in [0, 1])


def diffusion_loss(unet, models: Models, batch: dict, device: torch.device, generator: torch.Generator,
                   noise_offset: float = 0.0, snr_gamma: float | None = None) -> torch.Tensor:
    """The mean (optionally min-SNR weighted) squared error of the UNet's prediction on one micro-batch."""
    return prediction_loss(unet, noised_inputs(models, batch, device, generator, noise_offset, snr_gamma))


def noised_inputs(models: Models, batch: dict, device: torch.device, generator: torch.Generator,
                  noise_offset: float = 0.0, snr_gamma: float | None = None) -> Noised:
    """The latents drawn and noised at random timesteps, the captions encoded, the target: all of the
    step's random draws, from `generator`, in one fixed order."""
    if models.family is not None:
        return flow_inputs(models, batch, device, generator)
    scheduler = models.noise_scheduler
    with torch.no_grad(), autocast(device):
        latents = image_latents(models, batch, device, generator)
        if "input_ids" in batch:
            context, pooled = encode_token_ids(models, batch["input_ids"], device)
        else:
            context, pooled = encode_captions(models, batch["caption"], device)
    noise = torch.randn(latents.shape, generator=generator, device=device)
    if noise_offset:
        noise += noise_offset * torch.randn((*latents.shape[:2], 1, 1), generator=generator, device=device)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), generator=generator, device=device)
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    v_prediction = scheduler.config.prediction_type == "v_prediction"
    target = scheduler.get_velocity(latents, noise, timesteps) if v_prediction else noise
    weights = min_snr_weights(scheduler, timesteps, snr_gamma, v_prediction) if snr_gamma else None
    added_conditions = None
    if models.sdxl:
        added_conditions = {"text_embeds": pooled, "time_ids": batch["time_ids"].to(device, non_blocking=True)}
    return Noised(noisy_latents, timesteps, context, target, weights, added_conditions)


def image_latents(models: Models, batch: dict, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    """The micro-batch's unit-variance latents: given, drawn from the stored posterior, or encoded by the VAE."""
    if "latents" in batch:  # precomputed (already sampled and scaled): the VAE is skipped
        return batch["latents"].to(device, non_blocking=True).float()
    if "latent_dist" in batch:  # latent shards hold the posterior (trainer/jobs/encode.py): the VAE is skipped
        posterior = DiagonalGaussianDistribution(batch["latent_dist"].to(device, models.vae.dtype, non_blocking=True))
    else:
        pixel_values = batch["pixel_values"].to(device, non_blocking=True)
        posterior = models.vae.encode(pixel_values.to(models.vae.dtype)).latent_dist
    # drawn here, from the step's generator, whichever kind of shard: the same latents and loss; in one
    # memory layout (the CPU's VAE returns channels-last), so the backward takes the same kernels
    return models.latents(posterior.sample(generator=generator).float().contiguous())


def flow_inputs(models: Models, batch: dict, device: torch.device, generator: torch.Generator) -> Noised:
    """A transformer family's micro-batch: latents, conditioning, logit-normal timesteps shifted for the
    bucket's resolution, and the velocity target (trainer/objectives/flow_matching.py)."""
    if "input_ids" in batch:
        raise ValueError(f"these latent shards hold a UNet's token ids; a {models.family.name} model trains on its "
                         "own pipeline's embeddings: encode the image shards with its models (trainer.jobs.encode)")
    with torch.no_grad(), autocast(device):
        latents = image_latents(models, batch, device, generator)
        if STORED_NAMES["context"] in batch:  # latent shards: what encode_prompt gave, stored in bf16
            conditioning = layout(models.family, models.denoiser, Conditioning.from_tensors(
                {name: batch[name].to(device, non_blocking=True) for name in STORED_NAMES.values() if name in batch}))
            conditioning.context = conditioning.context.float()  # as the online path's (autocast casts it on a GPU)
            if conditioning.pooled is not None:
                conditioning.pooled = conditioning.pooled.float()
        else:
            conditioning = condition(models.family, models.text_pipeline(), batch["caption"], device)
    noise = torch.randn(latents.shape, generator=generator, device=device)
    resolution = round((latents.shape[-2] * latents.shape[-1]) ** 0.5) * models.vae_scale_factor
    t = sample_timesteps(models.flow, latents.shape[0], resolution, device, generator)
    noisy, target = flow_matching.noised(latents, noise, t)
    return Noised(noisy, t, conditioning.context, target, None, None, conditioning)


def prediction_loss(unet, noised: Noised, autocast_cache: bool = True) -> torch.Tensor:
    """The UNet's prediction on `noised` against its target: the loss whose backward trains it
    (`autocast_cache` False inside a CUDA graph capture, as torch's CUDA-graph notes require)."""
    with autocast(noised.noisy_latents.device, autocast_cache):
        if noised.conditioning is not None:
            prediction = predict(unet, noised.noisy_latents, noised.timesteps, noised.conditioning)
        else:
            prediction = unet(noised.noisy_latents, noised.timesteps, noised.context,
                              added_cond_kwargs=noised.added_conditions).sample
    per_sample = F.mse_loss(prediction.float(), noised.target.float(), reduction="none").mean(dim=(1, 2, 3))
    if noised.weights is not None:
        per_sample = per_sample * noised.weights
    return per_sample.mean()


def min_snr_weights(scheduler, timesteps: torch.Tensor, gamma: float, v_prediction: bool) -> torch.Tensor:
    """min(SNR, gamma) / SNR for epsilon targets, min(SNR, gamma) / (SNR + 1) for velocity targets."""
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps]
    snr = alphas_cumprod / (1 - alphas_cumprod)
    clipped = torch.clamp(snr, max=gamma)
    return clipped / (snr + 1) if v_prediction else clipped / snr


def zero_terminal_snr(scheduler: DDPMScheduler) -> DDPMScheduler:
    """The schedule rescaled so its last timestep is pure noise, sampled from the last timestep
    (Lin et al. 2024, "Common Diffusion Noise Schedules and Sample Steps are Flawed"): otherwise
    training always leaks the picture's mean colour at t = T and sampling, which starts from pure
    noise, cannot choose it from the prompt. Needs v-prediction (epsilon is undefined at SNR 0)."""
    if scheduler.config.prediction_type != "v_prediction":
        raise ValueError("--zero-terminal-snr needs --prediction-type v_prediction (epsilon is undefined at SNR 0)")
    return DDPMScheduler.from_config(scheduler.config, rescale_betas_zero_snr=True, timestep_spacing="trailing")
