"""SweepFunction under moto: an upload whose notification was lost is re-driven and recorded once."""

from __future__ import annotations

from typing import Any, Callable

import boto3
import pytest

from atelier.local.provision import Provisioned
from atelier.local.runtime import sqs_event
from core import aws
from tests.functions.test_ingest import GREEN, RED, drain, pack_messages, uploads_table

KEY = "partner-a/red one+two.png"  # a space and a literal '+': the re-driven key must decode to the same


@pytest.fixture
def run(stack: Provisioned, partner: str, function_env: Callable, lambda_context: Any, monkeypatch):
    """sweep(): SweepFunction once (grace 0); ingest(): IngestFunction over what UploadsQueue holds."""
    def sweep(grace_s: int = 0, max_queue_depth: int = 1000) -> dict:
        function_env("SweepFunction")
        monkeypatch.setenv("SWEEP_GRACE_S", str(grace_s))
        monkeypatch.setenv("SWEEP_MAX_QUEUE_DEPTH", str(max_queue_depth))
        from sweep.app import lambda_handler
        return lambda_handler({"source": "aws.events", "detail-type": "Scheduled Event"}, lambda_context)

    def ingest() -> list[dict]:
        function_env("IngestFunction")
        from ingest.app import lambda_handler
        source = next(s for s in stack.sources if s.function == "IngestFunction")
        messages = drain(boto3.client("sqs"), stack.outputs["UploadsQueueUrl"])
        return [lambda_handler(sqs_event(messages[i:i + 10], source, "us-east-1"), lambda_context)
                for i in range(0, len(messages), 10)]

    return sweep, ingest


def put(stack: Provisioned, key: str, body: bytes) -> None:
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key=key, Body=body)


def test_an_upload_whose_notification_was_never_sent_is_recorded_once(stack, run) -> None:
    sweep, ingest = run
    # GIVEN the bucket's notification removed, so the upload sends nothing
    boto3.client("s3").put_bucket_notification_configuration(
        Bucket=stack.outputs["UploadsBucketName"], NotificationConfiguration={})
    put(stack, KEY, RED)
    assert ingest() == []
    # WHEN the sweep runs (twice: a sweep repeated before ingest catches up), then ingest
    assert sweep()["redriven"] == [KEY]
    assert sweep()["redriven"] == [KEY]
    assert ingest() == [{"batchItemFailures": []}]
    # THEN the sample is recorded and handed to packing exactly once, and the next sweep is quiet
    assert {k: r["status"] for k, r in uploads_table(stack).items()} == {KEY: "accepted"}
    assert [m["key"] for m in pack_messages(stack)] == [KEY]
    assert sweep()["redriven"] == []


def test_notifications_purged_from_the_queue_are_re_driven(stack, run) -> None:
    sweep, ingest = run
    put(stack, KEY, RED)
    put(stack, "partner-a/green.jpg", GREEN)
    boto3.client("sqs").purge_queue(QueueUrl=stack.outputs["UploadsQueueUrl"])
    assert sorted(sweep()["redriven"]) == sorted([KEY, "partner-a/green.jpg"])
    ingest()
    assert {k: r["status"] for k, r in uploads_table(stack).items()} == {KEY: "accepted", "partner-a/green.jpg": "accepted"}
    assert sorted(m["key"] for m in pack_messages(stack)) == sorted([KEY, "partner-a/green.jpg"])


def test_a_late_notification_and_the_sweep_make_one_record(stack, run) -> None:
    sweep, ingest = run
    put(stack, KEY, RED)  # the real notification is in the queue, not yet consumed
    assert sweep()["redriven"] == [KEY]
    ingest()  # both deliveries
    assert len(uploads_table(stack)) == 1 and [m["key"] for m in pack_messages(stack)] == [KEY]
    assert len(aws.scan_prefix(stack.outputs["PipelineTableName"], "SAMPLE#")) == 1


def test_uploads_within_the_grace_period_are_left_alone_and_sidecars_are_re_driven_too(stack, run) -> None:
    sweep, _ = run
    put(stack, KEY, RED)
    put(stack, "partner-a/red one+two.json", b'{"caption": "red"}')
    assert sweep(grace_s=3600) == {"listed": 0, "redriven": []}
    # a sidecar is an upload too: without a record it is re-driven, so ingest records what it is
    assert sweep(grace_s=0) == {"listed": 2, "redriven": ["partner-a/red one+two.json", KEY]}


def test_a_new_version_of_a_recorded_key_is_re_driven(stack, run) -> None:
    sweep, ingest = run
    put(stack, KEY, RED)
    ingest()
    boto3.client("s3").put_bucket_notification_configuration(
        Bucket=stack.outputs["UploadsBucketName"], NotificationConfiguration={})
    put(stack, KEY, GREEN)  # overwritten; its notification is lost
    assert sweep()["redriven"] == [KEY]


def test_a_sweep_defers_while_ingest_is_behind_and_re_drives_once_it_caught_up(stack, run) -> None:
    sweep, ingest = run
    # GIVEN three uploads whose notifications wait in UploadsQueue (ingest is behind), and one whose
    # notification was lost
    for n in range(3):
        put(stack, f"partner-a/waiting-{n}.png", RED if n % 2 else GREEN)
    boto3.client("s3").put_bucket_notification_configuration(
        Bucket=stack.outputs["UploadsBucketName"], NotificationConfiguration={})
    put(stack, KEY, RED)
    depth = aws.queue_depth(stack.outputs["UploadsQueueUrl"])  # the three, and S3's test event
    assert depth >= 3
    # WHEN the sweep runs with the queue deeper than its limit
    deferred = sweep(max_queue_depth=2)
    # THEN it re-drives nothing (no duplicates added to the backlog) and says why
    assert deferred == {"listed": 0, "redriven": [], "deferred_queue_depth": depth}
    assert aws.queue_depth(stack.outputs["UploadsQueueUrl"]) == depth
    # AND once ingest caught up, the next run re-drives the lost one only
    ingest()
    assert sweep(max_queue_depth=2)["redriven"] == [KEY]
