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
