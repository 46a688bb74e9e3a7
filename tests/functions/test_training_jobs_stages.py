"""The start-training stage's follow-ups: a run plan's stages, one job each; replayed shards in the next manifest."""

from __future__ import annotations

import json
from typing import Callable

import pytest

from contracts.messages import ShardRef
from core import aws
from core.start_training.settings import TrainingSettings
from core.start_training.starter import StartDecision
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
    TWO_STAGES,
    FakeSageMaker,
    channel_uri,
    configure,
    expected_manifest,
    finish,
    job,
    lineage,
    manifest_uri,
    pending,
    sagemaker,
    seal,
    settings,
    shard_item,
    sid,
    stack,
    stored_manifest,
    tags,
    trained,
)


# --- a run plan: one job per stage, chained ---------------------------------------------------------

def test_completed_first_stage_starts_the_second_with_its_instances(configure: Callable[..., TrainingSettings],
                                                                    sagemaker: FakeSageMaker) -> None:
    settings = configure(recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name

    # WHEN stage 0 completes
    finish(settings, base, "Completed")

    # THEN `<base>-s1` runs stage 1 on the same manifest, resuming the lineage's checkpoints
    s1 = f"{base}-s1"
    assert sagemaker.created == [base, s1]
    first, second = sagemaker.request(base), sagemaker.request(s1)
    assert (first["ResourceConfig"]["InstanceType"], first["ResourceConfig"]["InstanceCount"]) == ("ml.m5.xlarge", 1)
    assert (second["ResourceConfig"]["InstanceType"], second["ResourceConfig"]["InstanceCount"]) == ("ml.m5.2xlarge", 1)
    assert first["HyperParameters"] == {"steps": "3", "batch-size": "2", "resolution": "32", "model-config": "tiny"}
    assert second["HyperParameters"] == {"steps": "8", "batch-size": "2", "resolution": "64", "model-config": "tiny",
                                         "first-step": "4"}
    assert channel_uri(second) == channel_uri(first) == manifest_uri(settings, base)
    assert second["CheckpointConfig"] == first["CheckpointConfig"]
    assert (tags(first)["atelier:stage"], tags(first)["atelier:final-stage"]) == ("lo", "false")
    assert (tags(second)["atelier:stage"], tags(second)["atelier:final-stage"]) == ("hi", "true")
    assert tags(second)["atelier:manifest"] == tags(first)["atelier:manifest"]
    # AND the shards are not trained until the last stage is done
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["claimed", "claimed"]
    assert (lineage(settings)["running_job"], lineage(settings)["steps_done"]) == (s1, 0)
    assert (job(settings, s1)["stage"], job(settings, s1)["shards"]) == (1, [sid(1), sid(2)])


def test_completed_last_stage_trains_the_shards_and_frees_the_lineage(configure: Callable[..., TrainingSettings],
                                                                      sagemaker: FakeSageMaker) -> None:
    settings = configure(recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")

    finish(settings, f"{base}-s1", "Completed")

    assert trained(settings) == [sid(1), sid(2)]
    assert (lineage(settings)["running_job"], lineage(settings)["steps_done"]) == ("", 8)
    assert sagemaker.created == [base, f"{base}-s1"]


def test_next_manifest_s_stages_train_on_from_the_lineage_total(configure: Callable[..., TrainingSettings],
                                                                sagemaker: FakeSageMaker) -> None:
    settings = configure(recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")
    finish(settings, f"{base}-s1", "Completed")

    following = seal(settings, 3, 4)[1].job_name
    finish(settings, following, "Completed")

    assert sagemaker.request(following)["HyperParameters"]["steps"] == "11"  # 8 + 3
    assert sagemaker.request(f"{following}-s1")["HyperParameters"]["steps"] == "16"  # 8 + 3 + 5
    # and each job names the lineage step its stage starts at, where its warm-up counts from (1: named by none)
    jobs = (base, f"{base}-s1", following, f"{following}-s1")
    assert [sagemaker.request(name)["HyperParameters"].get("first-step") for name in jobs] == [None, "4", "9", "12"]


def test_duplicate_completed_event_of_a_stage_starts_its_successor_once(configure: Callable[..., TrainingSettings],
                                                                        sagemaker: FakeSageMaker) -> None:
    settings = configure(recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")

    again = finish(settings, base, "Completed")

    assert again == StartDecision("waiting", None, 0)
    assert sagemaker.created == [base, f"{base}-s1"]
    assert lineage(settings)["running_job"] == f"{base}-s1"


@pytest.mark.parametrize("status", ["Failed", "Stopped"])
def test_failed_later_stage_returns_the_shards_to_pending(status: str, configure: Callable[..., TrainingSettings],
                                                          sagemaker: FakeSageMaker) -> None:
    # GIVEN a manifest whose first stage completed and whose second stage runs
    settings = configure(recipe=TWO_STAGES)
    base = seal(settings, 1, 2)[1].job_name
    finish(settings, base, "Completed")
    higher = configure(TRAINING_QUOTA="4")  # so the returned shards alone start nothing

    # WHEN the second stage fails
    finish(higher, f"{base}-s1", status, "InternalServerError")

    # THEN no shard is lost: both are pending again and the lineage is free
    assert pending(settings) == [sid(1), sid(2)]
    assert [shard_item(settings, n)["status"] for n in (1, 2)] == ["pending"] * 2
    assert lineage(settings)["running_job"] == ""


# --- replay -------------------------------------------------------------------------------------

def test_follow_up_manifest_mixes_in_shards_of_the_completed_job(configure: Callable[..., TrainingSettings],
                                                                 sagemaker: FakeSageMaker) -> None:
    # GIVEN half of each follow-up job replayed, and a first job that completed on shards 1 and 2
    settings = configure(TRAINING_REPLAY_SHARE="0.5")
    first = seal(settings, 1, 2)[1].job_name
    assert stored_manifest(settings, first) == expected_manifest(settings, [1, 2])  # nothing to replay yet
    finish(settings, first, "Completed")

    # WHEN shards 3 and 4 reach the quota
    second = seal(settings, 3, 4)[1].job_name

    # THEN the manifest lists them as new and 1 and 2 as replay; the job reads all four
    assert stored_manifest(settings, second) == expected_manifest(settings, [3, 4], replay=(1, 2), sequence=2)
    body = json.loads(aws.read_object(settings.data_bucket, f"manifests/{second}.manifest"))
    assert body == [{"prefix": f"s3://{settings.data_bucket}/shards/"}] + [f"{sid(n)}.tar" for n in (3, 4, 1, 2)]
    assert (job(settings, second)["shards"], job(settings, second)["replay"]) == ([sid(3), sid(4)], [sid(1), sid(2)])
    assert sagemaker.created == [first, second]


def test_failed_follow_up_returns_only_its_new_shards(configure: Callable[..., TrainingSettings],
                                                      sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_REPLAY_SHARE="0.5", TRAINING_QUOTA="3")
    first = seal(settings, 1, 2, 3)[2].job_name
    finish(settings, first, "Completed")
    second = seal(settings, 4, 5, 6)[2].job_name

    finish(settings, second, "Failed", "AlgorithmError")

    # the replayed shards stay trained; the new ones are claimed again under a new name
    assert trained(settings) == [sid(1), sid(2), sid(3)]
    retry = lineage(settings)["running_job"]
    assert retry not in ("", second)
    assert job(settings, retry)["shards"] == [sid(4), sid(5), sid(6)]


def test_completed_follow_up_marks_only_its_new_shards_trained(configure: Callable[..., TrainingSettings],
                                                               sagemaker: FakeSageMaker) -> None:
    settings = configure(TRAINING_REPLAY_SHARE="0.5")
    first = seal(settings, 1, 2)[1].job_name
    finish(settings, first, "Completed")
    second = seal(settings, 3, 4)[1].job_name

    finish(settings, second, "Completed")

    assert trained(settings) == [sid(n) for n in (1, 2, 3, 4)]
    assert [ShardRef.model_validate_json(shard_item(settings, n)["ref"]).role for n in (1, 2, 3, 4)] == ["new"] * 4
    assert lineage(settings)["steps_done"] == 4
