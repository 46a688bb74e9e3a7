"""The brake on a lineage whose jobs keep failing: exponential backoff, then a circuit breaker.

A failed job returns its shards to pending, and without a brake the next event would start the
same doomed job at once, on the most expensive instances, forever. After each failure the lineage
waits `backoff_s * 2**(n-1)` (n failures in a row, capped at `max_backoff_s`) before it starts
anything. A model failure (a bad hyperparameter, an OOM, a crash) counts towards the breaker:
after `max_failures` in a row the lineage is halted until an operator resumes it
(`atelier lineage resume NAME`). A capacity failure (no instances to be had, a service quota) or a host
that fails the trainer's preflight backs off the same way but never counts: the job was not at fault. A Completed job releases the
brake. Every failure is kept on the lineage, newest last (the job records keep theirs as well).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# SageMaker's FailureReason when it could not get the instances ("CapacityError: Unable to
# provision requested ML compute capacity"), and CreateTrainingJob's quota error.
CAPACITY_MARKERS = ("CapacityError", "ResourceLimitExceeded", "InsufficientCapacity",
                    "Unable to provision requested ML compute capacity")
# trainer/runtime/preflight.py's reason when an instance fails its checks at job start: the host, not the model
HOST_MARKERS = ("PreflightError",)
KEPT_FAILURES = 50  # the newest failures on the lineage record (a DynamoDB item holds 400 KB)


@dataclass(frozen=True)
class BrakeSettings:
    max_failures: int = 3
    backoff_s: int = 600
    max_backoff_s: int = 6 * 3600


@dataclass(frozen=True)
class Failure:
    job: str
    reason: str
    kind: str  # "model", "capacity" or "host" (kind_of)
    at: float  # epoch seconds

    def to_item(self) -> dict[str, Any]:
        return {"job": self.job, "reason": self.reason[:1024], "kind": self.kind, "at": int(self.at)}


@dataclass(frozen=True)
class Brake:
    """What the lineage record holds about its failures."""

    model_failures: int = 0  # in a row, towards the breaker
    failures_in_a_row: int = 0  # of any kind, for the backoff
    not_before: float = 0.0  # epoch seconds
    halted: bool = False
    failures: tuple[dict[str, Any], ...] = field(default=())

    @classmethod
    def from_item(cls, item: dict[str, Any]) -> "Brake":
        return cls(model_failures=int(item.get("model_failures", 0)),
                   failures_in_a_row=int(item.get("failures_in_a_row", 0)),
                   not_before=float(item.get("not_before", 0)), halted=bool(item.get("halted", False)),
                   failures=tuple(item.get("failures", ())))

    def to_item(self) -> dict[str, Any]:
        return {"model_failures": self.model_failures, "failures_in_a_row": self.failures_in_a_row,
                "not_before": int(self.not_before), "halted": self.halted, "failures": list(self.failures)}


def is_capacity(reason: str | None) -> bool:
    """Whether a FailureReason says AWS had no capacity rather than that the job failed."""
    return any(marker in (reason or "") for marker in CAPACITY_MARKERS)


def kind_of(reason: str | None) -> str:
    """"capacity" (no instances), "host" (an instance failed its preflight) or "model" (the job itself)."""
    if is_capacity(reason):
        return "capacity"
    return "host" if any((reason or "").startswith(marker) for marker in HOST_MARKERS) else "model"


def backoff_s(failures_in_a_row: int, settings: BrakeSettings) -> float:
    if failures_in_a_row <= 0:
        return 0.0
    return float(min(settings.max_backoff_s, settings.backoff_s * 2 ** (failures_in_a_row - 1)))


def after_failure(brake: Brake, job: str, reason: str | None, now: float, settings: BrakeSettings) -> Brake:
    """The brake after one more failed job."""
    failure = Failure(job, reason or "no reason given", kind_of(reason), now)
    in_a_row = brake.failures_in_a_row + 1
    model = brake.model_failures + (failure.kind == "model")
    return replace(brake, model_failures=model, failures_in_a_row=in_a_row,
                   not_before=now + backoff_s(in_a_row, settings),
                   halted=brake.halted or model >= settings.max_failures,
                   failures=(*brake.failures, failure.to_item())[-KEPT_FAILURES:])


def after_success(brake: Brake) -> Brake:
    """A Completed job: the lineage is healthy again (its failures stay on record)."""
    return replace(brake, model_failures=0, failures_in_a_row=0, not_before=0.0, halted=False)


def resumed(brake: Brake) -> Brake:
    """An operator's resume: no wait and a fresh count, as after a success."""
    return after_success(brake)


def halted_by(brake: Brake, job: str, reason: str, now: float) -> Brake:
    """Halted for a reason no job's failure gave (a refusal before any job starts): kept like a failure."""
    return replace(brake, halted=True, failures=(*brake.failures, Failure(job, reason, "model", now).to_item())[-KEPT_FAILURES:])


def hold(brake: Brake, now: float) -> str | None:
    """Why nothing may start now (None when something may)."""
    if brake.halted:
        last = brake.failures[-1]["reason"] if brake.failures else "no reason recorded"
        if not brake.model_failures:  # halted by a refusal (halted_by), not by failing jobs
            return f"halted: {last}"
        return f"halted after {brake.model_failures} failed jobs in a row (last: {last})"
    if now < brake.not_before:
        return f"backing off for {brake.not_before - now:.0f} s after {brake.failures_in_a_row} failed jobs in a row"
    return None
