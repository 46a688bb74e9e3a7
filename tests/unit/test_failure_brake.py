"""core.start_training.failure_brake: the backoff doubles to its cap, model failures open the breaker, capacity
failures never do, a success or a resume closes it, and every failure is kept."""

from __future__ import annotations

import pytest

from core.start_training.failure_brake import (
    KEPT_FAILURES,
    Brake,
    BrakeSettings,
    after_failure,
    after_success,
    backoff_s,
    hold,
    is_capacity,
    kind_of,
    resumed,
)

SETTINGS = BrakeSettings(max_failures=3, backoff_s=600, max_backoff_s=3600)
OOM = "AlgorithmError: CUDA out of memory. Tried to allocate 2.00 GiB"


@pytest.mark.parametrize("reason, capacity", [
    ("CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance type.", True),
    ("ResourceLimitExceeded: The account-level service limit 'ml.p5.48xlarge for training job usage' is 0 Instances", True),
    (OOM, False), ("InternalServerError: We encountered an internal error. Please try again.", False), (None, False),
])
def test_capacity_is_told_from_the_failure_reason(reason: str | None, capacity: bool) -> None:
    assert is_capacity(reason) is capacity


def test_a_host_that_fails_the_preflight_is_no_model_failure() -> None:
    reason = "PreflightError: algo-2 rank 9: all_reduce gave 35, expected 36 (1.2 s)"
    brake = after_failure(after_failure(after_failure(Brake(), "a", reason, 0.0, SETTINGS), "b", reason, 0.0, SETTINGS),
                          "c", reason, 0.0, SETTINGS)

    assert (kind_of(reason), kind_of(OOM), brake.model_failures, brake.halted) == ("host", "model", 0, False)


def test_the_backoff_doubles_per_failure_up_to_its_cap() -> None:
    assert [backoff_s(n, SETTINGS) for n in range(6)] == [0, 600, 1200, 2400, 3600, 3600]


def test_the_third_model_failure_in_a_row_halts() -> None:
    brake = Brake()
    for n in range(3):
        assert not brake.halted
        brake = after_failure(brake, f"job-{n}", OOM, 1000.0 + n, SETTINGS)

    assert (brake.halted, brake.model_failures, brake.failures_in_a_row) == (True, 3, 3)
    assert [f["job"] for f in brake.failures] == ["job-0", "job-1", "job-2"]
    assert hold(brake, 10**10).startswith("halted after 3 failed jobs in a row (last: AlgorithmError: CUDA out")


def test_capacity_failures_back_off_without_counting_towards_the_breaker() -> None:
    brake = Brake()
    for n in range(10):
        brake = after_failure(brake, f"job-{n}", "CapacityError: no capacity", 0.0, SETTINGS)

    assert (brake.halted, brake.model_failures, brake.not_before) == (False, 0, 3600)
    assert hold(brake, 3599).startswith("backing off for 1 s") and hold(brake, 3600) is None


def test_a_capacity_failure_between_model_failures_does_not_reset_the_count() -> None:
    brake = after_failure(Brake(), "a", OOM, 0.0, SETTINGS)
    brake = after_failure(brake, "b", "CapacityError: no capacity", 0.0, SETTINGS)
    brake = after_failure(brake, "c", OOM, 0.0, SETTINGS)

    assert (brake.model_failures, brake.halted) == (2, False)


def test_a_success_or_a_resume_closes_the_brake_and_keeps_the_record() -> None:
    failed = after_failure(after_failure(after_failure(Brake(), "a", OOM, 0.0, SETTINGS), "b", OOM, 0.0, SETTINGS),
                           "c", OOM, 0.0, SETTINGS)

    for closed in (after_success(failed), resumed(failed)):
        assert (closed.halted, closed.model_failures, closed.failures_in_a_row, closed.not_before) == (False, 0, 0, 0)
        assert hold(closed, 0.0) is None and len(closed.failures) == 3


def test_only_the_newest_failures_are_kept_and_reasons_are_bounded() -> None:
    brake = Brake()
    for n in range(KEPT_FAILURES + 5):
        brake = after_failure(brake, f"job-{n}", "x" * 5000, 0.0, BrakeSettings(max_failures=1000))

    assert len(brake.failures) == KEPT_FAILURES and brake.failures[0]["job"] == "job-5"
    assert len(brake.failures[-1]["reason"]) == 1024


def test_the_brake_round_trips_through_its_record() -> None:
    brake = after_failure(Brake(), "a", OOM, 12.0, SETTINGS)

    assert Brake.from_item(brake.to_item()) == brake
    assert Brake.from_item({}) == Brake()
