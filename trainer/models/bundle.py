"""The models of a latent-diffusion run as one bundle: VAE, text encoder(s) and tokenizer(s), UNet, noise scheduler.

Two families, told apart by the UNet's config:
- SD-1.x/2.x style: one text encoder, its last hidden state is the UNet's context.
- SDXL style (`addition_embed_type: "text_time"`): two text encoders whose penultimate hidden states
  are concatenated into the context, the second one's pooled projection plus six size/crop numbers
  (`time_ids`: original size, crop top-left, target size) as added conditioning.

Only the UNet trains. The VAE and text encoders are frozen: they map images to latents and captions
to embeddings, and training them too would move the target under the UNet.
"""

from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel

CPU = torch.device("cpu")


@dataclass
class Models:
    vae: AutoencoderKL
    text_encoders: list  # [CLIPTextModel] or, for SDXL, [CLIPTextModel, CLIPTextModelWithProjection]
    tokenizers: list
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler
    sources: dict[str, str] = field(default_factory=dict)  # component -> where it came from (the run's record)

    @property
    def sdxl(self) -> bool:
        """Whether the UNet takes SDXL's pooled text embedding and size/crop time ids."""
        return self.unet.config.addition_embed_type == "text_time"

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this: the VAE's and the UNet's downsampling together."""
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)

    @property
    def default_resolution(self) -> int:
        """The image size the model was built for: latent sample size times the VAE's downsampling."""
        return self.unet.config.sample_size * self.vae_scale_factor

    def frozen_to(self, device: torch.device) -> None:
        """VAE and text encoders on the device; in bf16 on a GPU, where they only run forward."""
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for frozen in (self.vae, *self.text_encoders):
            frozen.to(device, dtype)
