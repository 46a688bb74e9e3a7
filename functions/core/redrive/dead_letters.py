"""Judge one dead letter from evidence: redrive it now, let it wait out its backoff, drop a timer's
tick, or hold it as poison with its last error. Pure: core.redrive.redriver does the I/O.

The evidence, in order (docs/reliability.md, "Dead letters that empty themselves"):
1. A mark of ours: a message already held as poison stays so (its reason is in its attributes).
2. Its queue's contract: the body its consumer would parse, parsed here with the consumer's own
   parser. A body that fails it can never succeed, however often it is retried: poison at once.
3. A schedule's tick is dropped: the next tick does the same work, and PutEvents refuses aws.* events.
4. The redrive ledger (a table item per message identity): a message that came back after `cap`
   automatic redrives, each after its queue's full retries, fails for a reason of its own: poison.
Everything else (throttling, timeouts, a killed invocation, an outage of a dependency) is
transient and goes back after an exponential backoff. SQS says nothing about why a message was
dead-lettered; EventBridge and Lambda's asynchronous invocation attach the error as message
attributes, which are kept as the last error where they exist.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Mapping

from pydantic import ValidationError

from core.errors import BadMessage

VERDICT_ATTRIBUTE = "atelier.verdict"  # "poison" on a message held in its DLQ
ERROR_ATTRIBUTE = "atelier.error"  # why it is held: its last error
REDRIVES_ATTRIBUTE = "atelier.redrives"  # how many automatic redrives it had
POISON = "poison"
ERROR_MAX_CHARS = 1000  # a message attribute holds 256 KiB with the body; a reason needs far less
# The error attributes AWS attaches: Lambda's asynchronous invocation DLQ, EventBridge's target DLQ.
AWS_ERROR_ATTRIBUTES = ("ErrorMessage", "ERROR_MESSAGE", "ErrorCode", "ERROR_CODE")
# Failures that a later attempt can get past (AWS SDK retryable codes, Lambda's timeout and
# runtime-exit messages, HTTP 429/5xx).
TRANSIENT = re.compile(
    r"throttl|too ?many ?requests|rate exceeded|slow ?down|request ?limit|provisioned ?throughput|"
    r"timed? ?out|timeout|service ?unavailable|internal ?(server ?)?(error|failure)|connection|"
    r"runtime\.exit|signal: killed|\b(429|50[0-4])\b", re.IGNORECASE)


class Action(StrEnum):
    REDRIVE = "redrive"  # back where it came from, now
    WAIT = "wait"  # transient, but its backoff has not passed: hidden in the DLQ until it has
    DROP = "drop"  # a schedule's tick: the next tick does the same work (and PutEvents refuses aws.*)
    HOLD = "hold"  # poison: stays in the DLQ, visible, with its last error, and raises the alarm


@dataclass(frozen=True)
class RedrivePolicy:
    cap: int  # automatic redrives a message gets; failing after the last one proves it poison
    backoff_s: int  # the wait before the second redrive; it doubles with each one after
    memory_s: int  # a ledger entry not touched this long is forgotten (the next failure is a new incident)


@dataclass(frozen=True)
class Ledger:
    """What the redriver remembers of one message identity (core.redrive.redriver keeps it in the table)."""

    redrives: int = 0
    last_redrive_at: float = 0.0  # epoch seconds


@dataclass(frozen=True)
class Letter:
    body: str
    attributes: Mapping[str, str]  # the message's string attributes


@dataclass(frozen=True)
class LetterDecision:
    action: Action
    reason: str  # for HOLD: the last error; otherwise what the evidence was
    wait_s: float = 0.0  # for WAIT: until the backoff has passed


def identity(body: str) -> str:
    """What stays the same across redrives: the body, or an event without its id and time (PutEvents
    gives a re-put event new ones)."""
    try:
        event = json.loads(body)
    except ValueError:
        event = None
    if isinstance(event, dict) and {"source", "detail-type"} <= event.keys():
        body = json.dumps({k: event.get(k) for k in ("source", "detail-type", "detail", "resources")}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()


def backoff_s(redrives: int, policy: RedrivePolicy, key: str) -> float:
    """The wait after the `redrives`-th redrive: base * 2^(n-1), the upper half of it jittered by
    the message's identity, so a burst of dead letters does not come back as one burst."""
    if redrives <= 0:
        return 0.0
    full = policy.backoff_s * 2 ** (redrives - 1)
    return full / 2 + full / 2 * (int(key[:8], 16) / 0xFFFFFFFF)


def last_error(attributes: Mapping[str, str]) -> str:
    """The error AWS attached to the message, if any ("" from SQS, which attaches none)."""
    return "; ".join(f"{name}={attributes[name]}" for name in AWS_ERROR_ATTRIBUTES if attributes.get(name))


def failure_kind(error: str) -> str:
    """transient (throttling, a timeout, a killed or unreachable invocation) or unknown."""
    return "transient" if not error or TRANSIENT.search(error) else "unknown"


def is_tick(body: str) -> bool:
    try:
        event = json.loads(body)
    except ValueError:
        return False
    return isinstance(event, dict) and event.get("source") == "aws.events" \
        and event.get("detail-type") == "Scheduled Event"


def judge(letter: Letter, contract: Callable[[str], None], ledger: Ledger, policy: RedrivePolicy,
          now: float) -> LetterDecision:
    """What to do with one dead letter now (the module docstring gives the order of the evidence)."""
    if letter.attributes.get(VERDICT_ATTRIBUTE) == POISON:
        return LetterDecision(Action.HOLD, letter.attributes.get(ERROR_ATTRIBUTE, "held as poison"))
    try:
        contract(letter.body)
    except (BadMessage, ValidationError, ValueError) as exc:
        return LetterDecision(Action.HOLD, _clip(f"poison: does not match its queue's contract: {exc}"))
    if is_tick(letter.body):
        # Ticks are not counted: each is its own attempt, and a schedule that keeps failing shows
        # as a steady count of dropped ticks (ScheduleTicksDroppedAlarm), not as one poison tick.
        return LetterDecision(Action.DROP, "a schedule's tick: the next tick does its work")
    error = last_error(letter.attributes)
    redrives = ledger.redrives if now - ledger.last_redrive_at <= policy.memory_s else 0
    if redrives >= policy.cap:
        return LetterDecision(Action.HOLD, _clip(
            f"poison: failed again after {redrives} automatic redrives, each after its queue's full retries; "
            f"last error: {error or 'none recorded (SQS keeps no error; see the consumer logs)'}"))
    due = ledger.last_redrive_at + backoff_s(redrives, policy, identity(letter.body)) if redrives else now
    kind = failure_kind(error)
    if now < due:
        return LetterDecision(Action.WAIT, f"{kind}: redrive {redrives + 1} of {policy.cap} after its backoff", due - now)
    return LetterDecision(Action.REDRIVE, f"{kind}: redrive {redrives + 1} of {policy.cap}" + (f" ({error})" if error else ""))


def _clip(reason: str) -> str:
    return reason if len(reason) <= ERROR_MAX_CHARS else reason[:ERROR_MAX_CHARS - 1] + "…"


# --- contracts: each source queue's body, parsed as its consumer parses it ---------------------------

def s3_notification(body: str) -> None:
    """UploadsQueue -> IngestFunction."""
    from core.ingest.uploads import parse_notification
    parse_notification(body)


def sample(body: str) -> None:
    """PackQueue -> PackFunction."""
    from contracts.messages import Sample
    Sample.model_validate_json(body)


def import_shard(body: str) -> None:
    """ImportQueue -> ImportFunction."""
    from contracts.messages import ImportShard
    ImportShard.model_validate_json(body)


def event(body: str) -> None:
    """An EventBridge event (the DLQs of rules' targets and of asynchronous invocations)."""
    try:
        parsed = json.loads(body)
    except ValueError as exc:
        raise BadMessage(f"not JSON: {exc}") from exc
    if not isinstance(parsed, dict) or not isinstance(parsed.get("source"), str) \
            or not isinstance(parsed.get("detail-type"), str) or not isinstance(parsed.get("detail"), dict):
        raise BadMessage("not an EventBridge event (source, detail-type and an object detail)")


CONTRACTS: dict[str, Callable[[str], None]] = {
    "s3-notification": s3_notification, "sample": sample, "import-shard": import_shard, "event": event}
