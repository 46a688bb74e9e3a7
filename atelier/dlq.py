"""Dead-letter queues: find them from the stack's outputs, look inside, replay them safely.

A DLQ of a queue (UploadsDLQ, PackDLQ) is redriven to its source queue: with SQS's
StartMessageMoveTask where the service has it, else one message at a time, each deleted from the
DLQ only after its send succeeded (a crash in between sends it twice: every consumer is
idempotent). A DLQ of EventBridge deliveries (StartTrainingDLQ, DeployDLQ, the schedules' DLQs) holds
events: each is put on the bus again, and deleted only once EventBridge accepted it (a body that is
not an event stays). Every rule matching the event fires again; their functions are idempotent.

This is the person's tool. RedriveFunction (core.redrive.redriver) already empties every DLQ of transient
failures on a schedule and leaves only poison, marked with `atelier.error` (shown by `peek`); a
redrive from here drops those marks but keeps the message's ledger count (`REDRIVE#`), so a message
that fails again after its last automatic redrive is held again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from botocore.exceptions import ClientError

from atelier.client import PipelineError
from core import aws
from core.redrive import dead_letters

OUTPUT_SUFFIX = "DLQUrl"
RECEIVE_MAX = 10
HOLD_S = 60  # a received message stays hidden this long while it is shown or replayed
REDRIVER_MARKS = (dead_letters.VERDICT_ATTRIBUTE, dead_letters.ERROR_ATTRIBUTE, dead_letters.REDRIVES_ATTRIBUTE)


class DlqError(PipelineError):
    """A DLQ that is not in the stack, or a replay that cannot be done."""


@dataclass(frozen=True)
class DeadLetters:
    name: str  # the output name without `Url`, e.g. UploadsDLQ
    url: str
    arn: str
    messages: int
    sources: tuple[str, ...]  # URLs of the queues that dead-letter into it
    hidden: int = 0  # received and not yet visible again: waiting out a backoff, or being read by the redriver


def queues(outputs: dict[str, str]) -> dict[str, str]:
    """`UploadsDLQ` -> URL, for every `*DLQUrl` output of the stack."""
    return {k.removesuffix("Url"): v for k, v in sorted(outputs.items()) if k.endswith(OUTPUT_SUFFIX)}


def describe(name: str, url: str) -> DeadLetters:
    sqs = aws.client("sqs")
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=[
        "QueueArn", "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    sources = sqs.list_dead_letter_source_queues(QueueUrl=url).get("queueUrls", [])
    return DeadLetters(name, url, attributes["QueueArn"], int(attributes["ApproximateNumberOfMessages"]),
                       tuple(sources), int(attributes.get("ApproximateNumberOfMessagesNotVisible", 0)))


def lookup(outputs: dict[str, str], name: str) -> DeadLetters:
    found = queues(outputs)
    if name not in found:
        raise DlqError(f"no dead-letter queue {name!r}; the stack has {sorted(found)}")
    return describe(name, found[name])


def _receive(url: str, limit: int) -> Iterator[dict[str, Any]]:
    """Up to `limit` messages, each hidden for HOLD_S once received (so none comes twice)."""
    seen = 0
    while seen < limit:
        batch = aws.client("sqs").receive_message(
            QueueUrl=url, MaxNumberOfMessages=min(RECEIVE_MAX, limit - seen), VisibilityTimeout=HOLD_S,
            AttributeNames=["All"], MessageAttributeNames=["All"], WaitTimeSeconds=0).get("Messages", [])
        if not batch:
            return
        seen += len(batch)
        yield from batch


def peek(dead: DeadLetters, limit: int) -> list[dict[str, Any]]:
    """Read up to `limit` messages and make them visible again at once (nothing is removed)."""
    messages = list(_receive(dead.url, limit))
    for message in messages:
        aws.client("sqs").change_message_visibility(QueueUrl=dead.url, ReceiptHandle=message["ReceiptHandle"],
                                                    VisibilityTimeout=0)
    return [{"id": m["MessageId"], "receives": int(m.get("Attributes", {}).get("ApproximateReceiveCount", 0)),
             "sent_at": int(m.get("Attributes", {}).get("SentTimestamp", 0)),
             "attributes": {k: v.get("StringValue") for k, v in m.get("MessageAttributes", {}).items()},
             "body": m["Body"]} for m in messages]


@dataclass
class Redriven:
    method: str
    moved: int = 0
    kept: int = 0  # messages left in the DLQ (their replay failed)
    task: str = ""


def redrive(dead: DeadLetters, limit: int, method: str = "auto") -> Redriven:
    """Replay up to `limit` messages to where they came from (see the module docstring)."""
    if len(dead.sources) != 1:
        # No source queue: EventBridge or Lambda's asynchronous invocation put them there (on the
        # local stack, several rules' delivery queues redrive into a function's DLQ).
        return _replay_events(dead, limit)
    source = dead.sources[0]
    if method in ("auto", "move-task"):
        try:
            return _move_task(dead, source)
        except (ClientError, NotImplementedError) as exc:  # moto has no move tasks (in-process: NotImplementedError)
            if method == "move-task":
                raise DlqError(f"StartMessageMoveTask failed: {exc}") from exc
    return _one_by_one(dead, source, limit)


def _move_task(dead: DeadLetters, source_url: str) -> Redriven:
    sqs = aws.client("sqs")
    source_arn = sqs.get_queue_attributes(QueueUrl=source_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    task = sqs.start_message_move_task(SourceArn=dead.arn, DestinationArn=source_arn)
    return Redriven("move-task", moved=dead.messages, task=str(task.get("TaskHandle", "")))


def _one_by_one(dead: DeadLetters, source_url: str, limit: int) -> Redriven:
    sqs, done = aws.client("sqs"), Redriven("one-by-one")
    for message in _receive(dead.url, limit):
        # Without the redriver's marks: a person sends it back to be tried again, not to stay poison.
        attributes = {k: {key: value for key, value in v.items() if key in {"DataType", "StringValue", "BinaryValue"}}
                      for k, v in message.get("MessageAttributes", {}).items() if k not in REDRIVER_MARKS}
        sqs.send_message(QueueUrl=source_url, MessageBody=message["Body"], MessageAttributes=attributes)
        # Only now: a failure above leaves the message in the DLQ (visible again after HOLD_S).
        sqs.delete_message(QueueUrl=dead.url, ReceiptHandle=message["ReceiptHandle"])
        done.moved += 1
    return done


def _replay_events(dead: DeadLetters, limit: int) -> Redriven:
    sqs, done = aws.client("sqs"), Redriven("put-events")
    for message in _receive(dead.url, limit):
        try:
            event = json.loads(message["Body"])
            entry = {"Source": event["source"], "DetailType": event["detail-type"],
                     "Detail": json.dumps(event.get("detail", {})), "Resources": event.get("resources", [])}
        except (ValueError, KeyError, TypeError):
            done.kept += 1  # not an EventBridge event: leave it for a person
            continue
        response = aws.client("events").put_events(Entries=[entry])
        if response.get("FailedEntryCount"):
            done.kept += 1
            continue
        sqs.delete_message(QueueUrl=dead.url, ReceiptHandle=message["ReceiptHandle"])
        done.moved += 1
    return done
