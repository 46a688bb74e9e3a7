"""What the provenance tests share: shards packed by the real packer, manifests built by the start-training
stage, and what the trainer then reads, on one stack emptied before each test."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import random
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest
from PIL import Image

from atelier.local import recipe as local_recipe
from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import Manifest, Sample
from core import aws
from core.pack.packer import pack_samples, seal_due
from core.partners.licensing import Partner, Terms, put_partner
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_shard_sealed
from tests.functions.pack_helpers import sealed_record, settings_for
from tests.support import TEST_RECIPE
from trainer.data.loader import StepBatches, make_loader
from trainer.data.plan import BatchPlan
from trainer.data.shards import index_shards, load_exclusions
from trainer.data.phases import RunPlan

TAKEDOWN_AT = "2026-12-01T10:00:00+00:00"


@pytest.fixture(scope="module")
def stack(module_stack: Provisioned) -> Provisioned:
    """conftest's `module_stack`: provisioned once here; `clean` empties the table and the buckets
    before each test."""
    return module_stack


@pytest.fixture(autouse=True)
def clean(stack: Provisioned) -> None:
    """The pipeline table and the buckets as the template leaves them: empty."""
    dynamodb, s3 = boto3.client("dynamodb"), boto3.client("s3")
    for page in dynamodb.get_paginator("scan").paginate(TableName=stack.outputs["PipelineTableName"],
                                                        ProjectionExpression="pk"):
        for item in page["Items"]:
            dynamodb.delete_item(TableName=stack.outputs["PipelineTableName"], Key=item)
    for bucket in (stack.outputs[n] for n in ("UploadsBucketName", "DataBucketName", "ModelsBucketName")):
        for page in s3.get_paginator("list_object_versions").paginate(Bucket=bucket):
            for version in page.get("Versions", []) + page.get("DeleteMarkers", []):
                s3.delete_object(Bucket=bucket, Key=version["Key"], VersionId=version["VersionId"])
    local_recipe.set_local(stack.outputs, TEST_RECIPE)  # the stack's recipe, as the `stack` fixture set it


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto enforces S3's 5 MiB smallest part; these shards are kilobytes (settings_for matches)."""
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """CreateTrainingJob requests by job name (SageMaker itself is not needed here)."""
    sent: dict[str, dict[str, Any]] = {}
    monkeypatch.setattr(aws, "create_training_job", lambda request: bool(sent.setdefault(request["TrainingJobName"], request)))
    return sent


@pytest.fixture
def configure(stack: Provisioned, function_env: Callable[[str], dict[str, str]], requests: dict,
              monkeypatch: pytest.MonkeyPatch) -> Callable[..., TrainingSettings]:
    """StartTrainingFunction's settings from the template (quota 2, no replay), partners registered."""
    function_env("StartTrainingFunction")
    monkeypatch.setenv("TRAINING_REPLAY_SHARE", "0")
    table = stack.outputs["PipelineTableName"]
    put_partner(table, Partner(partner_id="partner-a", licenses=("CC-BY-4.0",)))
    put_partner(table, Partner(partner_id="partner-b", licenses=("CC-BY-4.0", "b-research"),
                               rules=(Terms(license="b-research", uses=("research",)),)))
    put_partner(table, Partner(partner_id="partner-c", licenses=("CC-BY-4.0",), rules=(Terms(not_after="2020-01-31"),)))

    def apply(recipe: dict[str, dict[str, Any]] | None = None, **variables: str) -> TrainingSettings:
        """With the environment's `variables` changed, and the recipe's fields in `recipe` (TEST_RECIPE's otherwise)."""
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        if recipe is not None:
            local_recipe.set_local(stack.outputs, local_recipe.combined(TEST_RECIPE, recipe))
        return TrainingSettings.current()
    return apply


@pytest.fixture
def settings(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure()


def picture(stack: Provisioned, n: int, partner: str = "partner-a", license: str = "CC-BY-4.0") -> Sample:
    """An accepted upload (a real 48 px JPEG) and its record, as ingest leaves them."""
    buffer = io.BytesIO()
    Image.frombytes("RGB", (48, 48), random.Random(n).randbytes(48 * 48 * 3)).save(buffer, format="JPEG")
    image, bucket, key = buffer.getvalue(), stack.outputs["UploadsBucketName"], f"{partner}/batch/{n:03d}.jpg"
    version = boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=image).get("VersionId", "")
    sha = hashlib.sha256(image).hexdigest()
    sample = Sample(sha256=sha, partner=partner, bucket=bucket, key=key, version_id=version, format="jpeg", width=48,
                    height=48, size=len(image), caption=f"picture {n}", license=license,
                    uploaded_at="2026-11-29T12:00:00.000Z", aspect_bucket="1:1", content_bucket=bucket, content_key=key,
                    content_sha256=sha)
    aws.put_item(stack.outputs["PipelineTableName"], pipeline_table.sample_item(sample))
    return sample


def pack(stack: Provisioned, samples: list[Sample]) -> str:
    """One shard of exactly these samples, sealed by the packer; its id."""
    settings = settings_for(stack)
    pack_samples([(f"m-{s.sha256[:8]}", s) for s in samples], settings)
    sealed = seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    assert len(sealed) == 1
    return sealed[0].shard_id


def seal(stack: Provisioned, settings: TrainingSettings, *shard_ids: str) -> str | None:
    """The Shard Sealed events of these shards reach the start-training stage; the last decision's job."""
    decisions = [on_shard_sealed(sealed_record(settings_for(stack), shard_id), settings) for shard_id in shard_ids]
    return decisions[-1].job_name


def manifest(settings: TrainingSettings, job: str) -> Manifest:
    return Manifest.model_validate_json(aws.read_object(settings.data_bucket, f"manifests/{job}.json"))


def pictures(stack: Provisioned, numbers: range, partner: str = "partner-a", license: str = "CC-BY-4.0") -> list[Sample]:
    return [picture(stack, n, partner, license) for n in numbers]


def channel_as_sagemaker_lays_it_out(settings: TrainingSettings, request: dict[str, Any], root: Path) -> dict[str, Path]:
    """Each channel of a CreateTrainingJob request downloaded under root/<channel>/ (one instance)."""
    dirs = {}
    for channel in request["InputDataConfig"]:
        source = channel["DataSource"]["S3DataSource"]
        bucket, key = source["S3Uri"].removeprefix("s3://").split("/", 1)
        target = dirs.setdefault(channel["ChannelName"], root / channel["ChannelName"])
        target.mkdir(parents=True)
        if source["S3DataType"] == "ManifestFile":  # its prefix may be in another bucket (latent shards)
            prefix, *relative = json.loads(aws.read_object(bucket, key))
            prefix_bucket, prefix_key = prefix["prefix"].removeprefix("s3://").split("/", 1)
            for name in relative:
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                (target / name).write_bytes(aws.read_object(prefix_bucket, prefix_key + name))
        else:
            (target / key.rsplit("/", 1)[1]).write_bytes(aws.read_object(bucket, key))
    return dirs


def drawn_keys(train_dir: Path, manifest_dir: Path | None, steps: int = 12) -> tuple[set[str], int]:
    """Every sample key the trainer's loader yields over `steps` batches of 2, and how many it excluded."""
    index = index_shards(train_dir, exclude=load_exclusions(manifest_dir))
    plan = RunPlan([{"resolution": 32, "batch_size": 2, "learning_rate": 1e-4, "steps": steps}])
    batches = StepBatches(index, BatchPlan(index.aspect, plan, 0, 0, 1, 8, True), 1, steps, 0.0, False)
    return {key for batch in make_loader(batches, 0) for key in batch["key"]}, index.excluded
