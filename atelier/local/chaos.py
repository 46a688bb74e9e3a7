"""Opt-in fault injection for the local stack (tests/e2e/test_chaos.py, docs/reliability.md).

Off unless a worker's environment names a chaos file (`ATELIER_LOCAL_CHAOS=<path>`, set by
`StackOptions.chaos_file`): a JSON `ChaosConfig` that the test rewrites between phases. Every
worker reads it again when it changes, so faults start and stop without restarting the stack.

- Handler faults (the worker): botocore's `before-call` / `after-call` events count the AWS
  requests of one invocation; at a drawn request the invocation dies, before the request (it never
  happened) or after it (it took effect, the answer was lost). `raise`: an error the handler cannot
  catch, after which every further request of the invocation fails too; `kill`: the process exits
  at once and the supervisor starts a fresh one (a cold start); `stall`: it sleeps past the
  function's timeout, so the runtime's timeout fires mid-batch.
- Delivery faults (the runtime's Poller): a batch's records shuffled; a batch delivered twice; a
  message sent to its queue again, delayed (a duplicate notification, late and out of order); a
  delete lost (the batch comes back after the visibility timeout).

Every fault is appended as one JSON line to `<chaos file>.log`, read by the test's summary.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import boto3

CHAOS_ENV = "ATELIER_LOCAL_CHAOS"
GENERATION_ENV = "ATELIER_LOCAL_CHAOS_GENERATION"  # set by the supervisor: which restart this is
KILLED_EXIT = 86  # a worker killed by a fault exits with this; the supervisor restarts it
STALL_PAST_DEADLINE_S = 2.0


class InjectedCrash(BaseException):
    """The invocation died here (a BaseException: no handler code may swallow it)."""


@dataclass(frozen=True)
class ChaosConfig:
    enabled: bool = False
    seed: int = 0
    crash_rate: float = 0.0  # share of invocations that die
    max_call: int = 40  # the request it dies at is drawn from 1..max_call (later ones: it lives)
    kinds: dict[str, float] = field(default_factory=lambda: {"raise": 1.0, "kill": 1.0, "stall": 0.5})
    shuffle: bool = False
    redeliver_rate: float = 0.0  # a batch (or event) is delivered twice
    duplicate_rate: float = 0.0  # per message: a copy is sent to its queue again
    max_delay_s: int = 0  # ... delayed by 0..max_delay_s
    lose_delete_rate: float = 0.0  # a batch's delete never happens


class Chaos:
    """One worker's view of the chaos file, its random draws and its fault log."""

    def __init__(self, path: Path, function: str, instance: int = 0) -> None:
        self.path, self.function, self.instance = path, function, instance
        self.log_path = path.with_name(path.name + ".log")
        self.generation = int(os.environ.get(GENERATION_ENV, "0"))
        self._mtime = -1.0
        self._config = ChaosConfig()
        self._seeded: int | None = None
        self.rng = random.Random()
        self._armed = False
        self._dead = False
        self._count = 0
        self._plan: tuple[int, str, str] | None = None  # (request number, before|after, kind)
        self._deadline_s = 0.0

    @classmethod
    def from_env(cls, function: str, instance: int = 0) -> "Chaos | None":
        path = os.environ.get(CHAOS_ENV)
        return cls(Path(path), function, instance) if path else None

    @property
    def config(self) -> ChaosConfig:
        """The file's config, read again when it changed; a new seed restarts the draws."""
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return self._config
        if mtime != self._mtime:
            self._mtime = mtime
            config = ChaosConfig(**json.loads(self.path.read_text()))
            if config.seed != self._seeded:
                instance = f":{self.instance}" if self.instance else ""  # another execution environment, other draws
                self.rng.seed(f"{config.seed}:{self.function}{instance}:{self.generation}")
                self._seeded = config.seed
            self._config = config
        return self._config

    def record(self, fault: str, **detail: Any) -> None:
        line = json.dumps({"fault": fault, "function": self.function, "seed": self._config.seed,
                           "at": round(time.time(), 3), **detail}) + "\n"
        with self.log_path.open("a") as log:
            log.write(line)

    # --- handler faults -------------------------------------------------------------------------
    def install(self) -> None:
        """Count every AWS request this process makes from now on (clients made later included)."""
        boto3.setup_default_session()
        events = boto3.DEFAULT_SESSION.events  # type: ignore[union-attr]
        events.register("before-call", self._before_call)
        events.register("after-call", self._after_call)

    def wrap(self, handler: Callable[[dict, Any], Any]) -> Callable[[dict, Any], Any]:
        """The handler, armed for one invocation: it may die at a drawn request."""
        def invocation(event: dict, context: Any) -> Any:
            self._arm(context)
            try:
                return handler(event, context)
            except InjectedCrash as crash:
                raise RuntimeError(f"injected crash: {crash}") from None  # the runtime fails the batch
            finally:
                self._armed = False
        return invocation

    def _arm(self, context: Any) -> None:
        config = self.config
        self._armed, self._dead, self._count, self._plan = True, False, 0, None
        self._deadline_s = context.get_remaining_time_in_millis() / 1000
        if config.enabled and self.rng.random() < config.crash_rate:
            kinds = sorted(config.kinds)
            kind = self.rng.choices(kinds, weights=[config.kinds[k] for k in kinds])[0]
            self._plan = (self.rng.randint(1, config.max_call), self.rng.choice(["before", "after"]), kind)

    def _before_call(self, event_name: str, **_: Any) -> None:
        if not self._armed:
            return
        if self._dead:
            raise InjectedCrash(f"dead before {event_name}")
        self._count += 1
        if self._plan and self._plan[:2] == (self._count, "before"):
            self._fire(event_name)

    def _after_call(self, event_name: str, **_: Any) -> None:
        if self._armed and not self._dead and self._plan and self._plan[:2] == (self._count, "after"):
            self._fire(event_name)

    def _fire(self, event_name: str) -> None:
        assert self._plan is not None
        number, when, kind = self._plan
        self._dead = True
        self.record(kind, when=when, call=number, request=event_name.split(".", 1)[1])
        if kind == "kill":
            os._exit(KILLED_EXIT)
        if kind == "stall":
            time.sleep(self._deadline_s + STALL_PAST_DEADLINE_S)  # the runtime's timeout interrupts this
        raise InjectedCrash(f"{kind} {when} {event_name} (request {number})")

    # --- delivery faults ------------------------------------------------------------------------
    def perturb(self, messages: list[dict[str, Any]], send_copy: Callable[[dict[str, Any], int], None]
                ) -> list[dict[str, Any]]:
        """The batch as delivered: maybe shuffled; some messages also sent again, delayed."""
        config = self.config
        if not config.enabled:
            return messages
        if config.shuffle and len(messages) > 1:
            messages = list(messages)
            self.rng.shuffle(messages)
        for message in messages:
            if self.rng.random() < config.duplicate_rate:
                delay = self.rng.randint(0, config.max_delay_s)
                send_copy(message, delay)
                self.record("duplicate", delay_s=delay)
        return messages

    def deliver_twice(self) -> bool:
        config = self.config
        if config.enabled and self.rng.random() < config.redeliver_rate:
            self.record("redeliver")
            return True
        return False

    def lose_delete(self) -> bool:
        config = self.config
        if config.enabled and self.rng.random() < config.lose_delete_rate:
            self.record("lost_delete")
            return True
        return False


def supervise(argv: list[str]) -> int:
    """Run the worker as a child and start a fresh one whenever a `kill` fault ended it, as Lambda
    starts a new execution environment; SIGTERM/SIGINT are passed on and end the loop."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    generation = 0
    while True:
        child = subprocess.Popen([sys.executable, *argv], env={**os.environ, GENERATION_ENV: str(generation)})
        code = child.wait()
        if stopping or code != KILLED_EXIT:
            return code
        generation += 1
