"""The local runtime delivers SQS and EventBridge events as the Lambda service does."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

from atelier.local.provision import EventSource, FunctionSpec
from atelier.local.runtime import LambdaTimeout, Poller, failed_ids, invoke

REGION, ACCOUNT = "us-east-1", "123456789012"


@pytest.fixture
def sqs() -> Iterator[Any]:
    with mock_aws():
        yield boto3.client("sqs", region_name=REGION)


def make_queue(sqs: Any, name: str, visibility: int = 1, max_receive: int = 2) -> tuple[str, str, str]:
    """A queue with a DLQ: (queue url, queue arn, dlq url)."""
    dlq = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
    dlq_arn = sqs.get_queue_attributes(QueueUrl=dlq, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    url = sqs.create_queue(QueueName=name, Attributes={
        "VisibilityTimeout": str(visibility),
        "RedrivePolicy": json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": max_receive})})["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    return url, arn, dlq


def spec(timeout_s: int = 5) -> FunctionSpec:
    return FunctionSpec(logical_id="Fn", name="atelier-Fn", handler="x.handler", code_dir=Path("."),
                        environment={}, timeout_s=timeout_s, memory_mb=128)


def bodies(sqs: Any, url: str) -> list[str]:
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
    return sorted(m["Body"] for m in messages)


class Recorder:
    """A handler that records its events and fails the records whose body is in `fail`."""

    def __init__(self, fail: set[str] = frozenset(), raise_error: bool = False, sleep_s: float = 0.0):
        self.events: list[dict] = []
        self.fail, self.raise_error, self.sleep_s = fail, raise_error, sleep_s

    def __call__(self, event: dict, context: Any) -> dict:
        self.events.append(event)
        assert context.get_remaining_time_in_millis() > 0
        time.sleep(self.sleep_s)
        if self.raise_error:
            raise RuntimeError("boom")
        return {"batchItemFailures": [{"itemIdentifier": r["messageId"]} for r in event.get("Records", [])
                                      if r["body"] in self.fail]}


def test_sqs_batch_reports_partial_failures_and_redelivers_only_those(sqs: Any) -> None:
    # GIVEN three messages and a handler that fails one of them
    url, arn, dlq = make_queue(sqs, "q")
    for body in ("a", "b", "c"):
        sqs.send_message(QueueUrl=url, MessageBody=body)
    handler = Recorder(fail={"b"})
    source = EventSource("Fn", "sqs", url, arn, batch_size=10, window_s=0, report_batch_item_failures=True)
    poller = Poller(source, spec(), handler, sqs, REGION, ACCOUNT, wait_s=0)
    # WHEN the runtime delivers one batch
    assert poller.poll_once() == 3
    # THEN the handler saw a real SQS event, and only the failed message comes back
    records = handler.events[0]["Records"]
    assert sorted(r["body"] for r in records) == ["a", "b", "c"]
    assert {r["eventSource"] for r in records} == {"aws:sqs"} and records[0]["eventSourceARN"] == arn
    assert records[0]["attributes"]["ApproximateReceiveCount"] == "1"
    time.sleep(1.1)  # the visibility timeout
    assert bodies(sqs, url) == ["b"]


def test_sqs_handler_error_returns_the_whole_batch_and_logs_its_traceback(sqs: Any,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    url, arn, _ = make_queue(sqs, "q")
    for body in ("a", "b"):
        sqs.send_message(QueueUrl=url, MessageBody=body)
    source = EventSource("Fn", "sqs", url, arn, batch_size=10, report_batch_item_failures=True)
    Poller(source, spec(), Recorder(raise_error=True), sqs, REGION, ACCOUNT, wait_s=0).poll_once()
    time.sleep(1.1)
    assert bodies(sqs, url) == ["a", "b"]
    # as Lambda's runtime writes an unhandled error's stack trace to the function's log
    [failure] = [r for r in caplog.records if "failed on a batch" in r.getMessage()]
    assert failure.exc_info is not None and failure.exc_info[0] is RuntimeError
    assert "in __call__" in caplog.text  # the handler's frame


def test_sqs_timeout_fails_the_batch_even_if_the_handler_catches_exceptions(sqs: Any) -> None:
    url, arn, _ = make_queue(sqs, "q")
    sqs.send_message(QueueUrl=url, MessageBody="slow")

    def swallowing_handler(event: dict, context: Any) -> dict:
        try:
            time.sleep(3)
        except Exception:  # a Lambda timeout cannot be caught like this
            return {"batchItemFailures": []}
        return {"batchItemFailures": []}

    source = EventSource("Fn", "sqs", url, arn, batch_size=10, report_batch_item_failures=True)
    started = time.monotonic()
    Poller(source, spec(timeout_s=1), swallowing_handler, sqs, REGION, ACCOUNT, wait_s=0).poll_once()
    assert time.monotonic() - started < 2.5
    time.sleep(1.1)
    assert bodies(sqs, url) == ["slow"]


def test_failures_end_in_the_dlq_after_max_receive_count(sqs: Any) -> None:
    url, arn, dlq = make_queue(sqs, "q", visibility=1, max_receive=2)
    sqs.send_message(QueueUrl=url, MessageBody="poison")
    source = EventSource("Fn", "sqs", url, arn, batch_size=10, report_batch_item_failures=True)
    poller = Poller(source, spec(), Recorder(fail={"poison"}), sqs, REGION, ACCOUNT, wait_s=0)
    delivered = 0
    for _ in range(4):
        delivered += poller.poll_once()
        time.sleep(1.1)
    assert delivered == 2
    assert bodies(sqs, dlq) == ["poison"]


def test_batch_size_and_window_gather_messages_into_one_invocation(sqs: Any) -> None:
    url, arn, _ = make_queue(sqs, "q", visibility=30)
    for i in range(15):
        sqs.send_message(QueueUrl=url, MessageBody=str(i))
    handler = Recorder()
    source = EventSource("Fn", "sqs", url, arn, batch_size=12, window_s=1, report_batch_item_failures=True)
    poller = Poller(source, spec(), handler, sqs, REGION, ACCOUNT, wait_s=0)
    assert poller.poll_once() == 12  # more than one receive (10 at most), within the window
    assert poller.poll_once() == 3
    assert [len(e["Records"]) for e in handler.events] == [12, 3]
    assert bodies(sqs, url) == []


def test_without_report_batch_item_failures_a_partial_response_is_ignored(sqs: Any) -> None:
    url, arn, _ = make_queue(sqs, "q")
    sqs.send_message(QueueUrl=url, MessageBody="a")
    source = EventSource("Fn", "sqs", url, arn, batch_size=10, report_batch_item_failures=False)
    Poller(source, spec(), Recorder(fail={"a"}), sqs, REGION, ACCOUNT, wait_s=0).poll_once()
    time.sleep(1.1)
    assert bodies(sqs, url) == []  # Lambda reads the response only when the mapping asks for it


def test_eventbridge_events_are_delivered_one_by_one_and_retried(sqs: Any) -> None:
    url, arn, dlq = make_queue(sqs, "rule-delivery", visibility=1, max_receive=3)
    event = {"version": "0", "id": "1", "detail-type": "Shard Sealed", "source": "atelier.pack", "detail": {"n": 1}}
    sqs.send_message(QueueUrl=url, MessageBody=json.dumps(event))
    calls: list[dict] = []

    def flaky(e: dict, context: Any) -> None:
        calls.append(e)
        if len(calls) == 1:
            raise RuntimeError("first delivery fails")

    poller = Poller(EventSource("Fn", "eventbridge", url, arn), spec(), flaky, sqs, REGION, ACCOUNT, wait_s=0)
    poller.poll_once()
    time.sleep(1.1)
    poller.poll_once()
    assert calls == [event, event]  # the event itself, not an SQS envelope
    assert bodies(sqs, url) == [] and bodies(sqs, dlq) == []


def test_unknown_item_identifier_fails_the_whole_batch() -> None:
    assert failed_ids({"batchItemFailures": [{"itemIdentifier": "zzz"}]}, {"a", "b"}) == {"a", "b"}
    assert failed_ids({"batchItemFailures": [{"itemIdentifier": "a"}]}, {"a", "b"}) == {"a"}
    assert failed_ids({"batchItemFailures": []}, {"a"}) == set()
    assert failed_ids(None, {"a"}) == set()


def test_invoke_raises_lambda_timeout_past_the_function_timeout() -> None:
    with pytest.raises(LambdaTimeout, match="Task timed out after 1.00 seconds"):
        invoke(lambda e, c: time.sleep(3), {}, spec(timeout_s=1), REGION, ACCOUNT)


def test_a_scheduled_rule_fires_its_function_with_a_scheduled_event(sqs: Any) -> None:
    url, arn, _ = make_queue(sqs, "schedule-delivery", visibility=5)
    source = EventSource("Fn", "eventbridge", url, arn, schedule_s=60, rule_arn="arn:aws:events:us-east-1:1:rule/r")
    calls: list[dict] = []
    poller = Poller(source, spec(), lambda e, c: calls.append(e), sqs, REGION, ACCOUNT, wait_s=0,
                    schedule_scale=1 / 120)  # every 0.5 s instead of every minute
    poller.poll_once()
    assert calls == []  # not before the first period has passed
    time.sleep(0.6)
    poller.poll_once()
    assert [(c["detail-type"], c["source"], c["resources"]) for c in calls] == [
        ("Scheduled Event", "aws.events", ["arn:aws:events:us-east-1:1:rule/r"])]


@pytest.mark.parametrize("expression, seconds", [("rate(1 minute)", 60), ("rate(5 minutes)", 300), ("rate(2 hours)", 7200)])
def test_rate_expressions_become_periods(expression: str, seconds: int) -> None:
    from atelier.local.provision import _rate_seconds
    assert _rate_seconds(expression) == seconds


def test_cron_schedules_are_refused_with_a_reason() -> None:
    from atelier.local.provision import _rate_seconds
    from atelier.local.template import TemplateError
    with pytest.raises(TemplateError, match="only rate"):
        _rate_seconds("cron(0 12 * * ? *)")


def test_a_function_environment_over_lambdas_4_kb_is_refused_as_aws_refuses_the_deploy() -> None:
    from atelier.local.provision import lambda_environment
    from atelier.local.template import TemplateError

    # Lambda measures the variables' compact JSON: {"A":"<4088 x>"} is 4096 bytes, one more is over
    assert lambda_environment("F", {"A": "x" * 4088}) == {"A": "x" * 4088}
    with pytest.raises(TemplateError, match=r"^F: Lambda was unable .* exceeded the 4KB limit \(4097 bytes\)"):
        lambda_environment("F", {"A": "x" * 4089})
    assert lambda_environment("F", {"N": 3, "B": True}) == {"N": "3", "B": "True"}


def test_every_function_of_the_template_is_within_lambdas_environment_quota(stack: Any) -> None:
    from atelier.local.provision import LAMBDA_ENVIRONMENT_BYTES

    sizes = {name: len(json.dumps(spec.environment, separators=(",", ":"))) for name, spec in stack.functions.items()}
    # the template's defaults leave every function room for long parameter values
    assert max(sizes.values()) <= LAMBDA_ENVIRONMENT_BYTES // 2, sizes


def test_workers_per_function_follow_lambda_concurrency_limits(stack: Any) -> None:
    """As many worker processes as Lambda would run at once, capped locally: an SQS mapping's
    MaximumConcurrency and a function's reserved concurrency bound it; rule-only functions get one."""
    from atelier.local.stack import instances, worker_name

    pack = [s for s in stack.sources if s.function == "PackFunction" and s.kind == "sqs"]
    assert [s.max_concurrency for s in pack] == [2]  # template.yaml's ScalingConfig
    assert stack.functions["StartTrainingFunction"].reserved_concurrency == 1
    counts = {fn: instances(stack, fn, 4) for fn in sorted({s.function for s in stack.sources})}
    assert counts["IngestFunction"] == 4  # no MaximumConcurrency: the local cap
    assert counts["PackFunction"] == 2
    assert counts["StartTrainingFunction"] == counts["SweepFunction"] == counts["RedriveFunction"] == 1
    assert counts["DeployFunction"] == 1  # EventBridge rules only
    assert instances(stack, "IngestFunction", 1) == 1
    assert [worker_name("IngestFunction", i) for i in range(3)] == ["IngestFunction", "IngestFunction-2",
                                                                     "IngestFunction-3"]


def test_a_long_poll_never_outlasts_the_next_scheduled_fire(sqs: Any) -> None:
    url, arn, _ = make_queue(sqs, "sched-wait")
    source = EventSource(function="Fn", kind="eventbridge", queue_url=url, queue_arn=arn, schedule_s=3,
                         rule_arn="arn:aws:events:us-east-1:123456789012:rule/r")
    recorder = Recorder()
    poller = Poller(source, spec(), recorder, sqs, REGION, ACCOUNT, wait_s=20)
    started = time.monotonic()
    while not recorder.events and time.monotonic() - started < 10:
        poller.poll_once()
    assert recorder.events and recorder.events[0]["detail-type"] == "Scheduled Event"
    assert time.monotonic() - started < 6  # fired at 3 s, not after a 20 s wait
    assert not poller.delivering
