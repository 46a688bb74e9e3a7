"""The models of a latent-diffusion run as one bundle: VAE, text encoder(s) and tokenizer(s), the denoiser
(a UNet, or a transformer family's transformer: trainer/models/families.py), noise scheduler.

Two UNet families, told apart by the UNet's config:
- SD-1.x/2.x style: one text encoder, its last hidden state is the UNet's context.
- SDXL style (`addition_embed_type: "text_time"`): two text encoders whose penultimate hidden states
  are concatenated into the context, the second one's pooled projection plus six size/crop numbers
  (`time_ids`: original size, crop top-left, target size) as added conditioning.

Only the denoiser trains. The VAE and text encoders are frozen: they map images to latents and captions
to embeddings, and training them too would move the target under the UNet.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDPMScheduler

from trainer.models import families
from trainer.models.families import Family
from trainer.objectives.flow_matching import FlowSettings

CPU = torch.device("cpu")


@dataclass
class Models:
    vae: AutoencoderKL
    text_encoders: list  # [CLIPTextModel], SDXL's two, or a transformer family's (text_folders names them)
    tokenizers: list
    denoiser: torch.nn.Module  # what trains: the UNet, or a transformer family's transformer
    noise_scheduler: DDPMScheduler | None  # the UNet family's noise schedule; None for flow matching
    sources: dict[str, str] = field(default_factory=dict)  # component -> where it came from (the run's record)
    family: Family | None = None  # a transformer family (trainer/families.py); None: the UNet family
    flow: FlowSettings | None = None  # a transformer family's flow-matching settings
    text_folders: list[tuple[str, str]] = field(default_factory=list)  # (encoder, tokenizer) subfolders, in order
    tokenization: dict = field(default_factory=dict)  # where the tokenizers came from, how captions tokenize
    base: Path | None = None  # the --pretrained folder the parts came from (unpacked when it was a model.tar.gz)
    # a transformer family's text encoders, described without their weights (trainer/data/latents.py hashes it):
    # {"files": {subfolder: folder}} from a base, or {"built": {subfolder: config}, "seed": s} from a preset
    text_origin: dict = field(default_factory=dict)
    # a family trained from stored embeddings holds no text encoder; this builds or loads them (on the CPU) to save them
    text_loader: Callable[[], dict] | None = field(default=None, repr=False)
    _text_pipeline: object = field(default=None, repr=False)
    _prompt_embeddings: dict = field(default_factory=dict, repr=False)  # stored_prompt_embeddings' one entry

    @property
    def sdxl(self) -> bool:
        """Whether the UNet takes SDXL's pooled text embedding and size/crop time ids."""
        return self.family is None and self.denoiser.config.addition_embed_type == "text_time"

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def size_multiple(self) -> int:
        """Image sides must be multiples of this: the VAE's and the denoiser's downsampling (a transformer's patch) together."""
        if self.family is not None:
            return families.size_multiple(self.denoiser, self.vae_scale_factor)
        return self.vae_scale_factor * 2 ** (len(self.denoiser.config.block_out_channels) - 1)

    @property
    def default_resolution(self) -> int:
        """The image size the model was built for: latent sample size times the VAE's downsampling."""
        return families.sample_size(self.denoiser.config) * self.vae_scale_factor

    def latents(self, sample: torch.Tensor) -> torch.Tensor:
        """A VAE latent sample made unit-variance as the family's pipeline expects (SD3 subtracts a shift first)."""
        if self.family is not None and self.family.shifts_latents:
            return (sample - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        return sample * self.vae.config.scaling_factor

    def text_pipeline(self):
        """A transformer family's pipeline over the text parts, whose encode_prompt conditions training."""
        if self._text_pipeline is None:
            self._text_pipeline = families.text_pipeline(self.family, self.denoiser, *self._text_parts())
        return self._text_pipeline

    def _text_parts(self) -> tuple[dict, dict]:
        return ({encoder: model for (encoder, _), model in zip(self.text_folders, self.text_encoders)},
                {tokenizer: model for (_, tokenizer), model in zip(self.text_folders, self.tokenizers)})

    def stored_prompt_embeddings(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """A family trained on stored embeddings: `prompts`' pipeline embeddings (with the empty negative), computed
        on the CPU by its text encoders, loaded for it and dropped after (they never reach the GPU); once per prompts."""
        key = tuple(prompts)
        if key not in self._prompt_embeddings:
            encoders = self.text_loader()
            encoders = {name: encoders[name].requires_grad_(False).eval() for name, _ in self.text_folders}
            tokenizers = self._text_parts()[1]
            pipeline = families.text_pipeline(self.family, self.denoiser, encoders, tokenizers)
            self._prompt_embeddings = {key: families.prompt_embeddings(self.family, pipeline, prompts)}
        return self._prompt_embeddings[key]

    def load_text_encoders(self) -> None:
        """The text encoders of a family trained without them (latent shards with its embeddings), on the CPU:
        the saved pipeline holds them. Nothing to do when they are here."""
        if self.text_loader is not None and not self.text_encoders:
            encoders = self.text_loader()
            self.text_encoders = [encoders[encoder].requires_grad_(False).eval() for encoder, _ in self.text_folders]

    def frozen_to(self, device: torch.device) -> None:
        """VAE and text encoders on the device; in bf16 on a GPU, where they only run forward."""
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        for frozen in (self.vae, *self.text_encoders):
            frozen.to(device, dtype)
