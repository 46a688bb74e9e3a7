"""The shards' sample tables reach every job as its `indexes` channel (a ManifestFile, FastFile, FullyReplicated),
for image shards from the manifest and for latent shards from what the encode job wrote; shards sealed before
tables reach it without one, and a manifest of such shards keeps the digest (the job name) it had."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import boto3
import pytest

from contracts.messages import Manifest, ShardSealed
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.starter import on_shard_sealed
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
    ENCODING,
    FakeSageMaker,
    configure,
    expected_manifest,
    finish,
    job,
    put_latents,
    sagemaker,
    sealed,
    settings,
    sid,
    stack,
    stored_manifest,
)

pytestmark = pytest.mark.slow(seconds=20)


def seal_with_tables(settings: TrainingSettings, *numbers: int, without: tuple[int, ...] = ()) -> str:
    """Shards sealed as the pack stage seals them now, each with its table (but those in `without`); the job name."""
    decisions = [on_shard_sealed(with_table(sealed(settings, n)) if n not in without else sealed(settings, n), settings)
                 for n in numbers]
    return str(decisions[-1].job_name)


def with_table(shard: ShardSealed) -> ShardSealed:
    return shard.model_copy(update={"table_key": f"indexes/{shard.shard_id}.table"})


def channels(request: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {channel["ChannelName"]: channel for channel in request["InputDataConfig"]}


def indexes_channel(uri: str) -> dict[str, Any]:
    return {"ChannelName": "indexes", "InputMode": "FastFile", "ContentType": "application/octet-stream",
            "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile", "S3Uri": uri,
                                            "S3DataDistributionType": "FullyReplicated"}}}


def test_the_training_job_reads_its_shards_tables_as_the_indexes_channel(settings: TrainingSettings,
                                                                         sagemaker: FakeSageMaker) -> None:
    # GIVEN two shards sealed with their tables (the quota is 2)
    name = seal_with_tables(settings, 1, 2)
    # THEN the job (its request checked against botocore's model) reads them beside its shards
    listing = f"manifests/{name}.indexes.manifest"
    request = sagemaker.request(name)
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train", "indexes"]
    assert channels(request)["indexes"] == indexes_channel(f"s3://{settings.data_bucket}/{listing}")
    assert json.loads(aws.read_object(settings.data_bucket, listing)) == [
        {"prefix": f"s3://{settings.data_bucket}/indexes/"}, f"{sid(1)}.table", f"{sid(2)}.table"]
    assert [s.table_key for s in stored_manifest(settings, name).shards] == [f"indexes/{sid(n)}.table" for n in (1, 2)]


def test_a_shard_sealed_before_tables_is_left_out_of_the_listing(settings: TrainingSettings,
                                                                 sagemaker: FakeSageMaker) -> None:
    name = seal_with_tables(settings, 1, 2, without=(1,))
    assert json.loads(aws.read_object(settings.data_bucket, f"manifests/{name}.indexes.manifest")) == [
        {"prefix": f"s3://{settings.data_bucket}/indexes/"}, f"{sid(2)}.table"]


def test_shards_all_sealed_before_tables_give_no_channel_and_the_job_name_they_had(settings: TrainingSettings,
                                                                                   sagemaker: FakeSageMaker) -> None:
    # GIVEN shards sealed before tables (their events have no table_key)
    name = seal_with_tables(settings, 1, 2, without=(1, 2))
    # THEN no `indexes` channel (SageMaker fails a job whose channel lists nothing) and no listing
    assert [c["ChannelName"] for c in sagemaker.request(name)["InputDataConfig"]] == ["train"]
    assert not aws.read_json_if_exists(settings.data_bucket, f"manifests/{name}.indexes.manifest")
    # and the manifest's digest is the one it had before ShardRef.table_key existed
    manifest = expected_manifest(settings, [1, 2])
    fields = manifest.model_dump(mode="json")
    for name_ in ("exclude", "left_out"):
        del fields[name_]
    for shard in fields["shards"]:
        del shard["table_key"]
    assert manifest.digest == hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    tabled = Manifest.model_validate({**manifest.model_dump(), "shards": [
        {**s.model_dump(), "table_key": f"indexes/{s.shard_id}.table"} for s in manifest.shards]})
    assert tabled.digest != manifest.digest


@pytest.fixture
def encoding(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge")


def put_latent_tables(settings: TrainingSettings, job_name: str, *numbers: int) -> None:
    """The sample tables the encode job writes beside its latent shards (trainer/jobs/latent_writer.py)."""
    for n in numbers:
        boto3.client("s3").put_object(Bucket=settings.models_bucket, Body=b"table",
                                      Key=f"encoded/{job_name}/latents/{ENCODING}/indexes/{sid(n)}.table")


def test_the_encode_job_reads_the_image_tables_and_the_training_job_the_latent_ones(encoding: TrainingSettings,
                                                                                   sagemaker: FakeSageMaker) -> None:
    # GIVEN shards sealed with tables, whose encode job wrote a latent twin of each, with a table for one of them
    name = seal_with_tables(encoding, 1, 2)
    assert channels(sagemaker.request(f"{name}-enc"))["indexes"] == indexes_channel(
        f"s3://{encoding.data_bucket}/manifests/{name}.indexes.manifest")
    put_latents(encoding, name, 1, 2)
    put_latent_tables(encoding, name, 1)
    # WHEN the encode job completes
    finish(encoding, f"{name}-enc", "Completed")
    # THEN the training job reads the latent shards and, as its `indexes`, the tables the encode job wrote
    listing = f"manifests/{name}.latents.indexes.manifest"
    assert channels(sagemaker.request(name))["indexes"] == indexes_channel(f"s3://{encoding.data_bucket}/{listing}")
    assert json.loads(aws.read_object(encoding.data_bucket, listing)) == [
        {"prefix": f"s3://{encoding.models_bucket}/encoded/{name}/latents/{ENCODING}/indexes/"}, f"{sid(1)}.table"]
    assert job(encoding, name)["latent_indexes"] == f"s3://{encoding.data_bucket}/{listing}"


def test_latent_shards_without_tables_give_the_training_job_no_channel(encoding: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    name = seal_with_tables(encoding, 1, 2)
    put_latents(encoding, name, 1, 2)  # an encode image from before tables
    finish(encoding, f"{name}-enc", "Completed")
    assert "indexes" not in channels(sagemaker.request(name))
    assert job(encoding, name)["latent_indexes"] == ""
