"""The demo's stall detector: a stage fails when nothing moves for stage_timeout_s, not when it is slow."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from atelier import client, demo

TIMEOUT = 900.0


class Clock:
    """time.monotonic and time.sleep for the demo: sleeping moves the clock, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def chain(clock: Clock, done_at: float, log_every: float | None) -> tuple[SimpleNamespace, Callable[[dict], client.Status]]:
    """GIVEN a stack whose training job completes at `done_at` (clock seconds) and, while it runs, logs a
    new line every `log_every` seconds (never when None); every other stage is already reached."""
    def log_tail(name: str, lines: int = 40) -> str:
        return "" if log_every is None else f'{{"step": {int(clock.now // log_every)}}}'

    def status(outputs: dict) -> client.Status:
        done = clock.now >= done_at
        return client.Status(
            uploads=Counter(accepted=demo.DemoOptions(Path(), Path(), Path()).images), shards=Counter(claimed=1),
            jobs=[{"name": "atelier-abc", "role": "train", "status": "Completed" if done else "InProgress"}],
            models=[{"model": "atelier-abc", "status": "deployed"}] if done else [],
            endpoints=[{"name": "atelier", "status": "InService"}] if done else [])

    stack = SimpleNamespace(check=lambda: None, outputs={}, options=SimpleNamespace(state_dir=Path("/state")),
                            sagemaker=SimpleNamespace(training_log_tail=log_tail))
    return stack, status


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(demo, "time", clock)
    return clock


def follow(stack: SimpleNamespace) -> client.Status:
    options = demo.DemoOptions(root=Path(), state_dir=Path("/state"), output=Path("/state/image.png"),
                               stage_timeout_s=TIMEOUT, quiet=True)
    return demo._follow(stack, options, started=0.0)


def test_a_slow_training_job_that_keeps_logging_is_followed_to_the_end(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    # a job of 5x the stall time, a line every 2/3 of it: slow, not stalled
    stack, status = chain(clock, done_at=5 * TIMEOUT, log_every=TIMEOUT * 2 / 3)
    monkeypatch.setattr(demo.client, "pipeline_status", status)

    final = follow(stack)

    assert final.jobs[0]["status"] == "Completed" and clock.now >= 5 * TIMEOUT


def test_a_job_whose_log_stops_moving_fails_the_demo_after_the_stall_time(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    stack, status = chain(clock, done_at=5 * TIMEOUT, log_every=None)
    monkeypatch.setattr(demo.client, "pipeline_status", status)

    with pytest.raises(demo.DemoFailed, match=r"stalled waiting for: training job completed \(nothing moved in 900 s\)"):
        follow(stack)

    assert TIMEOUT < clock.now < TIMEOUT + 2 * demo.poll_interval(status({}))
