"""A stuck rank ends the job with its stacks in the log and a reason, instead of idling until MaxRuntime.

A collective waiting on a peer that lost its GPU, a DataLoader worker that deadlocked or a channel
that stopped answering raises nothing: every rank waits and SageMaker bills the cluster until
MaxRuntimeInSeconds. The training loop pets its Watchdog after each optimizer step. When no pet
comes within the timeout, a daemon thread prints every thread's Python stack of this process to
stderr (faulthandler, the job log), writes the reason to the failure file and ends the process with
status 1: `os._exit`, because the main thread is the stuck one and a Python exception cannot reach
it inside a C call. Each rank has its own watchdog, so each rank's stacks reach the log; a rank that
torchrun stops first (SIGTERM, once a peer exited) dumps its stacks on the way out as well. Both
write to the process's own stderr (`sys.__stderr__`: faulthandler needs a file descriptor, and a
test's capture may have replaced `sys.stderr` with one that has none).
"""

import faulthandler
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from trainer.runtime import cluster
from trainer.runtime.health import write_failure

EXIT_STATUS = 1
_running: set["Watchdog"] = set()


class Watchdog:
    """Ends this process with `reason(last step)` when `pet` is not called for `timeout_s` seconds
    (`first_timeout_s` before the first pet); a timeout of 0 watches nothing."""

    def __init__(self, timeout_s: float, reason: Callable[[int], str], first_timeout_s: float | None = None,
                 step: int = 0):
        self.timeout_s, self.reason, self.step = timeout_s, reason, step
        self._deadline = time.monotonic() + (first_timeout_s or timeout_s)
        self._lock, self._stopped = threading.Lock(), threading.Event()
        self._thread = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
            faulthandler.register(signal.SIGTERM, file=sys.__stderr__, all_threads=True, chain=True)
            _running.add(self)
            self._thread.start()

    def pet(self, step: int) -> None:
        """`step` is done: the next deadline is `timeout_s` from now."""
        with self._lock:
            self.step, self._deadline = step, time.monotonic() + self.timeout_s

    def stop(self) -> None:
        """Watch no more (the loop is over); returns once the thread has ended."""
        if self._thread is None or self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join()
        _running.discard(self)
        if not _running:
            faulthandler.unregister(signal.SIGTERM)

    def _watch(self) -> None:
        while True:
            with self._lock:
                left, step = self._deadline - time.monotonic(), self.step
            if left <= 0:
                break
            if self._stopped.wait(left):
                return
        end_process(self.reason(step))


def end_process(reason: str) -> None:
    """Every thread's stack to stderr, `reason` to the failure file, and this process ended at once."""
    print(f"{reason}; the stacks of this process's threads follow", file=sys.__stderr__, flush=True)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    try:
        write_failure(reason)
    finally:  # the process ends even when the reason cannot be written
        os._exit(EXIT_STATUS)


def training_watchdog(minutes: float, rank: int, step: int) -> Watchdog:
    """The loop's watchdog: no optimizer step for `minutes` (0: never) ends the process. The first
    step gets twice as long: it also starts the DataLoader workers and, under --compile, compiles
    the first graph (minutes with a cold inductor cache)."""
    host = cluster.host_name()

    def reason(last_step: int) -> str:
        return f"WatchdogTimeout: no optimizer step for {minutes:g} min on {host} rank {rank}; last step {last_step}"

    return Watchdog(minutes * 60, reason, first_timeout_s=2 * minutes * 60, step=step)


def stops_watchdogs(function: Callable) -> Callable:
    """`function`, with any watchdog it started stopped when it returns or raises: a process that
    goes on after the error (a test run) is not ended later by the timer of a loop long gone."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        before = set(_running)
        try:
            return function(*args, **kwargs)
        finally:
            for watchdog in _running - before:
                watchdog.stop()

    return wrapper
