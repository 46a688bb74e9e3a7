"""A run-plan job's encode job: its latent shards, and the ManifestFile that lists them for the training job.

With EncodeInstanceType set, each run-plan job's training job waits for `<job>-enc` (the training image with
task=encode, trainer/jobs/encode.py), which writes the manifest's shards as latent shards under
`s3://<models>/encoded/<job>/latents/<encoder identity>-r<res>/` through its CheckpointConfig, each with
its sample table in `indexes/` below that folder. On its Completed event `write_latent_manifest` checks
that every shard has its twin and lists them, and their tables; core.start_training.starter sequences these steps.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table, s3_layout
from contracts.messages import Manifest
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.job_requests import encode_job_name, encode_job_request

logger = Logger(child=True)
ROLE = "encode"  # the job record's role


class EncodeIncomplete(ValueError):
    """The encode job's output does not hold exactly one latent shard per shard of the manifest."""


def latent_manifest_file(manifest: Manifest, bucket: str, prefix: str, keys: list[str]) -> list[Any]:
    """A ManifestFile of the latent twins of the manifest's shards, from the keys found under
    `<prefix>latents/`: one encoding directory, and every shard's twin in it (a twin holds fewer
    samples than its shard where the manifest excludes some: only its presence is checked)."""
    relative = [s.key.removeprefix(manifest.prefix) for s in manifest.shards]
    latents = f"{prefix}{s3_layout.LATENTS}"
    found: dict[str, set[str]] = {}
    for key in keys:
        encoding, _, path = key.removeprefix(latents).partition("/")
        if path.endswith(".tar") and not path.rsplit("/", 1)[-1].startswith("."):  # not a .tmp- part
            found.setdefault(encoding, set()).add(path)
    if len(found) != 1:
        raise EncodeIncomplete(f"expected one encoding under {s3_layout.uri(bucket, latents)}, found "
                               f"{len(found)} ({', '.join(sorted(found)) or 'none'})")
    [(encoding, paths)] = found.items()
    missing = [path for path in relative if path not in paths]
    if missing:
        raise EncodeIncomplete(f"{len(missing)} of {len(relative)} shards have no latent shard under "
                               f"{s3_layout.uri(bucket, latents)}{encoding}/ (first: {missing[0]})")
    return [{"prefix": f"{s3_layout.uri(bucket, latents)}{encoding}/"}, *relative]


def latent_indexes_file(listing: list[Any], bucket: str, keys: list[str]) -> list[Any] | None:
    """The ManifestFile of the sample tables of a latent ManifestFile's shards, those the encode job
    uploaded (a twin without one is indexed by walking it); None without any."""
    folder = f"{listing[0]['prefix']}{s3_layout.INDEXES}"
    present = {key.removeprefix(folder.removeprefix(s3_layout.uri(bucket, ""))) for key in keys}
    tables = [f"{path.rsplit('/', 1)[-1].removesuffix('.tar')}{s3_layout.INDEX_TABLE}" for path in listing[1:]]
    tables = [table for table in tables if table in present]
    return [{"prefix": folder}, *tables] if tables else None


def write_latent_manifest(training_job: str, settings: TrainingSettings) -> tuple[str, str]:
    """`manifests/<job>.latents.manifest` from what the encode job uploaded, and the ManifestFile of its
    shards' sample tables; their URIs (the second "" without tables)."""
    record = aws.get_item(settings.table, pipeline_table.job_pk(training_job)) or {}
    base = record.get("base", training_job)
    manifest = Manifest.model_validate_json(aws.read_object(settings.data_bucket, s3_layout.manifest_key(base)))
    prefix = s3_layout.encoded_prefix(training_job)
    keys = [item["Key"] for item in aws.list_objects(settings.models_bucket, f"{prefix}{s3_layout.LATENTS}")]
    listing = latent_manifest_file(manifest, settings.models_bucket, prefix, keys)
    uris = []
    for suffix, content in ((s3_layout.LATENTS_MANIFEST, listing),
                            (s3_layout.LATENT_INDEXES_MANIFEST, latent_indexes_file(listing, settings.models_bucket, keys))):
        key = s3_layout.manifest_key(training_job, suffix)
        if content is not None:
            aws.write_object(settings.data_bucket, key, json.dumps(content).encode(), "application/json")
        uris.append(s3_layout.uri(settings.data_bucket, key) if content is not None else "")
    return uris[0], uris[1]


def start(training_job: str, job: dict[str, Any], manifest_uri: str, exclusions_uri: str, pretrained_uri: str,
          vae_uri: str, settings: TrainingSettings, indexes_uri: str = "", tokenizer_uri: str = "") -> bool:
    """Record and create the training job's encode job; False when one of its name exists."""
    name = encode_job_name(training_job)
    aws.put_item_if_absent(settings.table, {
        "pk": pipeline_table.job_pk(name), "kind": "job", "role": ROLE, "for_job": training_job, "status": "Requested",
        "lineage": settings.lineage, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    plan_index = int(job.get("stage", 0))
    if aws.create_training_job(encode_job_request(training_job, manifest_uri, job["digest"], plan_index, settings,
                                                  exclusions_uri, pretrained_uri=pretrained_uri, vae_uri=vae_uri,
                                                  indexes_uri=indexes_uri, tokenizer_uri=tokenizer_uri)):
        logger.info("encode job started", extra={"job": name, "planned_job": settings.run_plan[plan_index].name})
        return True
    return False
