"""`atelier dlq` under moto: dead letters listed, shown without being removed, replayed safely."""

from __future__ import annotations

import json

import boto3
import pytest

from atelier import cli, dlq
from atelier.local.provision import Provisioned
from tests.functions.test_audit import register_outputs


@pytest.fixture
def outputs(stack: Provisioned) -> dict[str, str]:
    register_outputs(stack)
    boto3.client("sqs").purge_queue(QueueUrl=stack.outputs["UploadsQueueUrl"])  # moto's s3:TestEvent
    return stack.outputs


def dead_letter(outputs: dict[str, str], body: str) -> None:
    """Send to UploadsQueue and fail it five times (maxReceiveCount): moto moves it to UploadsDLQ."""
    sqs = boto3.client("sqs")
    sqs.send_message(QueueUrl=outputs["UploadsQueueUrl"], MessageBody=body)
    for _ in range(6):
        sqs.receive_message(QueueUrl=outputs["UploadsQueueUrl"], VisibilityTimeout=0)


def bodies(url: str) -> list[str]:
    sqs, found = boto3.client("sqs"), []
    while batch := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=30).get("Messages"):
        found += [m["Body"] for m in batch]
    return found


def test_list_shows_every_dlq_with_its_count_and_source(outputs, capsys) -> None:
    dead_letter(outputs, "one")
    assert cli.main(["dlq", "list", "--json"]) == 0
    listed = {d["name"]: (d["messages"], [u.rsplit("/", 1)[-1] for u in d["sources"]])
              for d in json.loads(capsys.readouterr().out)}
    assert listed["UploadsDLQ"] == (1, ["atelier-UploadsQueue"])
    assert listed["DeployDLQ"][0] == 0
    assert {"UploadsDLQ", "PackDLQ", "StartTrainingDLQ", "DeployDLQ", "PackScheduleDLQ", "SweepScheduleDLQ",
            "StartTrainingScheduleDLQ"} <= set(listed)


def test_show_leaves_the_messages_in_place(outputs, capsys) -> None:
    dead_letter(outputs, '{"Records": []}')
    assert cli.main(["dlq", "show", "UploadsDLQ", "--json"]) == 0
    assert [m["body"] for m in json.loads(capsys.readouterr().out)] == ['{"Records": []}']
    assert bodies(outputs["UploadsDLQUrl"]) == ['{"Records": []}']


def test_redrive_moves_every_message_back_to_its_source_queue(outputs, capsys) -> None:
    for n in range(12):
        dead_letter(outputs, f"message {n}")
    assert cli.main(["dlq", "redrive", "UploadsDLQ"]) == 0
    assert "12 messages replayed (one-by-one)" in capsys.readouterr().out
    assert sorted(bodies(outputs["UploadsQueueUrl"])) == sorted(f"message {n}" for n in range(12))
    assert bodies(outputs["UploadsDLQUrl"]) == []


def test_a_failed_send_deletes_nothing(outputs, monkeypatch) -> None:
    dead_letter(outputs, "keep me")
    real = dlq.aws.client

    class Failing:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            if name == "send_message":
                raise ConnectionError("SQS is unreachable")
            return getattr(self.inner, name)

    dead = dlq.lookup(outputs, "UploadsDLQ")
    with monkeypatch.context() as patch, pytest.raises(ConnectionError):
        patch.setattr(dlq.aws, "client", lambda service: Failing(real(service)))
        dlq.redrive(dead, 10, "one-by-one")
    # still there (hidden for HOLD_S by the failed attempt, then visible again), and not sent
    attributes = boto3.client("sqs").get_queue_attributes(
        QueueUrl=outputs["UploadsDLQUrl"], AttributeNames=["ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert attributes["ApproximateNumberOfMessagesNotVisible"] == "1"
    assert bodies(outputs["UploadsQueueUrl"]) == []


def test_event_dead_letters_are_put_back_on_the_bus(outputs, capsys) -> None:
    # GIVEN a Shard Sealed event that StartTrainingFunction failed (its DLQ holds the event itself)
    event = {"version": "0", "id": "1", "source": "atelier.pack", "detail-type": "Shard Sealed",
             "resources": [], "detail": {"shard_id": "shard-1"}}
    boto3.client("sqs").send_message(QueueUrl=outputs["StartTrainingDLQUrl"], MessageBody=json.dumps(event))
    boto3.client("sqs").send_message(QueueUrl=outputs["StartTrainingDLQUrl"], MessageBody="not an event")
    # WHEN it is redriven
    assert cli.main(["dlq", "redrive", "StartTrainingDLQ"]) == 1  # one message could not be replayed
    assert "1 messages replayed (put-events); 1 kept" in capsys.readouterr().out
    # THEN the rule delivered it again to the function's delivery queue
    source = next(s for s in outputs_sources(outputs) if "ShardSealed" in s)
    assert [json.loads(b)["detail"] for b in bodies(source)] == [{"shard_id": "shard-1"}]


def outputs_sources(outputs: dict[str, str]) -> list[str]:
    return boto3.client("sqs").list_queues(QueueNamePrefix="atelier-StartTrainingFunctionShardSealed")["QueueUrls"]


# --- RedriveFunction: dead letters that empty themselves (core.redrive.redriver, core.redrive.dead_letters) ---------

NOTIFICATION = json.dumps({"Records": [{"eventName": "ObjectCreated:Put", "s3": {
    "bucket": {"name": "uploads"}, "object": {"key": "partner/a.png", "size": 3, "eTag": "abc"}}}]})


@pytest.fixture
def redrive(outputs, function_env, lambda_context, monkeypatch):
    """Run RedriveFunction's handler once with the template's environment (`backoff` overrides its base)."""
    def run(backoff: int | None = None) -> dict:
        function_env("RedriveFunction")
        if backoff is not None:
            monkeypatch.setenv("DEAD_LETTER_BACKOFF_S", str(backoff))
        from redrive import app
        return app.lambda_handler({"source": "aws.events", "detail-type": "Scheduled Event", "detail": {}},
                                  lambda_context)
    return run


def counts(url: str) -> tuple[int, int]:
    """(visible, hidden) messages of a queue."""
    attributes = boto3.client("sqs").get_queue_attributes(QueueUrl=url, AttributeNames=[
        "ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"])


def held(url: str) -> list[tuple[str, dict[str, str]]]:
    """Bodies and string attributes of a DLQ's messages, released again at once."""
    sqs, found = boto3.client("sqs"), []
    messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=30,
                                   MessageAttributeNames=["All"]).get("Messages", [])
    for m in messages:
        found.append((m["Body"], {k: v["StringValue"] for k, v in m.get("MessageAttributes", {}).items()}))
        sqs.change_message_visibility(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0)
    return found


def test_a_transient_dead_letter_goes_back_to_its_queue_and_is_counted(outputs, redrive) -> None:
    dead_letter(outputs, NOTIFICATION)

    assert redrive()["redriven"] == {"UploadsDLQ": 1}

    assert bodies(outputs["UploadsQueueUrl"]) == [NOTIFICATION]
    assert counts(outputs["UploadsDLQUrl"]) == (0, 0)
    from contracts import pipeline_table
    from core import aws
    from core.redrive import dead_letters
    ledger = aws.get_item(outputs["PipelineTableName"], pipeline_table.redrive_pk("UploadsDLQ", dead_letters.identity(NOTIFICATION)))
    assert (ledger["redrives"], ledger["reason"]) == (1, "transient: redrive 1 of 3")


def test_a_body_its_consumer_cannot_parse_stays_marked_with_its_error(outputs, redrive) -> None:
    # GIVEN an UploadsQueue message ingest can never parse, dead-lettered after its five receives
    dead_letter(outputs, "not an S3 notification")
    # WHEN the redriver runs twice
    first, second = redrive(), redrive()
    # THEN it is held, visible, marked once with why, and counted as poison on both runs
    assert first["poison"] == second["poison"] == {"UploadsDLQ": 1}
    assert first["redriven"] == second["redriven"] == {}
    ((body, attributes),) = held(outputs["UploadsDLQUrl"])
    assert body == "not an S3 notification"
    assert attributes == {"atelier.verdict": "poison", "atelier.redrives": "0", "atelier.error":
                          "poison: does not match its queue's contract: not JSON: Expecting value: line 1 column 1 (char 0)"}
    assert bodies(outputs["UploadsQueueUrl"]) == []


def test_a_message_failing_every_redrive_is_held_after_the_cap(outputs, redrive) -> None:
    # GIVEN a valid notification whose consumer fails every time (here: nobody deletes it)
    dead_letter(outputs, NOTIFICATION)
    for attempt in range(3):  # DEAD_LETTER_REDRIVE_CAP
        assert redrive(backoff=0)["redriven"] == {"UploadsDLQ": 1}, attempt
        for _ in range(6):  # it fails its five receives again and is dead-lettered again
            boto3.client("sqs").receive_message(QueueUrl=outputs["UploadsQueueUrl"], VisibilityTimeout=0)
    # WHEN the redriver finds it a fourth time
    report = redrive(backoff=0)
    # THEN it stays, with the count and the reason
    assert (report["redriven"], report["poison"]) == ({}, {"UploadsDLQ": 1})
    ((body, attributes),) = held(outputs["UploadsDLQUrl"])
    assert body == NOTIFICATION
    assert attributes["atelier.redrives"] == "3"
    assert attributes["atelier.error"] == (
        "poison: failed again after 3 automatic redrives, each after its queue's full retries; "
        "last error: none recorded (SQS keeps no error; see the consumer logs)")


def test_a_second_redrive_waits_hidden_in_the_dlq_until_its_backoff_has_passed(outputs, redrive) -> None:
    dead_letter(outputs, NOTIFICATION)
    assert redrive(backoff=600)["redriven"] == {"UploadsDLQ": 1}
    for _ in range(6):
        boto3.client("sqs").receive_message(QueueUrl=outputs["UploadsQueueUrl"], VisibilityTimeout=0)

    report = redrive(backoff=600)

    assert (report["redriven"], report["waiting"]) == ({}, {"UploadsDLQ": 1})
    assert counts(outputs["UploadsDLQUrl"]) == (0, 1)  # not visible: its DLQ's alarm does not count it
    assert counts(outputs["UploadsQueueUrl"]) == (0, 0)


def test_list_and_show_count_the_dead_letters_hidden_from_a_receive(outputs, capsys) -> None:
    dead_letter(outputs, "waits out its backoff")
    dead_letter(outputs, "visible")
    url = outputs["UploadsDLQUrl"]
    sqs = boto3.client("sqs")
    hidden = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=1, VisibilityTimeout=600)["Messages"]

    assert cli.main(["dlq", "list", "--json"]) == 0
    listed = {d["name"]: (d["messages"], d["hidden"]) for d in json.loads(capsys.readouterr().out)}
    assert cli.main(["dlq", "show", "UploadsDLQ"]) == 0
    shown = capsys.readouterr().out

    assert listed["UploadsDLQ"] == (1, 1)
    assert hidden[0]["Body"] not in shown
    assert "1 messages shown; 1 more hidden" in " ".join(shown.split())


def test_an_event_goes_back_on_the_bus_and_a_failed_tick_is_dropped(outputs, redrive) -> None:
    event = {"version": "0", "id": "1", "source": "atelier.pack", "detail-type": "Shard Sealed",
             "resources": [], "detail": {"shard_id": "shard-1"}}
    tick = {"version": "0", "id": "2", "source": "aws.events", "detail-type": "Scheduled Event",
            "resources": ["arn:aws:events:us-east-1:123456789012:rule/atelier-PackFunctionSealTimer"], "detail": {}}
    boto3.client("sqs").send_message(QueueUrl=outputs["StartTrainingDLQUrl"], MessageBody=json.dumps(event))
    boto3.client("sqs").send_message(QueueUrl=outputs["PackScheduleDLQUrl"], MessageBody=json.dumps(tick))

    report = redrive()

    assert (report["redriven"], report["dropped"], report["poison"]) == (
        {"StartTrainingDLQ": 1}, {"PackScheduleDLQ": 1}, {})
    source = next(s for s in outputs_sources(outputs) if "ShardSealed" in s)
    assert [json.loads(b)["detail"] for b in bodies(source)] == [{"shard_id": "shard-1"}]
    assert counts(outputs["StartTrainingDLQUrl"]) == counts(outputs["PackScheduleDLQUrl"]) == (0, 0)


def test_a_failed_send_leaves_the_dead_letter_where_it_was(outputs, redrive, monkeypatch) -> None:
    dead_letter(outputs, NOTIFICATION)
    from core.redrive import redriver
    real = redriver.aws.client

    class Failing:
        def __init__(self, inner):
            self.inner = inner

        def send_message(self, **kwargs):
            raise ConnectionError("SQS is unreachable")

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(redriver.aws, "client", lambda service: Failing(real(service)))
    with pytest.raises(ConnectionError):
        redrive()
    monkeypatch.setattr(redriver.aws, "client", real)
    assert counts(outputs["UploadsDLQUrl"]) == (0, 1)  # hidden for the run's hold, then visible again
    assert bodies(outputs["UploadsQueueUrl"]) == []


def test_a_run_that_died_after_marking_leaves_one_marked_copy_after_the_next(outputs, redrive) -> None:
    # GIVEN a poison message marked by a run that died before deleting the unmarked original
    sqs, url = boto3.client("sqs"), outputs["UploadsDLQUrl"]
    sqs.send_message(QueueUrl=url, MessageBody="not JSON", MessageAttributes={
        "atelier.verdict": {"DataType": "String", "StringValue": "poison"},
        "atelier.error": {"DataType": "String", "StringValue": "poison: why"}})
    sqs.send_message(QueueUrl=url, MessageBody="not JSON")
    # WHEN the redriver runs
    assert redrive()["poison"] == {"UploadsDLQ": 1}
    # THEN only the marked copy is left, visible
    assert held(url) == [("not JSON", {"atelier.verdict": "poison", "atelier.error": "poison: why"})]
    assert counts(url) == (1, 0)


def test_a_redrive_by_hand_sends_a_held_message_back_without_its_marks(outputs, redrive) -> None:
    dead_letter(outputs, "not JSON")
    assert redrive()["poison"] == {"UploadsDLQ": 1}

    dlq.redrive(dlq.lookup(outputs, "UploadsDLQ"), 10, "one-by-one")

    received = boto3.client("sqs").receive_message(QueueUrl=outputs["UploadsQueueUrl"],
                                                   MessageAttributeNames=["All"])["Messages"]
    assert [(m["Body"], m.get("MessageAttributes", {})) for m in received] == [("not JSON", {})]
