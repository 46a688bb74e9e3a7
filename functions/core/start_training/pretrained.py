"""Pretrained parts (PretrainedModelUri): what a base is, how it is named, and what a job got from it.

A base is an s3:// prefix holding a diffusers pipeline or some of its subfolders (`vae/`,
`text_encoder/`, `tokenizer/`, `scheduler/`, `unet/`, `model_index.json` ...), as `atelier base add`
uploads it, or the key of a `model.tar.gz` holding one. Jobs read it as the channel `pretrained`
(core.start_training.job_requests); when it holds no VAE, the lineage's first job is preceded by an autoencoder job
(core.start_training.autoencoder_job). Each job records the base it was claimed with (`describe_base`): its URI and
a digest of what was there, which lineage.json carries beside the model, and the pipeline class its
model_index.json names, so that a LoRA the base cannot take is refused before any job (`lora_refusal`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Literal

from contracts import lora_pipelines
from contracts.messages import Frozen
from contracts.s3_layout import MODEL_ARCHIVE
from core import aws

BASES_PREFIX = "bases/"  # in the models bucket: where `atelier base add` uploads a base
AUTOENCODER_SUFFIX = "-ae"  # `<training job>-ae`, and its checkpoints at checkpoints/<lineage>-ae/
TOKENIZER_SUFFIX = "-tok"  # `<training job>-tok`: the lineage's tokenizer job
TOKENIZER_CONFIG = "tokenizer/tokenizer_config.json"  # a prefix base holds a tokenizer when this is under it
BASE_RECORD = "atelier-base.json"  # written by `atelier base add` beside the base's files
VAE_CONFIG = "vae/config.json"  # a prefix base holds a VAE when this is under it
MODEL_INDEX = "model_index.json"  # a whole pipeline's index: its `_class_name` is the pipeline class
MAX_MODEL_INDEX_BYTES = 2**20  # a model_index.json is about 1 KB; read no more than this of one
# A pipeline's part folders, each recognised by its config file (diffusers' save_pretrained layout).
COMPONENT_CONFIGS = {"vae": "config.json", "text_encoder": "config.json", "tokenizer": "tokenizer_config.json",
                     "text_encoder_2": "config.json", "tokenizer_2": "tokenizer_config.json",
                     "scheduler": "scheduler_config.json", "unet": "config.json"}
# Bucket names as S3 allows them; key segments of characters that need no escaping in an IAM
# resource and hold no wildcard (template.yaml's AllowedPattern for PretrainedModelUri is the same).
_SEGMENT = r"[A-Za-z0-9!_.'()-]+"
URI_PATTERN = re.compile(rf"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9])/"
                         rf"(?P<key>({_SEGMENT}/)*({_SEGMENT}/|{re.escape(MODEL_ARCHIVE)}))")


class BaseMissing(LookupError):
    """PretrainedModelUri names nothing that exists: no job is claimed until it does."""


class PretrainedBase(Frozen):
    """What a job's `pretrained` channel held when the job was claimed."""

    uri: str
    kind: Literal["prefix", "archive"]
    # prefix: sha256 (hex) over its listing, one line "<key after the prefix>\t<size>\t<ETag>" per
    # object, sorted by key; archive: the object's ETag
    digest: str
    size: int  # bytes, all objects together
    objects: int
    has_vae: bool  # a prefix with vae/config.json; an archive is taken to hold one (the trainer checks)
    has_tokenizer: bool = True  # a prefix with tokenizer/tokenizer_config.json; an archive, as for the VAE
    # the `_class_name` of a prefix's model_index.json (e.g. StableDiffusionPipeline); None: no model_index.json,
    # one that names none, or an archive (not opened here: the trainer checks it). Records before it lack it.
    pipeline: str | None = None


def check_uri(uri: str, name: str = "PretrainedModelUri") -> str:
    """`uri` itself when it names a base (a prefix ending in "/" or a model.tar.gz key), else ValueError."""
    match = URI_PATTERN.fullmatch(uri)
    if not match or any(part in {".", ".."} for part in match["key"].split("/")):
        raise ValueError(f"{name}={uri!r} must be an s3:// prefix ending in '/' (a diffusers pipeline or some of its "
                         f"folders) or the s3:// key of a {MODEL_ARCHIVE}, e.g. s3://my-bucket/bases/sd2/; "
                         "key segments of letters, digits and !_.'()- only")
    return uri


def split_uri(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def is_archive(uri: str) -> bool:
    return uri.endswith(f"/{MODEL_ARCHIVE}") or split_uri(uri)[1] == MODEL_ARCHIVE


def listing_digest(objects: list[tuple[str, int, str]]) -> str:
    """sha256 over (key relative to the base, size, ETag without quotes), sorted by key."""
    lines = "".join(f"{key}\t{size}\t{etag}\n" for key, size, etag in sorted(objects))
    return hashlib.sha256(lines.encode()).hexdigest()


def describe_base(uri: str) -> PretrainedBase:
    """The base as it is now (one listing, or one HEAD for an archive); BaseMissing when it is not there."""
    bucket, key = split_uri(uri)
    if is_archive(uri):
        head = aws.head_object(bucket, key)
        if head is None:
            raise BaseMissing(f"PretrainedModelUri {uri}: no such object")
        return PretrainedBase(uri=uri, kind="archive", digest=head["ETag"].strip('"'), size=int(head["ContentLength"]),
                              objects=1, has_vae=True)
    objects = [(item["Key"].removeprefix(key), int(item["Size"]), item["ETag"].strip('"'))
               for item in aws.list_objects(bucket, key) if not item["Key"].endswith("/")]
    if not objects:
        raise BaseMissing(f"PretrainedModelUri {uri}: no objects under it (upload one with `atelier base add DIR`)")
    return PretrainedBase(uri=uri, kind="prefix", digest=listing_digest(objects), size=sum(o[1] for o in objects),
                          objects=len(objects), has_vae=any(o[0] == VAE_CONFIG for o in objects),
                          has_tokenizer=any(o[0] == TOKENIZER_CONFIG for o in objects),
                          pipeline=pipeline_class(bucket, key) if any(o[0] == MODEL_INDEX for o in objects) else None)


def pipeline_class(bucket: str, prefix: str) -> str | None:
    """The `_class_name` model_index.json under `prefix` names (one GET); None when it is gone or names none.
    An unreadable index is not refused here: the trainer, which loads the base, says what is wrong with it."""
    raw = aws.read_prefix_if_exists(bucket, prefix + MODEL_INDEX, MAX_MODEL_INDEX_BYTES)
    try:
        name = json.loads(raw)["_class_name"] if raw is not None else None
    except (ValueError, TypeError, KeyError):  # not JSON (or cut at the cap), not an object, no `_class_name`
        return None
    return name if isinstance(name, str) else None


def lora_refusal(base: PretrainedBase | None, lora_jobs: Sequence[str]) -> str | None:
    """Why the run-plan jobs `lora_jobs` (`train: lora`) cannot train on `base`: a prefix that holds no whole
    pipeline (no model_index.json naming its class: the adapter is served with the base's pipeline, as the
    trainer's lora.check_run also requires), or a pipeline class that cannot load their adapter. None when it
    can, or for an archive, whose class is not known before a job opens it."""
    if not lora_jobs or base is None or base.kind == "archive":
        return None
    if base.pipeline is not None and lora_pipelines.takes_lora(base.pipeline):
        return None
    can, release = lora_pipelines.LORA_PIPELINES, lora_pipelines.DIFFUSERS
    what = (f"holds no whole diffusers pipeline ({MODEL_INDEX} naming its class), which a LoRA adapts and is "
            "served with" if base.pipeline is None else f"is a {base.pipeline}, which cannot load its LoRA weights")
    return (f"LoraUnsupported: run-plan job {lora_jobs[0]!r} trains a LoRA (train: lora), and PretrainedModelUri "
            f"{base.uri} {what} (diffusers {release}: {', '.join(can[:-1])} and {can[-1]} can). Train it with "
            "train: full (`atelier recipe set`), or set PretrainedModelUri to a base whose pipeline can; then "
            "`atelier lineage resume`")
