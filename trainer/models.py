"""The models a latent-diffusion run needs: from a preset in `configs/` or a local diffusers pipeline.

Only the UNet trains. The VAE and text encoder are frozen: they map images to latents and captions
to embeddings, and training them too would move the target under the UNet.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerBase

from trainer.tokenizer import build_tokenizer

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


@dataclass
class Models:
    vae: AutoencoderKL
    text_encoder: CLIPTextModel
    tokenizer: PreTrainedTokenizerBase
    unet: UNet2DConditionModel
    noise_scheduler: DDPMScheduler


def load_models(model_config: str, pretrained: str | None, seed: int) -> Models:
    """A pretrained pipeline directory when given, else a preset built from scratch with `seed`."""
    models = from_pretrained(Path(pretrained)) if pretrained else from_preset(model_config, seed)
    for frozen in (models.vae, models.text_encoder):
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
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    text_config = CLIPTextConfig(
        **preset["text_encoder"],
        vocab_size=len(tokenizer),  # the vocabulary is the tokenizer's, never the preset's
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return Models(
        vae=AutoencoderKL(**preset["vae"]),
        text_encoder=CLIPTextModel(text_config),
        tokenizer=tokenizer,
        unet=UNet2DConditionModel(**preset["unet"]),
        noise_scheduler=DDPMScheduler(**preset["scheduler"]),
    )


def from_pretrained(path: Path) -> Models:
    """The components of a diffusers pipeline saved at `path` (a local directory, never a hub id)."""
    if not (path / "model_index.json").is_file():
        raise ValueError(f"--pretrained {path} is not a diffusers pipeline directory (no model_index.json)")
    return Models(
        vae=AutoencoderKL.from_pretrained(path, subfolder="vae"),
        text_encoder=CLIPTextModel.from_pretrained(path, subfolder="text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(path, subfolder="tokenizer"),
        unet=UNet2DConditionModel.from_pretrained(path, subfolder="unet"),
        # Whatever sampler the pipeline ships with, training adds noise the DDPM way.
        noise_scheduler=DDPMScheduler.from_pretrained(path, subfolder="scheduler"),
    )
