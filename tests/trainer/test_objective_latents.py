"""The precomputed-latents path of the objective gives exactly the loss of the online VAE path."""

from __future__ import annotations

import torch

from trainer.models.loading import load_models
from trainer.objectives.diffusion import diffusion_loss

CPU = torch.device("cpu")


def test_a_batch_of_precomputed_latents_gives_the_online_vae_loss_exactly() -> None:
    # GIVEN the tiny model and a batch of images with captions
    models = load_models("tiny", None, seed=0)
    pixels = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    captions = ["a red circle", "a blue square"]
    online = torch.Generator().manual_seed(7)
    expected = diffusion_loss(models.denoiser, models, {"pixel_values": pixels, "caption": captions}, CPU, online)
    # WHEN the latents are computed beforehand with the same draw, as an encode step would
    offline = torch.Generator().manual_seed(7)
    with torch.no_grad():
        posterior = models.vae.encode(pixels).latent_dist
        latents = posterior.sample(generator=offline).float() * models.vae.config.scaling_factor
    got = diffusion_loss(models.denoiser, models, {"latents": latents, "caption": captions}, CPU, offline)
    # THEN the VAE is skipped and the loss is bit-for-bit the same
    assert torch.equal(got, expected)
