"""template.yaml's RedriveFunction: it sees every DLQ, and may touch the DLQs, their sources and its ledger only."""

from __future__ import annotations

import json
from typing import Any

import pytest

from contracts import pipeline_table
from core import telemetry
from core.redrive import dead_letters
from tests.unit.template_helpers import expand_with, of_type, resolve


@pytest.fixture(scope="module")
def resources() -> dict[str, dict[str, Any]]:
    return resolve(expand_with({}))


def redriver_statements(resources: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    role = resources["RedriveFunctionRole"]["Properties"]
    return [s for p in role["Policies"] for s in p["PolicyDocument"]["Statement"]]


def test_the_redriver_knows_every_dlq_its_source_queue_and_its_consumer_s_contract(resources) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    env = of_type(resources, "AWS::Lambda::Function")["RedriveFunction"]["Environment"]["Variables"]
    configured = json.loads(env["DEAD_LETTER_QUEUES"])
    sources = {q["RedrivePolicy"]["deadLetterTargetArn"].removesuffix(".Arn"): name
               for name, q in queues.items() if "RedrivePolicy" in q}

    assert sorted(configured) == sorted(name for name in queues if name.endswith("DLQ"))
    assert {name: c["queue"] for name, c in configured.items()} == {name: f"{name}.QueueName" for name in configured}
    assert {name: c.get("source", "").removesuffix(".QueueName") for name, c in configured.items() if "source" in c} \
        == sources
    assert {c["contract"] for c in configured.values()} <= set(dead_letters.CONTRACTS)
    assert {name: c["contract"] for name, c in configured.items() if "source" in c} == {
        "UploadsDLQ": "s3-notification", "PackDLQ": "sample", "ImportDLQ": "import-shard"}


def test_the_redriver_may_write_only_its_ledger_items(resources) -> None:
    (table,) = [s for s in redriver_statements(resources) if any(a.startswith("dynamodb:") for a in s["Action"])]

    assert sorted(table["Action"]) == ["dynamodb:BatchGetItem", "dynamodb:PutItem"]
    assert table["Condition"] == {"ForAllValues:StringLike": {"dynamodb:LeadingKeys": [f"{pipeline_table.REDRIVE_PREFIX}*"]}}


def test_the_redriver_may_send_only_to_dlqs_and_their_source_queues(resources) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    sqs = [s for s in redriver_statements(resources) if any(a.startswith("sqs:") for a in s["Action"])]
    reached = {r.removesuffix(".Arn") for s in sqs for r in (s["Resource"] if isinstance(s["Resource"], list) else [s["Resource"]])}
    receives = {r.removesuffix(".Arn") for s in sqs if "sqs:ReceiveMessage" in s["Action"] for r in s["Resource"]}

    assert reached == {name for name in queues if name.endswith("DLQ")} | {"UploadsQueue", "PackQueue", "ImportQueue"}
    assert receives == {name for name in queues if name.endswith("DLQ")}  # it never consumes a work queue


def test_a_poison_message_and_failing_ticks_raise_alarms_on_the_redriver_s_metrics(resources) -> None:
    alarms = of_type(resources, "AWS::CloudWatch::Alarm")
    service = of_type(resources, "AWS::Lambda::Function")["RedriveFunction"]["Environment"]["Variables"]

    for alarm, metric in (("PoisonDeadLettersAlarm", telemetry.POISON_MESSAGES),
                          ("ScheduleTicksDroppedAlarm", telemetry.SCHEDULE_TICKS_DROPPED)):
        assert (alarms[alarm]["MetricName"], alarms[alarm]["Dimensions"]) == (
            metric, [{"Name": "service", "Value": service["POWERTOOLS_SERVICE_NAME"]}])
    assert (alarms["PoisonDeadLettersAlarm"]["Statistic"], alarms["PoisonDeadLettersAlarm"]["EvaluationPeriods"]) == ("Maximum", 1)
