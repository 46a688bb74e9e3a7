"""Deliver queued events to handlers as the Lambda service does.

SQS event source mappings: gather up to BatchSize messages within MaximumBatchingWindow, invoke
once with a real SQS event, delete what succeeded, leave failures to the queue's visibility
timeout and redrive policy (so the DLQ works as on AWS). With ReportBatchItemFailures only the
listed items fail; a handler error, a timeout or an unknown item id fails the whole batch.

EventBridge rules (through their delivery queue, see provision.py): one event per invocation;
a failure is retried after the visibility timeout and goes to the function's DLQ after its
retries, as Lambda's asynchronous invocation does.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from atelier.local.chaos import Chaos
from atelier.local.provision import EventSource, FunctionSpec

log = logging.getLogger("atelier.local.runtime")
SQS_RECEIVE_MAX = 10


class LambdaTimeout(BaseException):
    """Raised in the handler when its timeout passes; a BaseException so handlers cannot swallow it."""


@dataclass
class LambdaContext:
    function_name: str
    memory_limit_in_mb: int
    invoked_function_arn: str
    aws_request_id: str
    deadline: float
    function_version: str = "$LATEST"

    @property
    def log_group_name(self) -> str:
        return f"/aws/lambda/{self.function_name}"

    @property
    def log_stream_name(self) -> str:
        return f"local/{self.aws_request_id}"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self.deadline - time.monotonic()) * 1000))


def load_handler(spec: FunctionSpec) -> Callable[[dict, Any], Any]:
    """Import `module.function` from the function's code folder, as the Python runtime does."""
    if str(spec.code_dir) not in sys.path:
        sys.path.insert(0, str(spec.code_dir))
    module_name, function_name = spec.handler.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), function_name)


def invoke(handler: Callable[[dict, Any], Any], event: dict, spec: FunctionSpec, region: str, account: str) -> Any:
    """Call the handler with a Lambda-like context; raise LambdaTimeout past the function's timeout."""
    context = LambdaContext(
        function_name=spec.name, memory_limit_in_mb=spec.memory_mb,
        invoked_function_arn=f"arn:aws:lambda:{region}:{account}:function:{spec.name}",
        aws_request_id=str(uuid.uuid4()), deadline=time.monotonic() + spec.timeout_s,
    )

    def on_timeout(signum: int, frame: Any) -> None:
        raise LambdaTimeout(f"Task timed out after {spec.timeout_s:.2f} seconds")

    previous = signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, spec.timeout_s)
    try:
        return handler(event, context)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def sqs_event(messages: list[dict[str, Any]], source: EventSource, region: str) -> dict[str, Any]:
    """The event Lambda builds from received SQS messages."""
    return {"Records": [{
        "messageId": m["MessageId"],
        "receiptHandle": m["ReceiptHandle"],
        "body": m["Body"],
        "attributes": m.get("Attributes", {}),
        "messageAttributes": {
            k: {"stringValue": v.get("StringValue"), "binaryValue": v.get("BinaryValue"),
                "stringListValues": [], "binaryListValues": [], "dataType": v["DataType"]}
            for k, v in m.get("MessageAttributes", {}).items()
        },
        "md5OfBody": m["MD5OfBody"],
        "eventSource": "aws:sqs",
        "eventSourceARN": source.queue_arn,
        "awsRegion": region,
    } for m in messages]}


def failed_ids(response: Any, message_ids: set[str]) -> set[str]:
    """Which messages failed, read as Lambda reads a partial batch response."""
    if not isinstance(response, dict) or not response.get("batchItemFailures"):
        return set()
    ids = {str(f.get("itemIdentifier", "")) for f in response["batchItemFailures"] if isinstance(f, dict)}
    return ids if ids <= message_ids else set(message_ids)  # an unknown id fails the whole batch


class Poller:
    """Polls one event source for one function, in the calling (main) thread."""

    def __init__(self, source: EventSource, spec: FunctionSpec, handler: Callable[[dict, Any], Any],
                 sqs: Any, region: str, account: str, wait_s: int = 1, schedule_scale: float = 1.0,
                 chaos: Chaos | None = None) -> None:
        self.source, self.spec, self.handler = source, spec, handler
        self.sqs, self.region, self.account, self.wait_s = sqs, region, account, wait_s
        self.chaos = chaos  # opt-in delivery faults (atelier/local/chaos.py); None: Lambda's behaviour
        self.schedule_every = source.schedule_s * schedule_scale
        self.next_fire = time.monotonic() + self.schedule_every
        self.delivering = False  # inside a delivery (its invocation and its deletes): a stop waits for it

    def poll_once(self) -> int:
        """Receive and deliver what is there; return how many messages were received."""
        if self.source.schedule_s and time.monotonic() >= self.next_fire:
            self._fire_schedule()
        count = SQS_RECEIVE_MAX if self.source.kind == "eventbridge" else min(SQS_RECEIVE_MAX, self.source.batch_size)
        messages = self._receive(count, self._first_wait())
        if not messages:
            return 0
        self.delivering = True  # from here on, a stop waits: these messages are this worker's to finish
        try:
            if self.source.kind == "eventbridge":
                for message in messages:
                    self._deliver_event(message)
            else:
                messages = self._gather_batch(messages)
                self._deliver_batch(messages)
        finally:
            self.delivering = False
        return len(messages)

    def _first_wait(self) -> int:
        """The first receive's wait: no longer than until this source's schedule next fires."""
        if not self.source.schedule_s:
            return self.wait_s
        return max(0, min(self.wait_s, math.ceil(self.next_fire - time.monotonic())))

    def _fire_schedule(self) -> None:
        """Put the event EventBridge Scheduler would on the rule's delivery queue."""
        self.next_fire = time.monotonic() + self.schedule_every
        event = {"version": "0", "id": str(uuid.uuid4()), "detail-type": "Scheduled Event",
                 "source": "aws.events", "account": self.account, "region": self.region,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "resources": [self.source.rule_arn], "detail": {}}
        self.sqs.send_message(QueueUrl=self.source.queue_url, MessageBody=json.dumps(event))

    def _receive(self, count: int, wait_s: int) -> list[dict[str, Any]]:
        return self.sqs.receive_message(
            QueueUrl=self.source.queue_url, MaxNumberOfMessages=count, WaitTimeSeconds=wait_s,
            AttributeNames=["All"], MessageAttributeNames=["All"],
        ).get("Messages", [])

    def _gather_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Up to BatchSize messages: keep gathering while the batching window is open."""
        window_ends = time.monotonic() + self.source.window_s
        while len(batch) < self.source.batch_size and time.monotonic() < window_ends:
            wait = max(0, min(self.wait_s, int(window_ends - time.monotonic())))
            batch += self._receive(min(SQS_RECEIVE_MAX, self.source.batch_size - len(batch)), wait)
        return batch

    def _deliver_batch(self, messages: list[dict[str, Any]]) -> None:
        if self.chaos is not None:
            messages = self.chaos.perturb(messages, self._send_copy)
            if self.chaos.deliver_twice():
                self._invoke_ignoring_outcome(sqs_event(messages, self.source, self.region))
        ids = {m["MessageId"] for m in messages}
        try:
            response = invoke(self.handler, sqs_event(messages, self.source, self.region), self.spec,
                              self.region, self.account)
            failed = failed_ids(response, ids) if self.source.report_batch_item_failures else set()
        except (Exception, LambdaTimeout) as exc:
            log.error("%s failed on a batch of %d: %s", self.spec.logical_id, len(messages), exc, exc_info=exc)
            failed = ids
        done = [m for m in messages if m["MessageId"] not in failed]
        if self.chaos is not None and self.chaos.lose_delete():
            done = []
        self._delete(done)
        if failed:
            log.warning("%s: %d of %d messages returned to the queue", self.spec.logical_id, len(failed), len(ids))

    def _deliver_event(self, message: dict[str, Any]) -> None:
        if self.chaos is not None:
            self.chaos.perturb([message], self._send_copy)
            if self.chaos.deliver_twice():
                self._invoke_ignoring_outcome(json.loads(message["Body"]))
        try:
            invoke(self.handler, json.loads(message["Body"]), self.spec, self.region, self.account)
        except (Exception, LambdaTimeout) as exc:
            log.error("%s failed on event %s: %s (retried after the visibility timeout)",
                      self.spec.logical_id, message["MessageId"], exc, exc_info=exc)
            return
        if self.chaos is not None and self.chaos.lose_delete():
            return
        self._delete([message])

    def _invoke_ignoring_outcome(self, event: dict[str, Any]) -> None:
        """An extra delivery (chaos): whatever it does, the real one follows."""
        try:
            invoke(self.handler, event, self.spec, self.region, self.account)
        except (Exception, LambdaTimeout) as exc:
            log.error("%s failed on a repeated delivery: %s", self.spec.logical_id, exc, exc_info=exc)

    def _send_copy(self, message: dict[str, Any], delay_s: int) -> None:
        """The message once more, as a second notification of the same thing would arrive (chaos)."""
        self.sqs.send_message(QueueUrl=self.source.queue_url, MessageBody=message["Body"], DelaySeconds=delay_s)

    def _delete(self, messages: list[dict[str, Any]]) -> None:
        for start in range(0, len(messages), SQS_RECEIVE_MAX):
            chunk = messages[start:start + SQS_RECEIVE_MAX]
            self.sqs.delete_message_batch(QueueUrl=self.source.queue_url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(chunk)])
