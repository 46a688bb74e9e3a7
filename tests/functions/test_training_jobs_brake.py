"""The brake on failing training jobs (core.start_training.failure_brake): backoff, the halt, capacity failures."""

from __future__ import annotations

from typing import Callable

import pytest

from atelier.local.provision import Provisioned
from core.start_training.settings import TrainingSettings
from core.start_training import starter
from core.start_training.manifests import job_name_for
from core.start_training.starter import StartDecision, advance, resume
from tests.functions.training_jobs_helpers import (  # noqa: F401  (stack, sagemaker, configure, settings: fixtures)
    FakeSageMaker,
    configure,
    expected_manifest,
    finish,
    job,
    lineage,
    pending,
    sagemaker,
    seal,
    settings,
    sid,
    stack,
)


# --- the brake on failing jobs (core.start_training.failure_brake) -------------------------------------------------

NOW = 1_800_000_000.0
MODEL_FAILURE = "AlgorithmError: unrecognized arguments: --learning-rat 1e-4"
CAPACITY_FAILURE = "CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type."


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The orchestration's time, moved by the test: clock[0] is now."""
    now = [NOW]
    monkeypatch.setattr(starter, "_now", lambda: now[0])
    return now


def test_a_failed_job_backs_off_and_the_schedule_starts_the_next_after_the_wait(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600")
    first = seal(settings, 1, 2)[1].job_name

    # WHEN the job fails
    decision = finish(settings, first, "Failed", MODEL_FAILURE)

    # THEN nothing starts for the backoff, its shards wait in the pending index, the reason is kept
    assert decision == StartDecision("backing-off") and sagemaker.created == [first]
    assert pending(settings) == [sid(1), sid(2)]
    assert (lineage(settings)["not_before"], lineage(settings)["failures"][-1]["reason"]) == (NOW + 600, MODEL_FAILURE)
    clock[0] = NOW + 599
    assert advance(settings) == StartDecision("backing-off") and sagemaker.created == [first]
    # AND the schedule's look after the wait starts the retry on the same shards
    clock[0] = NOW + 600
    retry = advance(settings)
    assert retry.action == "started" and sagemaker.created == [first, retry.job_name]


def test_the_backoff_doubles_with_each_failure_in_a_row(configure: Callable[..., TrainingSettings],
                                                          sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600", TRAINING_MAX_CONSECUTIVE_FAILURES="5")
    name = seal(settings, 1, 2)[1].job_name
    waits = []
    for _ in range(3):
        finish(settings, name, "Failed", MODEL_FAILURE)
        waits.append(float(lineage(settings)["not_before"]) - clock[0])
        clock[0] = float(lineage(settings)["not_before"])
        name = advance(settings).job_name

    assert waits == [600, 1200, 2400]


def test_three_model_failures_in_a_row_halt_the_lineage_until_it_is_resumed(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float],
        stack: Provisioned) -> None:
    from atelier import client, operator_requests
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="3")  # backoff 0 (tests/conftest.py)
    name = seal(settings, 1, 2)[1].job_name
    decisions = []
    for n in range(3):  # a bad hyperparameter fails every job the same way
        decisions.append(finish(settings, name, "Failed", f"{MODEL_FAILURE} (attempt {n})"))
        name = decisions[-1].job_name

    # THEN the third failure halts it: no fourth job, however many events come
    assert [d.action for d in decisions] == ["started", "started", "halted"]
    assert seal(settings, 3, 4)[-1].action == "halted" and advance(settings) == StartDecision("halted")
    assert len(sagemaker.created) == 3
    record = lineage(settings)
    assert (record["halted"], record["model_failures"]) == (True, 3)
    assert [f["reason"] for f in record["failures"]] == [f"{MODEL_FAILURE} (attempt {n})" for n in range(3)]
    assert pending(settings) == [sid(n) for n in (1, 2, 3, 4)]  # nothing lost
    held = next(line for line in client.pipeline_status(stack.outputs).lineages if line["name"] == "main")["held"]
    assert held.startswith("halted after 3 failed jobs in a row") and "(attempt 2)" in held

    # WHEN an operator resumes it (`atelier lineage resume main`)
    resumed = operator_requests.resume_lineage(stack.outputs, "main")

    # THEN the CLI changed nothing itself: StartTrainingFunction, given its event, lifts the brake and
    # starts the next job; the failures stay on record
    assert (resumed["was_halted"], resumed["model_failures"]) == (True, 3)
    assert lineage(settings)["halted"] is True and advance(settings) == StartDecision("halted")
    assert resume(settings).action == "started" and len(sagemaker.created) == 4
    assert (lineage(settings)["halted"], len(lineage(settings)["failures"])) == (False, 3)


def test_capacity_failures_back_off_but_never_halt(configure: Callable[..., TrainingSettings],
                                                    sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="2", TRAINING_FAILURE_BACKOFF_S="60")
    name = seal(settings, 1, 2)[1].job_name
    for _ in range(4):
        assert finish(settings, name, "Failed", CAPACITY_FAILURE) == StartDecision("backing-off")
        clock[0] = float(lineage(settings)["not_before"])
        name = advance(settings).job_name

    record = lineage(settings)
    assert (record["halted"], record["model_failures"], record["failures_in_a_row"]) == (False, 0, 4)
    assert {f["kind"] for f in record["failures"]} == {"capacity"} and len(sagemaker.created) == 5


def test_a_quota_refusal_fails_the_job_as_a_capacity_failure_and_backs_off(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="300")
    sagemaker.quota_left = 0

    # WHEN the quota refuses CreateTrainingJob (no exception escapes: EventBridge would retry it for a day)
    decisions = seal(settings, 1, 2)

    # THEN the job is recorded failed with the reason, its shards wait, the lineage backs off
    name = job_name_for(expected_manifest(settings, [1, 2]))
    assert job(settings, name)["status"] == "Failed"
    assert job(settings, name)["failure_reason"].startswith("ResourceLimitExceeded: The account-level service limit")
    assert pending(settings) == [sid(1), sid(2)] and sagemaker.created == []
    assert lineage(settings)["failures"][-1]["kind"] == "capacity" and lineage(settings)["model_failures"] == 0
    assert decisions[-1] == StartDecision("backing-off", name, 2) and advance(settings) == StartDecision("backing-off")
    # AND once the quota allows it, the retry after the wait runs
    sagemaker.quota_left, clock[0] = 1, NOW + 300
    assert advance(settings).action == "started" and len(sagemaker.created) == 1


def test_a_completed_job_releases_the_brake_and_keeps_the_failures_on_record(
        configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker, clock: list[float]) -> None:
    settings = configure(TRAINING_MAX_CONSECUTIVE_FAILURES="3")
    name = seal(settings, 1, 2)[1].job_name
    for _ in range(2):
        name = finish(settings, name, "Failed", MODEL_FAILURE).job_name
    finish(settings, name, "Completed")

    record = lineage(settings)
    assert (record["model_failures"], record["failures_in_a_row"], record["halted"]) == (0, 0, False)
    assert len(record["failures"]) == 2


def test_a_stopped_job_is_no_failure(configure: Callable[..., TrainingSettings], sagemaker: FakeSageMaker,
                                     clock: list[float]) -> None:
    settings = configure(TRAINING_FAILURE_BACKOFF_S="600")
    first = seal(settings, 1, 2)[1].job_name

    decision = finish(settings, first, "Stopped", "stopped by an operator")

    assert decision.action == "started" and lineage(settings).get("failures_in_a_row", 0) == 0
