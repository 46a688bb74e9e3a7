"""Captions as token ids (what latent shards store) and as the UNet's context, as the diffusers pipelines
compute them: SD-1/2 the text encoder's last hidden state; SDXL both encoders' penultimate ones,
concatenated, and the second's pooled projection (trainer/models/bundle.py).
"""

import torch

from trainer.models.bundle import CPU, Models

def tokenize(tokenizer, captions: list[str], device: torch.device) -> torch.Tensor:
    return tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt",
    ).input_ids.to(device)


def caption_ids(models: Models, captions: list[str]) -> torch.Tensor:
    """The captions' token ids, [captions, text encoders, max length] (int64, CPU): what latent shards store."""
    return token_ids(models.tokenizers, captions)


def token_ids(tokenizers: list, captions: list[str]) -> torch.Tensor:
    """caption_ids from the tokenizers alone, which a DataLoader worker can hold without the models."""
    return torch.stack([tokenize(tokenizer, captions, CPU) for tokenizer in tokenizers], dim=1)


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
