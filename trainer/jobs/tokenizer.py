"""The tokenizer job: learn the tokenizers a preset's text encoders need from the captions of the job's
image shards, for lineages whose base brings none; the encode and training jobs after it read them as
their `--tokenizer`.

Runbook
-------
One process, CPU only (the `tokenizers` library's learners are Rust and take seconds per million captions):

    python -m trainer.jobs.tokenizer --train-dir shards/ --model-dir out/tokenizer --model-config tiny-sd3

SageMaker: a training job with the training image and the hyperparameter `task=tokenizer` (channels:
`train`, the manifest's image shards; `indexes`, their sample tables; `manifest`, the exclusion list,
when there is one: an excluded sample's caption is never read). `/opt/ml/model` becomes the job's
`model.tar.gz`: the pipeline's tokenizer subfolders (`tokenizer/`, `tokenizer_2/`, `tokenizer_3/`, as
the preset's family names them), `tokenization.json` (captions seen, vocabulary size, tokens per
word, the share of captions longer than the context, which truncation cuts) and `report.html`. The
lineage records it as its `tokenizer_uri`, and its later jobs receive it as the channel `tokenizer`.
"""

import argparse
import os
import sys
import time
from pathlib import Path

from contracts.recipe_jobs import TokenizerOptions
from trainer.data.captions import read_captions
from trainer.jobs.hyperparameters import add_options, checked
from trainer.models import text_tokenizers
from trainer.models.loading import read_preset
from trainer.report.write import write_report
from trainer.runtime.health import log


def main(args: argparse.Namespace) -> dict:
    """Read the captions, learn, save the tokenizers and their figures; return the figures."""
    started = time.perf_counter()
    preset = read_preset(args.model_config)
    captions = list(read_captions(args.train_dir, args.manifest, args.index_dir))
    log(0, event="start", task="tokenizer", captions=len(captions), model_config=args.model_config)
    if args.vocab_size:  # one ceiling for every tokenizer of the preset (a test or a small corpus)
        preset = {**preset, **_with_vocab_size(preset, args.vocab_size)}
    tokenizers = text_tokenizers.learn(preset, captions)
    report = {"task": "tokenizer", "model_config": args.model_config, "source": "learned from the job's captions",
              **text_tokenizers.figures(tokenizers, captions, preset), "learn_s": round(time.perf_counter() - started, 2)}
    model_dir = Path(args.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    text_tokenizers.save(tokenizers, model_dir, report)
    health_dir = Path(args.output_data_dir) if args.output_data_dir else model_dir / "health"
    write_report(model_dir, health_dir, job=os.environ.get("TRAINING_JOB_NAME"))
    log(0, event="saved", model_dir=str(model_dir), **{name: figures["tokens_per_word"]
                                                       for name, figures in report["tokenizers"].items()})
    return report


def _with_vocab_size(preset: dict, vocab_size: int) -> dict:
    """The preset's text encoder configs with `vocab_size` (text_tokenizers.needed reads it as the ceiling)."""
    if "text_encoders" in preset:
        return {"text_encoders": {role: {**config, "vocab_size": vocab_size}
                                  for role, config in preset["text_encoders"].items()}}
    return {key: {**preset[key], "vocab_size": vocab_size} for key, _ in text_tokenizers.UNET_TEXT_PARTS if key in preset}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ
    parser = argparse.ArgumentParser(description="Learn a preset's caption tokenizers from image shards.")
    parser.add_argument("--train-dir", default=env.get("SM_CHANNEL_TRAIN"), required="SM_CHANNEL_TRAIN" not in env,
                        help="the image shards (default $SM_CHANNEL_TRAIN)")
    parser.add_argument("--index-dir", default=env.get("SM_CHANNEL_INDEXES"),
                        help="the shards' sample tables (default $SM_CHANNEL_INDEXES, else <train-dir>/indexes)")
    parser.add_argument("--manifest", default=env.get("SM_CHANNEL_MANIFEST"),
                        help="the job's manifest JSON or its channel dir: its `exclude` samples are never read")
    parser.add_argument("--model-dir", default=env.get("SM_MODEL_DIR"), required="SM_MODEL_DIR" not in env,
                        help="where the tokenizer folders go (default $SM_MODEL_DIR)")
    parser.add_argument("--output-data-dir", default=env.get("SM_OUTPUT_DATA_DIR"),
                        help="report.html (default $SM_OUTPUT_DATA_DIR, else <model-dir>/health)")
    # accepted so every job of a lineage takes the same arguments (a tokenizer has no use for it)
    parser.add_argument("--checkpoint-dir", default=None, help=argparse.SUPPRESS)
    add_options(parser, TokenizerOptions)  # the recipe (contracts.recipe_jobs); the paths above are not in it
    return checked(parser, TokenizerOptions, parser.parse_args(argv))


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
