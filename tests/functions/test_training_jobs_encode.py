"""The start-training stage with latent shards: an encode job before each stage, then training on its latents."""

from __future__ import annotations

import json
from typing import Any, Callable

import pytest

from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.manifests import job_name_for
from core.start_training.starter import StartDecision
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
    ENCODING,
    TWO_STAGES,
    FakeSageMaker,
    channel_uri,
    configure,
    expected_manifest,
    finish,
    handle,
    job,
    lineage,
    manifest_uri,
    pending,
    put_latents,
    sagemaker,
    seal,
    settings,
    shard_item,
    sid,
    stack,
    tags,
)
from tests.support import load_event


@pytest.fixture
def encoding(configure: Callable[..., TrainingSettings]) -> TrainingSettings:
    return configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge")


def test_with_an_encode_instance_the_quota_starts_the_encode_job_first(encoding: TrainingSettings,
                                                                      sagemaker: FakeSageMaker) -> None:
    decision = seal(encoding, 1, 2)[1]

    name = job_name_for(expected_manifest(encoding, [1, 2]))
    request = sagemaker.request(f"{name}-enc")
    assert decision == StartDecision("started", name, 2)
    assert sagemaker.created == [f"{name}-enc"]  # the training job waits for its latents
    assert request["HyperParameters"] == {"task": "encode", "resolution": "32", "model-config": "tiny"}
    assert channel_uri(request) == manifest_uri(encoding, name)
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["train"]  # nothing excluded: no manifest channel
    assert request["InputDataConfig"][0]["DataSource"]["S3DataSource"]["S3DataDistributionType"] == "ShardedByS3Key"
    assert (request["ResourceConfig"]["InstanceType"], request["ResourceConfig"]["InstanceCount"]) == ("ml.g5.2xlarge", 1)
    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{encoding.models_bucket}/encoded/{name}/"
    assert request["OutputDataConfig"]["S3OutputPath"] == f"s3://{encoding.models_bucket}/encoded/"
    assert {k: tags(request)[k] for k in ("atelier:role", "atelier:final-stage", "atelier:training-job")} == {
        "atelier:role": "encode", "atelier:final-stage": "false", "atelier:training-job": name}
    assert (lineage(encoding)["running_job"], job(encoding, name)["status"]) == (name, "Requested")


def test_completed_encode_job_starts_training_on_a_manifest_of_the_latent_shards(encoding: TrainingSettings,
                                                                                 sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)

    decision = finish(encoding, f"{name}-enc", "Completed")

    latents = f"s3://{encoding.data_bucket}/manifests/{name}.latents.manifest"
    assert decision == StartDecision("encoded", name)
    assert sagemaker.created == [f"{name}-enc", name]
    assert channel_uri(sagemaker.request(name)) == latents
    assert json.loads(aws.read_object(encoding.data_bucket, f"manifests/{name}.latents.manifest")) == [
        {"prefix": f"s3://{encoding.models_bucket}/encoded/{name}/latents/{ENCODING}/"}, f"{sid(1)}.tar", f"{sid(2)}.tar"]
    assert sagemaker.request(name)["HyperParameters"] == {"steps": "2", "batch-size": "2", "resolution": "32",
                                                          "model-config": "tiny"}
    assert job(encoding, name)["latents"] == latents
    assert job(encoding, f"{name}-enc")["status"] == "Completed"


def test_duplicate_encode_completed_event_starts_the_training_job_once(encoding: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)

    finish(encoding, f"{name}-enc", "Completed")
    finish(encoding, f"{name}-enc", "Completed")

    assert sagemaker.created == [f"{name}-enc", name]
    assert lineage(encoding)["running_job"] == name


def test_an_encode_job_that_left_a_shard_out_fails_its_training_job(configure: Callable[..., TrainingSettings],
                                                                    sagemaker: FakeSageMaker) -> None:
    name = seal(configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge"), 1, 2)[1].job_name
    settings = configure(TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge", TRAINING_QUOTA="4")  # nothing re-claims them
    put_latents(settings, name, 1)

    decision = finish(settings, f"{name}-enc", "Completed")

    assert decision == StartDecision("encode-failed", name)
    assert sagemaker.created == [f"{name}-enc"]  # never trained on half the manifest
    record = job(settings, name)
    assert record["status"] == "Failed"
    assert f"1 of 2 shards have no latent shard under s3://{settings.models_bucket}/encoded/{name}/latents/{ENCODING}/" \
        in record["failure_reason"]
    assert pending(settings) == [sid(1), sid(2)] and lineage(settings)["running_job"] == ""


def test_latents_of_two_encodings_are_refused(encoding: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    put_latents(encoding, name, 1, 2, encoding="fedcba9876543210-r32")

    assert finish(encoding, f"{name}-enc", "Completed") == StartDecision("encode-failed", name)

    assert "expected one encoding" in job(encoding, name)["failure_reason"]


def test_a_failed_encode_job_returns_the_shards_and_a_new_job_encodes_them(encoding: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name

    decision = finish(encoding, f"{name}-enc", "Failed", "AlgorithmError: CUDA out of memory")

    retry = job_name_for(expected_manifest(encoding, [1, 2], sequence=2))
    assert decision == StartDecision("encode-failed", name)
    assert job(encoding, name)["failure_reason"] == f"encode job {name}-enc Failed: AlgorithmError: CUDA out of memory"
    assert sagemaker.created == [f"{name}-enc", f"{retry}-enc"]
    assert [shard_item(encoding, n)["manifest_job"] for n in (1, 2)] == [retry, retry]


def test_an_encode_job_whose_end_event_was_lost_is_settled_by_the_next_event(encoding: TrainingSettings,
                                                                            sagemaker: FakeSageMaker) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    sagemaker.jobs[f"{name}-enc"]["TrainingJobStatus"] = "Completed"  # its event never came

    seal(encoding, 3)  # any later event of the lineage looks at the running job

    assert sagemaker.created == [f"{name}-enc", name]
    assert job(encoding, f"{name}-enc")["status"] == "Completed"


def test_each_stage_is_encoded_at_its_own_resolution(configure: Callable[..., TrainingSettings],
                                                     sagemaker: FakeSageMaker) -> None:
    settings = configure(recipe=TWO_STAGES, TRAINING_ENCODE_INSTANCE_TYPE="ml.g5.2xlarge")
    base = seal(settings, 1, 2)[1].job_name
    put_latents(settings, base, 1, 2)
    finish(settings, f"{base}-enc", "Completed")

    finish(settings, base, "Completed")  # stage 0 done

    s1 = f"{base}-s1"
    assert sagemaker.created == [f"{base}-enc", base, f"{s1}-enc"]  # stage 1 waits for latents at 64 px
    assert sagemaker.request(f"{s1}-enc")["HyperParameters"] == {"task": "encode", "resolution": "64",
                                                                   "model-config": "tiny"}
    assert "latents" not in job(settings, s1)
    put_latents(settings, s1, 1, 2, encoding="0123456789abcdef-r64")
    finish(settings, f"{s1}-enc", "Completed")
    assert channel_uri(sagemaker.request(s1)) == f"s3://{settings.data_bucket}/manifests/{s1}.latents.manifest"


def test_the_handler_counts_an_encode_job_s_end_and_starts_its_training_job(encoding: TrainingSettings,
                                                                           sagemaker: FakeSageMaker,
                                                                           lambda_context: Any) -> None:
    name = seal(encoding, 1, 2)[1].job_name
    put_latents(encoding, name, 1, 2)
    event = load_event("start_training_encode_completed")
    event["detail"]["TrainingJobName"] = f"{name}-enc"

    assert handle(event, lambda_context) == {"action": "encoded", "job": name}
    assert sagemaker.created == [f"{name}-enc", name]
