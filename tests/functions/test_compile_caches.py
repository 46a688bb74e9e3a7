"""Compiled shapes shared across lineages (core.start_training.compile_caches): a training job's end
publishes its lineage's compile-cache files, and the next training job reads them as a channel."""

from __future__ import annotations

from typing import Any

import boto3
import pytest

from contracts import s3_layout
from core.start_training.settings import TrainingSettings
from core.start_training import compile_caches
from tests.functions.training_jobs_helpers import (FakeSageMaker, configure, finish, sagemaker, seal,  # noqa: F401 (fixtures)
                                                   settings, stack)

pytestmark = pytest.mark.slow(seconds=10)
SHAPE = "torch2.11.0-nvidia-h200-unet3d371dad2026-latent-r512-b64-w1.compile-cache"


def put(settings: TrainingSettings, key: str, body: bytes) -> None:
    boto3.client("s3").put_object(Bucket=settings.models_bucket, Key=key, Body=body)


def shared(settings: TrainingSettings) -> dict[str, bytes]:
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=settings.models_bucket, Prefix=s3_layout.COMPILE_CACHE).get("Contents", [])
    return {o["Key"].removeprefix(s3_layout.COMPILE_CACHE): s3.get_object(Bucket=settings.models_bucket, Key=o["Key"])
            ["Body"].read() for o in listed}


def compile_cache_channels(request: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in request["InputDataConfig"] if c["ChannelName"] == compile_caches.CHANNEL]


def lineage_file(name: str) -> str:
    return s3_layout.lineage_compile_cache_prefix("main") + name


@pytest.mark.parametrize("status", ["Completed", "Failed", "Stopped"])
def test_a_job_s_end_shares_its_compiled_shapes_and_the_next_job_reads_them(
        status: str, settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a first job, started while no lineage had compiled anything: no channel (SageMaker would
    # fail a job whose S3Prefix channel is empty)
    first = seal(settings, 1, 2)[1].job_name
    assert compile_cache_channels(sagemaker.request(first)) == []
    # ... whose compile left a file in the lineage's checkpoints, and one still being written
    put(settings, lineage_file(SHAPE), b"compiled")
    put(settings, lineage_file(SHAPE + ".partial"), b"half")

    # WHEN it ends, however it ends (a failure after the first step has compiled too)
    finish(settings, first, status)

    # THEN the finished file is shared, the partial one is not
    assert shared(settings) == {SHAPE: b"compiled"}
    # AND the next training job reads the shared prefix, file by file as it opens them
    second = seal(settings, 3, 4)[1].job_name if status == "Completed" else sagemaker.created[-1]
    assert second != first
    assert compile_cache_channels(sagemaker.request(second)) == [{
        "ChannelName": "compile-cache", "InputMode": "FastFile", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": f"s3://{settings.models_bucket}/compile-cache/",
            "S3DataDistributionType": "FullyReplicated"}}}]


def test_publishing_again_copies_a_file_only_once_it_changed(settings: TrainingSettings,
                                                            sagemaker: FakeSageMaker) -> None:
    put(settings, lineage_file(SHAPE), b"first compile")
    assert compile_caches.publish(settings.models_bucket, "main") == [SHAPE]

    assert compile_caches.publish(settings.models_bucket, "main") == []  # a redelivered event copies nothing

    put(settings, lineage_file(SHAPE), b"more shapes compiled at a checkpoint")
    assert compile_caches.publish(settings.models_bucket, "main") == [SHAPE]
    assert shared(settings) == {SHAPE: b"more shapes compiled at a checkpoint"}


def test_another_lineage_s_files_are_not_this_lineage_s_to_publish(settings: TrainingSettings,
                                                                  sagemaker: FakeSageMaker) -> None:
    put(settings, s3_layout.lineage_compile_cache_prefix("other") + SHAPE, b"theirs")

    assert compile_caches.publish(settings.models_bucket, "main") == []
    assert compile_caches.channels(settings.models_bucket) == []


def test_a_missing_shared_copy_is_never_asked_for_by_head(settings: TrainingSettings, sagemaker: FakeSageMaker,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """AWS answers a HeadObject of a missing key with 403 to a role whose ListBucket has a prefix
    condition (this function's): a missing copy must be known from the listing."""
    from core import aws
    heads: list[str] = []
    real_head = aws.head_object

    def head(bucket: str, key: str) -> Any:
        heads.append(key)
        return real_head(bucket, key)
    monkeypatch.setattr(aws, "head_object", head)
    put(settings, lineage_file(SHAPE), b"compiled")

    assert compile_caches.publish(settings.models_bucket, "main") == [SHAPE]
    assert heads == []
    assert compile_caches.publish(settings.models_bucket, "main") == []
    assert heads == [s3_layout.COMPILE_CACHE + SHAPE]  # an existing copy: its metadata says where it came from
