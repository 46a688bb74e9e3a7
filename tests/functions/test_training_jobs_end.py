"""The start-training stage at a job's end (completed, failed, duplicated, not ours), name collisions, the handler."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from contracts.messages import ShardRef
from core.start_training.settings import TrainingSettings
from core.start_training.manifests import job_name_for
from core.start_training.starter import StartDecision, JobNameCollision, on_shard_sealed
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
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
    ref,
    sagemaker,
    seal,
    sealed,
    settings,
    shard_item,
    sid,
    stack,
    stored_manifest,
    trained,
)
from tests.support import load_event


# --- a job's end ----------------------------------------------------------------------------------

def test_completed_job_s_shards_become_trained(settings: TrainingSettings) -> None:
    name = seal(settings, 1, 2)[1].job_name

    decision = finish(settings, name, "Completed")

    assert decision == StartDecision("waiting", None, 0)
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["trained", "trained"]
    assert trained(settings) == [sid(1), sid(2)]
    assert ShardRef.model_validate_json(shard_item(settings, 1)["ref"]) == ref(settings, 1)
    assert {k: lineage(settings)[k] for k in ("running_job", "steps_done", "queue")} == {
        "running_job": "", "steps_done": 2, "queue": []}
    assert (job(settings, name)["status"], job(settings, name)["settled"]) == ("Completed", "Completed")


def test_completed_job_starts_the_queued_manifest_with_the_lineage_s_steps(settings: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job and a queued one
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])

    # WHEN the first completes
    decision = finish(settings, first, "Completed")

    # THEN the queued job starts, training on to the lineage's steps so far plus its own
    assert decision == StartDecision("started", second)
    assert sagemaker.created == [first, second]
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"  # 2 done + 2 of the stage
    assert channel_uri(sagemaker.request(second)) == manifest_uri(settings, second)
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (second, [])
    assert (job(settings, second)["status"], job(settings, second)["steps_base"]) == ("Requested", 2)
    assert trained(settings) == [sid(1), sid(2)]


def test_under_skip_a_completed_job_claims_the_pending_shards(configure: Callable[..., TrainingSettings],
                                                              sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_CONCURRENCY="skip")
    first = seal(settings, 1, 2, 3, 4)[1].job_name

    decision = finish(settings, first, "Completed")

    second = job_name_for(expected_manifest(settings, [3, 4], sequence=2))
    assert decision == StartDecision("started", second, 2)
    assert sagemaker.created == [first, second]
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"


def test_next_job_after_a_completed_one_trains_on_to_the_lineage_total(settings: TrainingSettings,
                                                                       sagemaker: FakeSageMaker) -> None:
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")

    second = seal(settings, 3, 4)[1].job_name

    assert sagemaker.request(second)["HyperParameters"]["steps"] == "4"
    assert sagemaker.request(second)["CheckpointConfig"] == sagemaker.request(first)["CheckpointConfig"]


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_failed_or_stopped_job_returns_its_shards_and_a_new_job_takes_them(
        status: str, settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job
    first = seal(settings, 1, 2)[1].job_name

    # WHEN it fails (a timed-out job ends Stopped)
    decision = finish(settings, first, status, "AlgorithmError: loss became NaN at step 1200")

    # THEN its record keeps the reason, and its shards are claimed again by a job of another name
    retry = job_name_for(expected_manifest(settings, [1, 2], sequence=2))
    assert retry != first
    assert decision == StartDecision("started", retry, 2)
    assert (job(settings, first)["status"], job(settings, first)["failure_reason"]) == (
        status, "AlgorithmError: loss became NaN at step 1200")
    assert sagemaker.created == [first, retry]
    assert stored_manifest(settings, retry).shards == stored_manifest(settings, first).shards
    assert [shard_item(settings, n)["manifest_job"] for n in (1, 2)] == [retry, retry]
    assert sagemaker.request(retry)["HyperParameters"]["steps"] == "2"  # nothing was trained
    assert lineage(settings)["running_job"] == retry


def test_failed_job_s_shards_go_back_to_pending_and_the_lock_is_released(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker) -> None:
    # GIVEN a running job, and a quota raised since (so its two shards alone start nothing)
    first = seal(configure(), 1, 2)[1].job_name
    settings = configure(TRAINING_QUOTA="4")

    # WHEN it fails
    decision = finish(settings, first, "Failed", "InternalServerError")

    # THEN its shards are pending again, in the index, and the lineage is free
    assert decision == StartDecision("waiting", None, 2)
    assert pending(settings) == [sid(1), sid(2)]
    assert [(shard_item(settings, n)["status"], "manifest_job" in shard_item(settings, n)) for n in (1, 2)] \
        == [("pending", False)] * 2
    assert lineage(settings)["running_job"] == ""
    assert sagemaker.created == [first]


def test_queued_job_starts_when_the_running_one_fails(settings: TrainingSettings,
                                                      sagemaker: FakeSageMaker) -> None:
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])

    decision = finish(settings, first, "Failed", "InternalServerError")

    assert decision == StartDecision("started", second)
    assert sagemaker.request(second)["HyperParameters"]["steps"] == "2"  # nothing trained yet
    assert pending(settings) == [sid(1), sid(2)]


def test_duplicate_completed_event_settles_once(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    # GIVEN a completed job whose queued successor has started
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])
    finish(settings, first, "Completed")

    # WHEN the Completed event arrives again
    again = finish(settings, first, "Completed")

    # THEN nothing moves: no new job, the same steps, the successor still holds the lock
    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [first, second]
    assert lineage(settings)["steps_done"] == 2
    assert (lineage(settings)["running_job"], lineage(settings)["queue"]) == (second, [])
    assert trained(settings) == [sid(1), sid(2)]
    assert [shard_item(settings, n)["manifest_job"] for n in (3, 4)] == [second, second]


def test_late_duplicate_completed_event_does_not_set_the_lineage_s_steps_back(settings: TrainingSettings,
                                                                           sagemaker: FakeSageMaker) -> None:
    # GIVEN two jobs that completed one after the other (2 steps each)
    first, _, second = (d.job_name for d in seal(settings, 1, 2, 3, 4)[1:])
    finish(settings, first, "Completed")
    finish(settings, second, "Completed")
    assert lineage(settings)["steps_done"] == 4

    # WHEN the first job's Completed event arrives once more
    finish(settings, first, "Completed")

    # THEN the lineage keeps its total, so the next job resumes from step 4, not 2
    assert lineage(settings)["steps_done"] == 4
    assert sagemaker.created == [first, second]


def test_duplicate_failed_event_does_not_take_shards_from_their_new_job(settings: TrainingSettings,
                                                                        sagemaker: FakeSageMaker) -> None:
    first = seal(settings, 1, 2)[1].job_name
    retry = finish(settings, first, "Failed", "InternalServerError").job_name

    again = finish(settings, first, "Failed", "InternalServerError")

    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [first, retry]
    assert [(shard_item(settings, n)["status"], shard_item(settings, n)["manifest_job"]) for n in (1, 2)] \
        == [("claimed", retry)] * 2
    assert pending(settings) == []
    assert lineage(settings)["running_job"] == retry


def test_end_of_a_job_not_in_the_table_is_not_ours(settings: TrainingSettings, sagemaker: FakeSageMaker) -> None:
    seal(settings, 1)
    stranger = "atelier-3f9a1c2b7d4e5f6a8b9c"  # events/deploy_job_*.json

    assert finish(settings, stranger, "Completed") == StartDecision("not-ours", stranger)
    assert pending(settings) == [sid(1)]
    assert sagemaker.requests == []


def test_end_of_another_lineage_s_job_is_not_ours(configure: Callable[..., TrainingSettings],
                                                  sagemaker: FakeSageMaker) -> None:
    other = configure(TRAINING_LINEAGE="faces")
    name = seal(other, 1, 2)[1].job_name
    main = configure(TRAINING_LINEAGE="main")

    assert finish(main, name, "Completed") == StartDecision("not-ours", name)
    assert [shard_item(other, n)["status"] for n in (1, 2)] == ["claimed", "claimed"]


# --- name collisions ----------------------------------------------------------------------------

def test_existing_job_of_our_name_on_another_manifest_is_a_collision(settings: TrainingSettings,
                                                                     sagemaker: FakeSageMaker) -> None:
    # GIVEN a job of the name our manifest will get, created for another ManifestFile
    name = job_name_for(expected_manifest(settings, [1, 2]))
    on_shard_sealed(sealed(settings, 1), settings)
    request = {"TrainingJobName": name, "RoleArn": settings.role_arn,
               "AlgorithmSpecification": {"TrainingImage": settings.image_uri, "TrainingInputMode": "FastFile"},
               "InputDataConfig": [{"ChannelName": "train", "DataSource": {"S3DataSource": {
                   "S3DataType": "ManifestFile", "S3Uri": "s3://elsewhere/manifests/other.manifest"}}}],
               "OutputDataConfig": {"S3OutputPath": "s3://elsewhere/"},
               "ResourceConfig": {"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
               "StoppingCondition": {"MaxRuntimeInSeconds": 60}}
    sagemaker.create_training_job(**request)

    # WHEN the quota is reached, THEN the stage refuses to take that job for ours
    with pytest.raises(JobNameCollision, match=name):
        on_shard_sealed(sealed(settings, 2), settings)
    assert channel_uri(sagemaker.request(name)) == "s3://elsewhere/manifests/other.manifest"


def test_existing_job_of_our_name_on_our_manifest_is_ours(settings: TrainingSettings,
                                                          sagemaker: FakeSageMaker) -> None:
    name = seal(settings, 1, 2)[1].job_name

    assert seal(settings, 2) == [StartDecision("already-claimed", name)]
    assert sagemaker.created == [name]


def test_handler_counts_a_shard_sealed_event(settings: TrainingSettings, lambda_context: Any) -> None:
    event = load_event("start_training_shard_sealed")

    assert handle(event, lambda_context) == {"action": "waiting", "job": None}
    assert pending(settings) == [event["detail"]["shard_id"]]


@pytest.mark.parametrize("name", ["deploy_job_completed", "deploy_job_failed"])
def test_handler_leaves_the_end_of_a_job_it_did_not_start(name: str, settings: TrainingSettings,
                                                          sagemaker: FakeSageMaker, lambda_context: Any) -> None:
    event = load_event(name)

    assert handle(event, lambda_context) == {"action": "not-ours", "job": event["detail"]["TrainingJobName"]}
    assert sagemaker.requests == []


def test_handler_settles_the_end_of_its_own_job(settings: TrainingSettings, sagemaker: FakeSageMaker,
                                               lambda_context: Any) -> None:
    # GIVEN a job this stage started, and SageMaker's Failed event for it
    name = seal(settings, 1, 2)[1].job_name
    event = load_event("deploy_job_failed")
    event["detail"]["TrainingJobName"] = name

    result = handle(event, lambda_context)

    retry = job_name_for(expected_manifest(settings, [1, 2], sequence=2))
    assert result == {"action": "started", "job": retry}
    assert job(settings, name)["failure_reason"] == "AlgorithmError: loss became NaN at step 1200"


@pytest.mark.parametrize("status", ["Completed", "Failed"])
def test_a_job_s_end_changes_only_its_status_settled_and_failure_reason(status: str, settings: TrainingSettings,
                                                                       sagemaker: FakeSageMaker,
                                                                       lambda_context: Any) -> None:
    # GIVEN a job this stage started; DeployFunction, on the same event, writes only its model_data
    # (test_deploy_candidates.py)
    name = seal(settings, 1, 2)[1].job_name
    before = job(settings, name)
    event = load_event("deploy_job_failed")
    event["detail"].update(TrainingJobName=name, TrainingJobStatus=status)

    handle(event, lambda_context)

    after = job(settings, name)
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == {
        "status", "settled", "failure_reason"}
