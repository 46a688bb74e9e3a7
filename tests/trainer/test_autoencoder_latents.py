"""The autoencoder job's latent normalisation: the scale (and, for the SD3 family's 16-channel latents, the
shift) measured from the data, so the denoiser sees zero-mean, unit-variance latents (issue 42.5)."""

import json

import pytest
import torch
from diffusers import AutoencoderKL

from contracts.shard_members import IMAGE_FORMATS
from trainer.data.images import crop_to_bucket, decode_image
from trainer.jobs import autoencoder
from trainer.models.loading import load_models

pytestmark = pytest.mark.slow(seconds=40)


def test_a_family_that_shifts_gets_the_mean_as_shift_and_the_inverse_std_as_scale():
    assert autoencoder.latent_normalisation(0.4, 2.0, shifts=True) == {"shift_factor": 0.4, "scaling_factor": 0.5}
    assert autoencoder.latent_normalisation(0.4, 2.0, shifts=False) == {"scaling_factor": 0.5}


@pytest.fixture(scope="module")
def sd3_vae(tmp_path_factory, shards_dir):
    root = tmp_path_factory.mktemp("ae-sd3")
    autoencoder.main(autoencoder.parse_args([
        "--train-dir", str(shards_dir), "--model-dir", str(root / "vae"), "--model-config", "tiny-sd3",
        "--resolution", "32", "--steps", "4", "--batch-size", "2", "--scaling-batches", "3", "--aspect-buckets", "false",
        "--random-crop", "false", "--num-workers", "0", "--log-every", "2"]))
    return root / "vae"


def test_the_sd3_preset_s_autoencoder_has_16_channels_and_a_measured_shift_and_scale(sd3_vae):
    vae = AutoencoderKL.from_pretrained(sd3_vae)
    record = json.loads((sd3_vae / autoencoder.RECORD).read_text())
    assert vae.config.latent_channels == record["latent_channels"] == 16
    assert vae.config.shift_factor == record["shift_factor"] and vae.config.shift_factor != 0.0
    assert vae.config.scaling_factor == record["scaling_factor"] and vae.config.scaling_factor != 1.0


def test_the_measured_normalisation_gives_the_transformer_zero_mean_unit_variance_latents(sd3_vae, samples):
    """A run on that VAE (--vae) sees latents (z - shift) * scale with mean ~0 and std ~1 over the images."""
    models = load_models("tiny-sd3", None, seed=0, vae=str(sd3_vae))
    pixels = torch.stack([crop_to_bucket(decode_image(sample["image"], IMAGE_FORMATS[sample["extension"]]), (32, 32),
                                         (0.5, 0.5))[0] for sample in samples])
    with torch.no_grad():
        posterior = models.vae.encode(pixels).latent_dist
        latents = models.latents(posterior.sample(generator=torch.Generator().manual_seed(0)))
    assert abs(latents.mean().item()) < 0.25 and abs(latents.std().item() - 1) < 0.25
