"""What the core.start_training unit tests share: shards and manifests made here, the settings of one stage and of two."""

from __future__ import annotations

import dataclasses
import re

from contracts.messages import Manifest, ShardRef, ShardSealed
from core.start_training.run_plan import PlannedJob
from core.start_training.settings import TrainingSettings

DATA = "atelier-data-123456789012-us-east-1"
MODELS = "atelier-models-123456789012-us-east-1"
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's TrainingJobName pattern
MANIFEST_URI = f"s3://{DATA}/manifests/atelier-0123456789abcdef0123.manifest"
DIGEST = "ab" * 32
BASE_HPS = {"steps": "100", "batch-size": "32", "resolution": "256", "seed": "0"}


def shard(n: int, sealed_at: str | None = None) -> ShardSealed:
    shard_id = f"shard-{n:032x}"
    return ShardSealed(shard_id=shard_id, bucket=DATA, key=f"shards/{shard_id}.tar", sha256=f"{n:064x}",
                       size=10240 * n, samples=n, partners=["partner-a"],
                       sealed_at=sealed_at or f"2026-11-29T12:{n:02d}:00+00:00")


def ref(n: int, sealed_at: str | None = None, role: str = "new") -> ShardRef:
    s = shard(n, sealed_at)
    return ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples, partners=("partner-a",),
                    role=role)


def manifest_of(*refs: ShardRef, sequence: int = 1, lineage: str = "main") -> Manifest:
    return Manifest(bucket=DATA, prefix="shards/", shards=tuple(refs), lineage=lineage, sequence=sequence)


SETTINGS = TrainingSettings(
    table="atelier-PipelineTable", data_bucket=DATA, models_bucket=MODELS, quota=2,
    role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
    volume_gb=200, max_runtime_s=432000, max_retries=3, lineage="main", concurrency="queue", replay_share=0.0,
    keep_alive_s=0, subnets=(), security_groups=(), kms_key="",
    run_plan=(PlannedJob("main", "ml.p5.48xlarge", 2, BASE_HPS),), use="commercial",
    max_consecutive_failures=3, failure_backoff_s=600, gpus_per_instance=0,
)


# A BRIA-like run plan: 256 px on 4 instances, then 512 px on 8, each with its own steps.
TWO_STAGES = dataclasses.replace(SETTINGS, run_plan=(
    PlannedJob("256", "ml.p5.48xlarge", 4, {**BASE_HPS, "steps": "50000"}),
    PlannedJob("512", "ml.p4d.24xlarge", 8, {**BASE_HPS, "steps": "30000", "resolution": "512"}),
))


def with_replay(share: float) -> TrainingSettings:
    return dataclasses.replace(SETTINGS, replay_share=share)
