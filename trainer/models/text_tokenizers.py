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


def needed(preset: dict) -> dict[str, tuple[str, int, int, bool]]:
    """{tokenizer subfolder: (kind, vocabulary ceiling, context length, whether the pipeline lowercases the
    prompt before this tokenizer)} for the preset's text encoders."""
    family = preset.get("family", "unet")
    if family == "unet":
        parts = [(folder, "clip", preset[key]) for key, folder in UNET_TEXT_PARTS if key in preset]
        max_length, lowercase = 0, False
    else:
        named = families.family_named(family)
        configs = preset.get("text_encoders", {})
        parts = [(part.tokenizer, "t5" if part.encoder_class is T5EncoderModel else "clip", configs[part.role])
                 for part in named.text_parts if part.role in configs]
        max_length, lowercase = named.max_length, named.lowercases_prompts
    return {folder: (kind, int(config.get("vocab_size") or (T5_VOCAB_SIZE if kind == "t5" else CLIP_VOCAB_SIZE)),
                     max_length if kind == "t5" else int(config.get("max_position_embeddings", MODEL_MAX_LENGTH)),
                     lowercase and kind == "t5")  # CLIP's tokenizer lowercases by itself
            for folder, kind, config in parts}


def as_seen(captions: list[str], lowercase: bool) -> list[str]:
    """The captions as the pipeline hands them to a tokenizer: lowercased and stripped where it does so."""
    return [caption.lower().strip() for caption in captions] if lowercase else captions


def learn(preset: dict, captions: list[str]) -> dict:
    """{subfolder: tokenizer} learned from `captions` as each tokenizer will see them (each distinct kind,
    ceiling, length and case once)."""
    learned: dict[tuple[str, int, int, bool], object] = {}
    for spec in needed(preset).values():
        if spec not in learned:
            kind, vocab_size, max_length, lowercase = spec
            texts = as_seen(captions, lowercase)
            learned[spec] = (learn_t5(texts, max_length, vocab_size) if kind == "t5" else learn_clip(texts, vocab_size))
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
                        **figures(tokenizers, texts, preset)}


def figures(tokenizers: dict, captions: list[str], preset: dict) -> dict:
    """{subfolder: caption_figures} for each tokenizer over `captions`, as the pipeline hands them to it."""
    lowercase = {folder: spec[3] for folder, spec in needed(preset).items()}
    return {"tokenizers": {name: caption_figures(tokenizer, as_seen(captions, lowercase.get(name, False)))
                           for name, tokenizer in tokenizers.items()}}


def save(tokenizers: dict, model_dir: Path, report: dict | None = None) -> None:
    """Each tokenizer in its pipeline subfolder of `model_dir`, and `report` as tokenization.json."""
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(model_dir / name)
    if report is not None:
        (model_dir / REPORT).write_text(json.dumps(report, indent=2) + "\n")
