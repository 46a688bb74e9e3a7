"""A trained denoiser with the frozen parts as its family's diffusers pipeline: what a job saves and samples from."""

import torch
from diffusers import DDIMScheduler, DiffusionPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline

from trainer.models import families
from trainer.models.bundle import Models


def build_pipeline(models: Models, unet: torch.nn.Module, resolution: int | None = None) -> DiffusionPipeline:
    """The given denoiser with the frozen parts as the family's pipeline, ready to save or sample (a flow
    sampler shifted for `resolution`, default the model's)."""
    if models.family is not None:
        shift = models.flow.shift(resolution or models.default_resolution)
        return families.build_pipeline(models.family, unet, models.vae, *models._text_parts(), shift)
    # DDIM samples well in few steps and reads the training noise schedule as it is.
    scheduler = DDIMScheduler.from_config(models.noise_scheduler.config)
    if models.sdxl:
        return StableDiffusionXLPipeline(
            vae=models.vae,
            text_encoder=models.text_encoders[0],
            text_encoder_2=models.text_encoders[1],
            tokenizer=models.tokenizers[0],
            tokenizer_2=models.tokenizers[1],
            unet=unet,
            scheduler=scheduler,
            add_watermarker=False,
        )
    return StableDiffusionPipeline(
        vae=models.vae,
        text_encoder=models.text_encoders[0],
        tokenizer=models.tokenizers[0],
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
