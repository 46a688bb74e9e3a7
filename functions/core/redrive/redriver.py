"""Empty the DLQs of what a retry can fix, on a schedule; keep the poison, marked with why.

Each run receives every DLQ's messages and acts on core.redrive.dead_letters' verdict:
- redrive: the ledger item is written first (so the cap holds even if the run dies right after),
  then the message goes back (a queue's DLQ: SendMessage to its source queue; an events DLQ:
  PutEvents), and only then is it deleted from the DLQ. A crash in between sends it twice, never
  loses it: every consumer is idempotent.
- wait: hidden in the DLQ until its backoff has passed (ChangeMessageVisibility), so it is neither
  received again each run nor counted as visible by the DLQ's alarm.
- drop: a failed schedule tick is deleted; the next tick does its work.
- hold: poison. The first time, the message is put back into its DLQ with its verdict, last error
  and redrive count as message attributes (`atelier dlq show` prints them) and the unmarked copy
  deleted; it then stays visible, so the DLQ's alarm and PoisonDeadLettersAlarm both see it. Copies
  of one poison message (the same identity) are collapsed into one marked copy.

Not StartMessageMoveTask: it moves a whole DLQ, poison included, and cannot count redrives, so
neither the verdict nor the cap could hold. `atelier dlq redrive` still uses it for a person's
decision to move everything.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from aws_lambda_powertools import Logger
from botocore.exceptions import BotoCoreError, ClientError

from contracts import pipeline_table
from core import aws, telemetry
from core.redrive import dead_letters
from core.redrive.dead_letters import Action, Ledger, LetterDecision, Letter
from core.redrive.settings import DeadLetterQueue, RedriveSettings

logger = Logger(child=True)
RECEIVE_MAX = 10
VISIBILITY_MAX_S = 12 * 3600  # SQS's limit for ChangeMessageVisibility
ATTRIBUTES_MAX = 10  # message attributes SQS allows on one message
OURS = (dead_letters.VERDICT_ATTRIBUTE, dead_letters.ERROR_ATTRIBUTE, dead_letters.REDRIVES_ATTRIBUTE)


@dataclass
class RedriveReport:
    redriven: Counter[str] = field(default_factory=Counter)
    waiting: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    poison: Counter[str] = field(default_factory=Counter)  # distinct poison messages held, by DLQ


def redrive_all(settings: RedriveSettings, hold_s: int, time_left_s: Callable[[], float],
                now: Callable[[], float] = time.time) -> RedriveReport:
    """One run over every DLQ: each received message hidden `hold_s`; no receive once `time_left_s()` <= 0.
    A DLQ that fails (a refused call) does not stop the others; the run then fails with the first error."""
    report, failed = RedriveReport(), []
    for name, queue in settings.queues.items():
        try:
            _one_queue(name, queue, settings, hold_s, time_left_s, now, report)
        except (ClientError, BotoCoreError) as exc:
            logger.exception("a DLQ could not be redriven", extra={"queue": name})
            failed.append(exc)
    telemetry.count(telemetry.DEAD_LETTERS_REDRIVEN, sum(report.redriven.values()))
    telemetry.count(telemetry.POISON_MESSAGES, sum(report.poison.values()))
    telemetry.count(telemetry.SCHEDULE_TICKS_DROPPED, sum(report.dropped.values()))
    if failed:
        raise failed[0]
    return report


def _one_queue(name: str, queue: DeadLetterQueue, settings: RedriveSettings, hold_s: int,
               time_left_s: Callable[[], float], now: Callable[[], float], report: RedriveReport) -> None:
    sqs = aws.client("sqs")
    contract = dead_letters.CONTRACTS[queue.contract]
    url = sqs.get_queue_url(QueueName=queue.name)["QueueUrl"]
    source_url = sqs.get_queue_url(QueueName=queue.source)["QueueUrl"] if queue.source else ""
    poison: dict[str, list[tuple[dict[str, Any], LetterDecision, Ledger]]] = {}  # by identity
    # Poison ones stay hidden until every message was seen: a marked copy is sent after the loop.
    while time_left_s() > 0:
        batch = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=RECEIVE_MAX, VisibilityTimeout=hold_s,
                                    AttributeNames=["All"], MessageAttributeNames=["All"],
                                    WaitTimeSeconds=0).get("Messages", [])
        if not batch:
            break
        keys = {m["MessageId"]: dead_letters.identity(m["Body"]) for m in batch}
        ledgers = aws.batch_get_items(settings.table, sorted({pipeline_table.redrive_pk(name, k) for k in keys.values()}))
        for message in batch:
            key = keys[message["MessageId"]]
            found = ledgers.get(pipeline_table.redrive_pk(name, key), {})
            ledger = Ledger(int(found.get("redrives", 0)), float(found.get("last_redrive_at", 0)))
            at = now()
            decision = dead_letters.judge(Letter(message["Body"], _strings(message)), contract, ledger,
                                          settings.policy, at)
            if decision.action is Action.HOLD:
                poison.setdefault(key, []).append((message, decision, ledger))
                continue
            _act(name, (url, source_url), settings, message, key, ledger, decision, at)
            getattr(report, {Action.REDRIVE: "redriven", Action.WAIT: "waiting",
                             Action.DROP: "dropped"}[decision.action])[name] += 1
    for key, copies in poison.items():
        _hold(name, url, key, copies)
    if poison:
        report.poison[name] = len(poison)
        logger.warning("poison messages held", extra={"queue": name, "count": len(poison)})


def _hold(name: str, url: str, key: str, copies: list[tuple[dict[str, Any], LetterDecision, Ledger]]) -> None:
    """Leave exactly one marked, visible copy of a poison message. A run that died between marking a
    copy and deleting the unmarked one left both: the extra copies (same identity) are deleted."""
    sqs = aws.client("sqs")
    marked = [c for c in copies if _strings(c[0]).get(dead_letters.VERDICT_ATTRIBUTE) == dead_letters.POISON]
    if marked:
        kept = marked[0][0]
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=kept["ReceiptHandle"], VisibilityTimeout=0)
    else:
        kept, decision, ledger = copies[0]
        marks = {dead_letters.VERDICT_ATTRIBUTE: dead_letters.POISON, dead_letters.ERROR_ATTRIBUTE: decision.reason,
                 dead_letters.REDRIVES_ATTRIBUTE: str(ledger.redrives)}
        sqs.send_message(QueueUrl=url, MessageBody=kept["Body"], MessageAttributes=_attributes(kept, marks))
        logger.error("dead letter held as poison", extra={"queue": name, "message_id": kept["MessageId"],
                                                         "identity": key, "reason": decision.reason})
        kept = None  # the marked copy replaces it
    for message, _, _ in copies:
        if message is not kept:
            sqs.delete_message(QueueUrl=url, ReceiptHandle=message["ReceiptHandle"])


def _act(name: str, urls: tuple[str, str], settings: RedriveSettings, message: dict[str, Any], key: str,
         ledger: Ledger, decision: LetterDecision, at: float) -> None:
    (url, source_url), sqs, receipt = urls, aws.client("sqs"), message["ReceiptHandle"]
    if decision.action is Action.WAIT:
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=receipt,
                                      VisibilityTimeout=min(VISIBILITY_MAX_S, max(1, int(decision.wait_s) + 1)))
        return
    if decision.action is Action.REDRIVE:
        aws.put_item(settings.table, {"pk": pipeline_table.redrive_pk(name, key), "kind": "redrive", "queue": name,
                                      "redrives": ledger.redrives + 1, "last_redrive_at": int(at),
                                      "reason": decision.reason})
        if source_url:
            sqs.send_message(QueueUrl=source_url, MessageBody=message["Body"],
                             MessageAttributes=_attributes(message, {}))
        else:
            _put_event(settings.event_bus, message["Body"])
        logger.info("dead letter redriven", extra={"queue": name, "message_id": message["MessageId"],
                                                   "reason": decision.reason})
    sqs.delete_message(QueueUrl=url, ReceiptHandle=receipt)  # only now: what came before succeeded


def _put_event(bus: str, body: str) -> None:
    event = json.loads(body)  # the event contract held (core.redrive.dead_letters.event)
    entry = {"EventBusName": bus, "Source": event["source"], "DetailType": event["detail-type"],
             "Detail": json.dumps(event["detail"]), "Resources": event.get("resources", [])}
    response = aws.client("events").put_events(Entries=[entry])
    if response.get("FailedEntryCount"):
        raise RuntimeError(f"EventBridge refused the event again: {response['Entries']}")


def _strings(message: dict[str, Any]) -> dict[str, str]:
    return {k: v["StringValue"] for k, v in message.get("MessageAttributes", {}).items() if "StringValue" in v}


def _attributes(message: dict[str, Any], marks: dict[str, str]) -> dict[str, Any]:
    """The message's own attributes, then ours (within SQS's ten): ours replace earlier marks."""
    kept = {k: {f: v[f] for f in ("DataType", "StringValue", "BinaryValue") if f in v}
            for k, v in message.get("MessageAttributes", {}).items() if k not in OURS}
    kept = dict(list(kept.items())[:ATTRIBUTES_MAX - len(marks)])
    return {**kept, **{k: {"DataType": "String", "StringValue": v} for k, v in marks.items()}}
