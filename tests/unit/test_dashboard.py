"""template.yaml's dashboard and alarms: every widget reads metrics that exist, every DLQ and work queue alarms."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core import telemetry
from tests.unit.template_helpers import expand_with, of_type, resolve

ENDPOINT_ALARMS = ("EndpointErrorsAlarm", "EndpointLatencyAlarm")  # defined with the deploy resources


@pytest.fixture(scope="module")
def expanded():
    return expand_with({})


@pytest.fixture(scope="module")
def resources(expanded) -> dict[str, dict[str, Any]]:
    return resolve(expanded)


@pytest.fixture(scope="module")
def dashboard(resources) -> dict[str, Any]:
    (body,) = [d["DashboardBody"] for d in of_type(resources, "AWS::CloudWatch::Dashboard").values()]
    return json.loads(body)


def metric_rows(dashboard: dict[str, Any]) -> list[list[Any]]:
    """Every metric row of every metric widget, the trailing options dict dropped (expressions kept)."""
    rows = []
    for widget in dashboard["widgets"]:
        for row in widget["properties"].get("metrics", []):
            rows.append([x for x in row if not isinstance(x, dict)] or row)
    return rows


def emitted_metrics() -> set[str]:
    names = {v for k, v in vars(telemetry).items() if k.isupper() and isinstance(v, str) and k != "REASON"}
    return names | set(telemetry.TRAINING_JOBS_FINISHED.values())


def service_names(resources: dict[str, dict[str, Any]]) -> set[str]:
    return {f["Environment"]["Variables"]["POWERTOOLS_SERVICE_NAME"]
            for f in of_type(resources, "AWS::Lambda::Function").values()}


def test_every_widget_has_a_region_and_a_place_on_the_grid(dashboard) -> None:
    for widget in dashboard["widgets"]:
        assert widget["x"] + widget["width"] <= 24 and widget["height"] > 0, widget
        assert widget["type"] == "alarm" or widget["properties"]["region"] == "us-east-1", widget


def test_every_widget_metric_names_a_resource_of_the_template(dashboard, resources, expanded) -> None:
    queues = set(of_type(resources, "AWS::SQS::Queue"))
    functions = set(of_type(resources, "AWS::Lambda::Function"))
    namespace = expanded.parameters["MetricsNamespace"]
    for row in metric_rows(dashboard):
        if isinstance(row[0], dict):  # a SEARCH expression over a namespace of ours or SageMaker's
            assert row[0]["expression"].startswith(f"SEARCH('{{{namespace},") or "/aws/sagemaker/TrainingJobs" in row[0]["expression"]
            continue
        space, name, dimensions = row[0], row[1], dict(zip(row[2::2], row[3::2]))
        if space == "AWS/SQS":
            assert dimensions["QueueName"].removesuffix(".QueueName") in queues, row
        elif space == "AWS/Lambda":
            assert dimensions["FunctionName"] in functions, row
        elif space == "AWS/SageMaker":
            assert dimensions == {"EndpointName": expanded.parameters["EndpointName"], "VariantName": "AllTraffic"}
        else:
            assert space == namespace, row
            assert name in emitted_metrics(), row
            assert dimensions["service"] in service_names(resources), row


def test_the_alarm_widget_lists_every_alarm(dashboard, resources) -> None:
    (widget,) = [w for w in dashboard["widgets"] if w["type"] == "alarm"]

    assert sorted(a.removesuffix(".Arn") for a in widget["properties"]["alarms"]) \
        == sorted(of_type(resources, "AWS::CloudWatch::Alarm"))


def test_the_rejects_widget_searches_the_metric_ingest_emits(dashboard) -> None:
    expressions = [row[0]["expression"] for row in metric_rows(dashboard) if isinstance(row[0], dict)]

    assert any(f'MetricName="{telemetry.UPLOADS_REJECTED}"' in e and f",{telemetry.REASON}," in e for e in expressions)


def alarmed_queues(resources: dict[str, dict[str, Any]], metric: str) -> set[str]:
    return {a["Dimensions"][0]["Value"].removesuffix(".QueueName")
            for a in of_type(resources, "AWS::CloudWatch::Alarm").values()
            if a["Namespace"] == "AWS/SQS" and a["MetricName"] == metric}


def test_every_dead_letter_queue_alarms_on_its_first_message(resources) -> None:
    queues = of_type(resources, "AWS::SQS::Queue")
    dlqs = {q["RedrivePolicy"]["deadLetterTargetArn"].removesuffix(".Arn") for q in queues.values() if "RedrivePolicy" in q}
    dlqs |= {f["DeadLetterConfig"]["TargetArn"].removesuffix(".Arn")
             for f in of_type(resources, "AWS::Lambda::Function").values() if "DeadLetterConfig" in f}
    dlqs |= {t["DeadLetterConfig"]["Arn"].removesuffix(".Arn") for r in of_type(resources, "AWS::Events::Rule").values()
             for t in r.get("Targets", []) if "DeadLetterConfig" in t}

    assert dlqs <= alarmed_queues(resources, "ApproximateNumberOfMessagesVisible")
    assert dlqs == {name for name in queues if name.endswith("DLQ")}


def test_every_queue_with_a_dlq_alarms_on_its_oldest_message(resources) -> None:
    with_dlq = {name for name, q in of_type(resources, "AWS::SQS::Queue").items() if "RedrivePolicy" in q}

    assert with_dlq and with_dlq <= alarmed_queues(resources, "ApproximateAgeOfOldestMessage")


def test_the_training_failure_alarm_reads_start_training_s_metric(resources, expanded) -> None:
    alarm = of_type(resources, "AWS::CloudWatch::Alarm")["TrainingJobFailedAlarm"]
    service = of_type(resources, "AWS::Lambda::Function")["StartTrainingFunction"]["Environment"]["Variables"]

    assert (alarm["Namespace"], alarm["MetricName"], alarm["Dimensions"]) == (
        service["POWERTOOLS_METRICS_NAMESPACE"], telemetry.TRAINING_JOBS_FINISHED["Failed"],
        [{"Name": "service", "Value": service["POWERTOOLS_SERVICE_NAME"]}])


def test_the_lineage_halted_alarm_reads_start_training_s_metric(resources) -> None:
    alarm = of_type(resources, "AWS::CloudWatch::Alarm")["LineageHaltedAlarm"]
    service = of_type(resources, "AWS::Lambda::Function")["StartTrainingFunction"]["Environment"]["Variables"]

    assert (alarm["Namespace"], alarm["MetricName"], alarm["Dimensions"]) == (
        service["POWERTOOLS_METRICS_NAMESPACE"], telemetry.LINEAGES_HALTED,
        [{"Name": "service", "Value": service["POWERTOOLS_SERVICE_NAME"]}])
    assert (alarm["Statistic"], alarm["Threshold"], alarm["ComparisonOperator"]) == ("Sum", 0, "GreaterThanThreshold")


def test_alarms_notify_the_topic_only_when_one_is_given(resources) -> None:
    topic = "arn:aws:sns:us-east-1:123456789012:ops"
    with_topic = of_type(resolve(expand_with({"AlarmTopicArn": topic})), "AWS::CloudWatch::Alarm")
    ours = of_type(resources, "AWS::CloudWatch::Alarm")

    assert set(ENDPOINT_ALARMS) <= set(ours)  # the rollout's alarms reach people too (docs/runbook.md)
    assert all("AlarmActions" not in a for a in ours.values())
    assert all(with_topic[n]["AlarmActions"] == [topic] for n in ours)


def test_the_endpoint_alarms_of_the_rollout_are_on_the_dashboard_if_defined(dashboard, resources) -> None:
    (widget,) = [w for w in dashboard["widgets"] if w["type"] == "alarm"]
    defined = [name for name in ENDPOINT_ALARMS if name in resources]

    assert all(f"{name}.Arn" in widget["properties"]["alarms"] for name in defined)
