"""Start-training stage: count sealed shards; at the quota, start one job on exactly those shards.

Concurrency: shards are claimed for a manifest in one DynamoDB transaction whose conditions
require each shard still pending, so two invocations can never start two jobs on one shard.
The job name is derived from the manifest, so `CreateTrainingJob` itself is idempotent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from aws_lambda_powertools import Logger

from core import aws, records
from core.models import Manifest, ShardRef, ShardSealed
from core.settings import TrainingSettings

logger = Logger(child=True)
MANIFEST_PREFIX = "manifests/"
CHANNEL = "train"
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"


@dataclass(frozen=True)
class Decision:
    action: str  # "waiting" | "started" | "already-claimed"
    job_name: str | None = None
    pending: int = 0


# --- pure ---------------------------------------------------------------------------------------

def job_name_for(manifest: Manifest) -> str:
    """At most 63 characters of [a-zA-Z0-9-], unique per manifest."""
    return f"atelier-{manifest.digest[:20]}"


def manifest_from(pending: list[ShardSealed], quota: int, bucket: str) -> Manifest | None:
    """The oldest `quota` pending shards, or None below the quota."""
    if len(pending) < quota:
        return None
    chosen = sorted(pending, key=lambda s: (s.sealed_at, s.shard_id))[:quota]
    return Manifest(bucket=bucket, prefix="shards/", shards=tuple(
        ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples) for s in chosen))


def manifest_file(manifest: Manifest) -> list[Any]:
    """A SageMaker ManifestFile: a prefix, then keys relative to it."""
    relative = [s.key.removeprefix(manifest.prefix) for s in manifest.shards]
    return [{"prefix": f"s3://{manifest.bucket}/{manifest.prefix}"}, *relative]


def training_job_request(name: str, manifest_uri: str, settings: TrainingSettings) -> dict[str, Any]:
    return {
        "TrainingJobName": name,
        "RoleArn": settings.role_arn,
        "AlgorithmSpecification": {"TrainingImage": settings.image_uri, "TrainingInputMode": "FastFile"},
        "HyperParameters": dict(settings.hyperparameters),
        "InputDataConfig": [{
            "ChannelName": CHANNEL,
            "InputMode": "FastFile",
            "ContentType": "application/x-tar",
            "DataSource": {"S3DataSource": {
                "S3DataType": "ManifestFile", "S3Uri": manifest_uri,
                "S3DataDistributionType": "ShardedByS3Key",
            }},
        }],
        "OutputDataConfig": {"S3OutputPath": f"s3://{settings.models_bucket}/training/"},
        "ResourceConfig": {"InstanceType": settings.instance_type, "InstanceCount": settings.instance_count,
                           "VolumeSizeInGB": settings.volume_gb},
        "StoppingCondition": {"MaxRuntimeInSeconds": settings.max_runtime_s},
        # Per job, grouped by lineage: a retried job resumes its own steps. How a follow-up job
        # continues a lineage (from the last model, with more steps) is the training-jobs issue's.
        "CheckpointConfig": {"S3Uri": f"s3://{settings.models_bucket}/checkpoints/{settings.lineage}/{name}/",
                             "LocalPath": CHECKPOINT_LOCAL_PATH},
        "RetryStrategy": {"MaximumRetryAttempts": settings.max_retries},
        "EnableNetworkIsolation": True,
        "EnableInterContainerTrafficEncryption": True,
        "Tags": [{"Key": "atelier:manifest", "Value": name}],
    }


# --- orchestration ------------------------------------------------------------------------------

def on_shard_sealed(shard: ShardSealed, settings: TrainingSettings) -> Decision:
    if not aws.put_item_if_absent(settings.table, records.shard_item(shard)):
        item = aws.get_item(settings.table, records.shard_pk(shard.shard_id)) or {}
        if item.get("status") == "claimed":
            # A redelivery after the claim: make sure the claimed job really started.
            _ensure_started(item["manifest_job"], settings)
            return Decision("already-claimed", item["manifest_job"])
    pending = [ShardSealed.model_validate_json(i["record"])
               for i in aws.query_index(settings.table, records.PENDING_INDEX, records.PENDING_SHARDS)]
    manifest = manifest_from(pending, settings.quota, settings.data_bucket)
    if manifest is None:
        return Decision("waiting", pending=len(pending))
    name = job_name_for(manifest)
    if not _claim(manifest, name, settings):
        return Decision("already-claimed", pending=len(pending))
    _ensure_started(name, settings)
    return Decision("started", name, pending=len(pending))


def _claim(manifest: Manifest, name: str, settings: TrainingSettings) -> bool:
    """Write the manifest (deterministic content), then claim its shards in one transaction."""
    rich_key = f"{MANIFEST_PREFIX}{name}.json"
    aws.write_object(settings.data_bucket, rich_key, manifest.model_dump_json(indent=1).encode(), "application/json")
    aws.write_object(settings.data_bucket, f"{MANIFEST_PREFIX}{name}.manifest",
                     json.dumps(manifest_file(manifest)).encode(), "application/json")
    updates = [(records.shard_pk(s.shard_id), "SET #s = :claimed, manifest_job = :job REMOVE gsi1pk",
                "#s = :pending", {":claimed": "claimed", ":job": name, ":pending": "pending"})
               for s in manifest.shards]
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    job = records.job_item(name, rich_key, [s.shard_id for s in manifest.shards], now)
    return aws.transact_updates(settings.table, updates, [job], names={"#s": "status"})


def _ensure_started(name: str, settings: TrainingSettings) -> None:
    manifest_uri = f"s3://{settings.data_bucket}/{MANIFEST_PREFIX}{name}.manifest"
    started = aws.create_training_job(training_job_request(name, manifest_uri, settings))
    logger.info("training job started" if started else "training job already exists", extra={"job": name})
