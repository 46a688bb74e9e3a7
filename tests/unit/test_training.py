"""core.training: choosing shards, naming and requesting jobs, and the start-training stage."""

from __future__ import annotations

import json
import re
from typing import Callable

import boto3
import pytest

from atelier.local.provision import Provisioned
from core import aws, records
from core.models import Manifest, ShardRef, ShardSealed
from core.settings import TrainingSettings
from core.training import (job_name_for, manifest_file, manifest_from, on_shard_sealed,
                           training_job_request)

DATA = "atelier-data-123456789012-us-east-1"
JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's TrainingJobName pattern


def shard(n: int, sealed_at: str | None = None) -> ShardSealed:
    shard_id = f"shard-{n:032x}"
    return ShardSealed(shard_id=shard_id, bucket=DATA, key=f"shards/{shard_id}.tar", sha256=f"{n:064x}",
                       size=10240 * n, samples=n, partners=["partner-a"],
                       sealed_at=sealed_at or f"2026-11-29T12:{n:02d}:00+00:00")


def manifest_of(*shards: ShardSealed, bucket: str = DATA) -> Manifest:
    return Manifest(bucket=bucket, prefix="shards/", shards=tuple(
        ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples) for s in shards))


SETTINGS = TrainingSettings(
    table="atelier-PipelineTable", data_bucket=DATA, models_bucket="atelier-models", quota=2,
    role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole", image_uri="atelier-trainer:latest",
    instance_type="ml.p5.48xlarge", instance_count=2, volume_gb=200, max_runtime_s=432000, max_retries=3,
    lineage="main", hyperparameters={"steps": "100", "batch-size": "32"},
)


# --- manifest_from ------------------------------------------------------------------------------

def test_manifest_from_is_none_below_the_quota() -> None:
    assert manifest_from([shard(1), shard(2)], quota=3, bucket=DATA) is None


def test_manifest_from_is_none_without_shards() -> None:
    assert manifest_from([], quota=1, bucket=DATA) is None


def test_manifest_from_at_the_quota_takes_every_shard() -> None:
    assert manifest_from([shard(2), shard(1)], quota=2, bucket=DATA) == manifest_of(shard(1), shard(2))


def test_manifest_from_takes_the_oldest_shards_by_sealed_at() -> None:
    pending = [shard(5), shard(1), shard(4), shard(2), shard(3)]

    assert manifest_from(pending, quota=3, bucket=DATA) == manifest_of(shard(1), shard(2), shard(3))


def test_manifest_from_breaks_sealed_at_ties_by_shard_id() -> None:
    same_time = "2026-11-29T12:00:00+00:00"
    pending = [shard(3, same_time), shard(9, "2026-11-29T11:00:00+00:00"), shard(1, same_time), shard(2, same_time)]

    assert manifest_from(pending, quota=3, bucket=DATA) == manifest_of(
        shard(9, "2026-11-29T11:00:00+00:00"), shard(1, same_time), shard(2, same_time))


# --- job_name_for -------------------------------------------------------------------------------

def test_job_name_is_a_valid_sagemaker_name() -> None:
    name = job_name_for(manifest_of(shard(1), shard(2)))

    assert len(name) <= 63 and JOB_NAME.match(name)


def test_job_name_is_atelier_and_20_hex_of_the_manifest_digest() -> None:
    manifest = manifest_of(shard(1), shard(2))

    assert job_name_for(manifest) == f"atelier-{manifest.digest[:20]}"


def test_job_name_is_stable_for_the_same_manifest() -> None:
    assert job_name_for(manifest_of(shard(1), shard(2))) == job_name_for(manifest_of(shard(1), shard(2)))


def test_job_name_differs_for_a_different_manifest() -> None:
    assert job_name_for(manifest_of(shard(1), shard(2))) != job_name_for(manifest_of(shard(1), shard(3)))


# --- manifest_file ------------------------------------------------------------------------------

def test_manifest_file_is_a_prefix_then_relative_keys() -> None:
    manifest = manifest_of(shard(1), shard(2))

    assert manifest_file(manifest) == [{"prefix": f"s3://{DATA}/shards/"},
                                       f"{shard(1).shard_id}.tar", f"{shard(2).shard_id}.tar"]


# --- training_job_request -----------------------------------------------------------------------

REQUEST = training_job_request("atelier-0123456789abcdef0123", f"s3://{DATA}/manifests/x.manifest", SETTINGS)


def test_request_streams_its_one_channel_with_fast_file() -> None:
    assert REQUEST["AlgorithmSpecification"] == {"TrainingImage": "atelier-trainer:latest",
                                                 "TrainingInputMode": "FastFile"}
    assert REQUEST["InputDataConfig"] == [{
        "ChannelName": "train", "InputMode": "FastFile", "ContentType": "application/x-tar",
        "DataSource": {"S3DataSource": {"S3DataType": "ManifestFile",
                                        "S3Uri": f"s3://{DATA}/manifests/x.manifest",
                                        "S3DataDistributionType": "ShardedByS3Key"}},
    }]


def test_request_names_the_job() -> None:
    assert REQUEST["TrainingJobName"] == "atelier-0123456789abcdef0123"


def test_request_checkpoints_per_lineage_and_job() -> None:
    assert REQUEST["CheckpointConfig"] == {
        "S3Uri": "s3://atelier-models/checkpoints/main/atelier-0123456789abcdef0123/",
        "LocalPath": "/opt/ml/checkpoints"}


def test_request_writes_models_under_training() -> None:
    assert REQUEST["OutputDataConfig"] == {"S3OutputPath": "s3://atelier-models/training/"}


def test_request_takes_resources_and_limits_from_settings() -> None:
    assert (REQUEST["RoleArn"], REQUEST["ResourceConfig"], REQUEST["StoppingCondition"], REQUEST["RetryStrategy"]) == (
        "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
        {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200},
        {"MaxRuntimeInSeconds": 432000},
        {"MaximumRetryAttempts": 3},
    )


def test_request_isolates_the_network_and_encrypts_between_containers() -> None:
    assert (REQUEST["EnableNetworkIsolation"], REQUEST["EnableInterContainerTrafficEncryption"]) == (True, True)


def test_request_hyperparameters_are_strings() -> None:
    # GIVEN settings parsed from a TRAINING_HYPERPARAMETERS with numbers in it
    settings = TrainingSettings.from_env({
        "PIPELINE_TABLE": "t", "DATA_BUCKET": DATA, "MODELS_BUCKET": "m", "TRAINING_QUOTA": "2",
        "SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/r", "TRAINING_IMAGE_URI": "img",
        "TRAINING_INSTANCE_TYPE": "ml.m5.xlarge", "TRAINING_INSTANCE_COUNT": "1", "TRAINING_VOLUME_GB": "30",
        "TRAINING_MAX_RUNTIME_S": "3600", "TRAINING_MAX_RETRIES": "1", "TRAINING_LINEAGE": "main",
        "TRAINING_HYPERPARAMETERS": json.dumps({"steps": 2, "learning-rate": 0.0005, "model-config": "tiny"}),
    })

    request = training_job_request("atelier-x", "s3://d/manifests/x.manifest", settings)

    assert request["HyperParameters"] == {"steps": "2", "learning-rate": "0.0005", "model-config": "tiny"}


def test_request_hyperparameters_are_a_copy() -> None:
    request = training_job_request("atelier-x", "s3://d/m", SETTINGS)
    request["HyperParameters"]["steps"] = "1"

    assert SETTINGS.hyperparameters["steps"] == "100"


# --- on_shard_sealed, against moto with the template's resources ------------------------------------

@pytest.fixture
def settings(stack: Provisioned, function_env: Callable[[str], dict[str, str]]) -> TrainingSettings:
    function_env("StartTrainingFunction")
    return TrainingSettings.from_env()


def sealed(settings: TrainingSettings, n: int) -> ShardSealed:
    """A shard of the stack's data bucket, sealed n minutes past noon."""
    return shard(n).model_copy(update={"bucket": settings.data_bucket})


def test_quota_of_shards_starts_one_training_job(settings: TrainingSettings) -> None:
    assert settings.quota == 2  # TEST_OVERRIDES

    first = on_shard_sealed(sealed(settings, 1), settings)
    second = on_shard_sealed(sealed(settings, 2), settings)

    name = job_name_for(manifest_of(sealed(settings, 1), sealed(settings, 2), bucket=settings.data_bucket))
    assert (first.action, first.job_name, first.pending) == ("waiting", None, 1)
    assert (second.action, second.job_name) == ("started", name)
    assert [j["TrainingJobName"] for j in boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]] \
        == [name]


def test_redelivered_event_after_the_claim_starts_no_second_job(settings: TrainingSettings) -> None:
    # GIVEN two shards that started a job
    on_shard_sealed(sealed(settings, 1), settings)
    started = on_shard_sealed(sealed(settings, 2), settings)

    # WHEN the second event arrives again
    again = on_shard_sealed(sealed(settings, 2), settings)

    # THEN it names the claimed job and there is still one job
    assert (again.action, again.job_name) == ("already-claimed", started.job_name)
    jobs = boto3.client("sagemaker").list_training_jobs()["TrainingJobSummaries"]
    assert [j["TrainingJobName"] for j in jobs] == [started.job_name]


def test_started_job_reads_a_manifest_of_exactly_the_claimed_shards(settings: TrainingSettings) -> None:
    # GIVEN two shards that started a job
    on_shard_sealed(sealed(settings, 1), settings)
    name = on_shard_sealed(sealed(settings, 2), settings).job_name

    # THEN the job's ManifestFile and the rich manifest list exactly those shards
    s3 = boto3.client("s3")
    manifest_file_body = json.loads(s3.get_object(Bucket=settings.data_bucket, Key=f"manifests/{name}.manifest")["Body"].read())
    rich = Manifest.model_validate_json(s3.get_object(Bucket=settings.data_bucket, Key=f"manifests/{name}.json")["Body"].read())
    assert manifest_file_body == [{"prefix": f"s3://{settings.data_bucket}/shards/"},
                                  f"{shard(1).shard_id}.tar", f"{shard(2).shard_id}.tar"]
    assert [s.key for s in rich.shards] == [shard(1).key, shard(2).key]
    job = boto3.client("sagemaker").describe_training_job(TrainingJobName=name)
    assert job["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3Uri"] \
        == f"s3://{settings.data_bucket}/manifests/{name}.manifest"


def test_claimed_shards_and_the_job_are_recorded(settings: TrainingSettings) -> None:
    on_shard_sealed(sealed(settings, 1), settings)
    name = on_shard_sealed(sealed(settings, 2), settings).job_name

    shard_items = [aws.get_item(settings.table, records.shard_pk(shard(n).shard_id)) for n in (1, 2)]
    job_item = aws.get_item(settings.table, records.job_pk(name))
    assert [(i["status"], i["manifest_job"], "gsi1pk" in i) for i in shard_items] == [("claimed", name, False)] * 2
    assert (job_item["status"], job_item["manifest"], job_item["shards"]) == (
        "Requested", f"manifests/{name}.json", [shard(1).shard_id, shard(2).shard_id])


def test_shard_after_a_claim_waits_for_the_next_quota(settings: TrainingSettings) -> None:
    # GIVEN two shards that started a job
    on_shard_sealed(sealed(settings, 1), settings)
    on_shard_sealed(sealed(settings, 2), settings)

    # WHEN a third shard is sealed
    third = on_shard_sealed(sealed(settings, 3), settings)

    # THEN it waits alone
    assert (third.action, third.job_name, third.pending) == ("waiting", None, 1)

