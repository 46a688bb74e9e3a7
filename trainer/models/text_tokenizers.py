"""The tokenizers a preset's text encoders need, as the pipeline's subfolders (`tokenizer/`,
`tokenizer_2/`, `tokenizer_3/`): loaded from a folder that holds them (the `tokenizer` channel, a
tokenizer job's model.tar.gz: trainer/jobs/tokenizer.py) or learned from captions (trainer/models/tokenizer.py).

A base (`--pretrained`) that brings its text encoders brings their tokenizers too, and then none of
this runs. Encoders that share a kind share one tokenizer (SDXL's and SD3's two CLIPs): it is learned
once and saved in each folder. The vocabulary ceiling is the preset's text encoder `vocab_size` when it
gives one, else the kind's usual size (CLIP 49,408, T5 32,000); the context length is the CLIP
encoder's `max_position_embeddings` (77) or the family's T5 sequence length.
"""

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from transformers import AutoTokenizer, T5EncoderModel

from trainer.models import families
from trainer.models.tokenizer import (CLIP_VOCAB_SIZE, MODEL_MAX_LENGTH, T5_VOCAB_SIZE, caption_figures, learn_clip,
                                      learn_t5)

REPORT = "tokenization.json"  # what a tokenizer job (or a run that learned its own) measured
UNET_TEXT_PARTS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


class TokenizerMissing(ValueError):
    """A tokenizer folder (the `tokenizer` channel) lacks a tokenizer the preset's text encoders need."""


def needed(preset: dict) -> dict[str, tuple[str, int, int]]:
    """{tokenizer subfolder: (kind, vocabulary ceiling, context length)} for the preset's text encoders."""
    family = preset.get("family", "unet")
    if family == "unet":
        parts = [(folder, "clip", preset[key]) for key, folder in UNET_TEXT_PARTS if key in preset]
        max_length = 0
    else:
        named = families.family_named(family)
        configs = preset.get("text_encoders", {})
        parts = [(part.tokenizer, "t5" if part.encoder_class is T5EncoderModel else "clip", configs[part.role])
                 for part in named.text_parts if part.role in configs]
        max_length = named.max_length
    return {folder: (kind, int(config.get("vocab_size") or (T5_VOCAB_SIZE if kind == "t5" else CLIP_VOCAB_SIZE)),
                     max_length if kind == "t5" else int(config.get("max_position_embeddings", MODEL_MAX_LENGTH)))
            for folder, kind, config in parts}


def learn(preset: dict, captions: list[str]) -> dict:
    """{subfolder: tokenizer} learned from `captions` (each distinct kind, ceiling and length once)."""
    learned: dict[tuple[str, int, int], object] = {}
    for spec in needed(preset).values():
        if spec not in learned:
            kind, vocab_size, max_length = spec
            learned[spec] = (learn_t5(captions, max_length, vocab_size) if kind == "t5"
                             else learn_clip(captions, vocab_size))
            learned[spec].model_max_length = max_length
    return {folder: learned[spec] for folder, spec in needed(preset).items()}


def load(folder: Path, preset: dict) -> dict:
    """{subfolder: tokenizer} from `folder`, which must hold every subfolder the preset needs."""
    missing = [name for name in needed(preset) if not (folder / name / "tokenizer_config.json").is_file()]
    if missing:
        raise TokenizerMissing(f"the tokenizer folder {folder} has no {', '.join(missing)}/, which this preset's text "
                               "encoders need")
    return {name: AutoTokenizer.from_pretrained(folder, subfolder=name) for name in needed(preset)}


def resolve(preset: dict, folder: Path | None, captions: Callable[[], Iterable[str]] | None) -> tuple[dict, dict]:
    """({subfolder: tokenizer}, what the run's record says of them): from `folder` when given, else learned
    from `captions()` (no captions: byte- or character-level tokenizers, which tests build)."""
    if folder is not None:
        tokenizers = load(folder, preset)
        report = json.loads((folder / REPORT).read_text()) if (folder / REPORT).is_file() else {}
        return tokenizers, {**report, "source": "tokenizer channel"}  # its figures: the tokenizer job's captions
    texts = list(captions()) if captions else []
    tokenizers = learn(preset, texts)
    return tokenizers, {"source": "learned from the training captions" if captions else "no captions (bytes)",
                        **figures(tokenizers, texts)}


def figures(tokenizers: dict, captions: list[str]) -> dict:
    """{subfolder: caption_figures} for each tokenizer over `captions`."""
    return {"tokenizers": {name: caption_figures(tokenizer, captions) for name, tokenizer in tokenizers.items()}}


def save(tokenizers: dict, model_dir: Path, report: dict | None = None) -> None:
    """Each tokenizer in its pipeline subfolder of `model_dir`, and `report` as tokenization.json."""
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(model_dir / name)
    if report is not None:
        (model_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
