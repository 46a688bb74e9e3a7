"""The models a latent-diffusion run needs: from a preset in `configs/` or a local diffusers pipeline.

Two families, told apart by the UNet's config:
- SD-1.x/2.x style: one text encoder, its last hidden state is the UNet's context.
- SDXL style (`addition_embed_type: "text_time"`): two text encoders whose penultimate hidden states
  are concatenated into the context, the second one's pooled projection plus six size/crop numbers
  (`time_ids`: original size, crop top-left, target size) as added conditioning.

Only the UNet trains. The VAE and text encoders are frozen: they map images to latents and captions
to embeddings, and training them too would move the target under the UNet.
"""

import json
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    DiffusionPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from trainer.tokenizer import build_tokenizer

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


@dataclass
class Models:
    vae: AutoencoderKL
    text_encoders: list  # [CLIPTextModel] or, for SDXL, [CLIPTextModel, CLIPTextModelWithProjection]
    tokenizers: list
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler

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


def compile_vae_encoder(models: Models, channels_last: bool = False, backend: str = "inductor") -> None:
    """Compile the frozen VAE's encoder in place (`nn.Module.compile`: the same module and weights, so
    checkpoints and the saved pipeline do not change), optionally with channels-last weights.

    For training on image shards on a GPU, where the encoder runs on every step: eager, it took more
    GPU time than the UNet's forward and backward at 512 (bench/RESULTS.md). One graph per bucket
    shape, as the UNet's. Channels-last weights must be made contiguous again before a save
    (`vae_encoder_eager`).
    """
    if channels_last:
        models.vae.encoder.to(memory_format=torch.channels_last)
    models.vae.encoder.compile(dynamic=False, backend=backend)


def vae_encoder_eager(models: Models) -> None:
    """Undo compile_vae_encoder: the encoder eager again, its weights contiguous."""
    models.vae.encoder.to(memory_format=torch.contiguous_format)
    models.vae.encoder._compiled_call_impl = None  # what nn.Module.compile set; None is nn.Module's own default


def load_models(model_config: str, pretrained: str | None, seed: int) -> Models:
    """A pretrained pipeline directory (or channel) when given, else a preset built from scratch with `seed`."""
    models = from_pretrained(resolve_pretrained(pretrained)) if pretrained else from_preset(model_config, seed)
    for frozen in (models.vae, *models.text_encoders):
        frozen.requires_grad_(False)
        frozen.eval()
    models.unet.train()
    return models


def read_preset(name: str) -> dict:
    """The JSON preset `configs/<name>.json`."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise ValueError(f"unknown model config {name!r}; presets: {', '.join(known)}")
    return json.loads(path.read_text())


def from_preset(name: str, seed: int) -> Models:
    """Fresh weights for the preset's architecture; the same seed gives the same weights."""
    preset = read_preset(name)
    torch.manual_seed(seed)
    tokenizers, text_encoders = [], []
    for key, model_class in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
        if key not in preset:
            continue
        tokenizer = build_tokenizer()
        text_config = CLIPTextConfig(
            **preset[key],
            vocab_size=len(tokenizer),  # the vocabulary is the tokenizer's, never the preset's
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        tokenizers.append(tokenizer)
        text_encoders.append(model_class(text_config))
    return Models(
        vae=AutoencoderKL(**preset["vae"]),
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        unet=UNet2DConditionModel(**preset["unet"]),
        noise_scheduler=DDPMScheduler(**preset["scheduler"]),
    )


def resolve_pretrained(value: str) -> Path:
    """A pipeline directory from `--pretrained`: a local path, or the name of a SageMaker channel.

    A channel that holds a previous job's `model.tar.gz` instead of a directory is unpacked first.
    """
    path = Path(value)
    if not path.exists() and os.environ.get(f"SM_CHANNEL_{value.upper()}"):
        path = Path(os.environ[f"SM_CHANNEL_{value.upper()}"])
    if (path / "model.tar.gz").is_file() and not (path / "model_index.json").is_file():
        unpacked = Path(tempfile.mkdtemp(prefix="atelier-pretrained-"))
        with tarfile.open(path / "model.tar.gz") as archive:
            archive.extractall(unpacked, filter="data")
        path = unpacked
    if not (path / "model_index.json").is_file():
        raise ValueError(f"--pretrained {value} is not a diffusers pipeline directory or channel (no model_index.json)")
    return path


def from_pretrained(path: Path) -> Models:
    """The components of a diffusers pipeline saved at `path` (a local directory, never a hub id)."""
    text_encoders = [CLIPTextModel.from_pretrained(path, subfolder="text_encoder")]
    tokenizers = [AutoTokenizer.from_pretrained(path, subfolder="tokenizer")]
    if (path / "text_encoder_2").is_dir():
        text_encoders.append(CLIPTextModelWithProjection.from_pretrained(path, subfolder="text_encoder_2"))
        tokenizers.append(AutoTokenizer.from_pretrained(path, subfolder="tokenizer_2"))
    return Models(
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae"),
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        unet=UNet2DConditionModel.from_pretrained(path, subfolder="unet"),
        # Whatever sampler the pipeline ships with, training adds noise the DDPM way.
        noise_scheduler=DDPMScheduler.from_pretrained(path, subfolder="scheduler"),
    )


def tokenize(tokenizer, captions: list[str], device: torch.device) -> torch.Tensor:
    return tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt",
    ).input_ids.to(device)


def caption_ids(models: Models, captions: list[str]) -> torch.Tensor:
    """The captions' token ids, [captions, text encoders, max length] (int64, CPU): what latent shards store."""
    return torch.stack([tokenize(tokenizer, captions, torch.device("cpu")) for tokenizer in models.tokenizers], dim=1)


@torch.no_grad()
def encode_captions(models: Models, captions: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the UNet's context, SDXL's pooled text embedding or None), as the diffusers pipelines compute them."""
    return encode_token_ids(models, caption_ids(models, captions), device)


@torch.no_grad()
def encode_token_ids(models: Models, input_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """encode_captions from token ids [captions, text encoders, max length] (a latent batch's `input_ids`)."""
    input_ids = input_ids.to(device, non_blocking=True)
    if not models.sdxl:
        return models.text_encoders[0](input_ids[:, 0])[0], None
    hidden_states, pooled = [], None
    for number, encoder in enumerate(models.text_encoders):
        output = encoder(input_ids[:, number], output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])  # SDXL conditions on the penultimate layer
        pooled = output[0]  # the last encoder's projected text embedding
    return torch.cat(hidden_states, dim=-1), pooled


def build_pipeline(models: Models, unet: UNet2DConditionModel) -> DiffusionPipeline:
    """The given UNet with the frozen parts as the family's pipeline, ready to save or sample."""
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
