"""Safe deployments on the local SageMaker: DeploymentConfig, blue/green traffic shifting, baking,
automatic rollback on CloudWatch alarms, endpoint events and metrics, and the local alarm evaluator.

Containers are tests/local/fake_container.py (see sagemaker_helpers.py); moto runs in server mode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from atelier.local.alarms import AlarmEvaluator, evaluate, unsupported
from atelier.local.sagemaker import LocalSageMaker
from atelier.local.sagemaker.deployment_config import Step, traffic_plan
from tests.local.sagemaker_helpers import (  # noqa: F401  (fixtures)
    REGION,
    aws,
    error_of,
    invoke,
    moto_url,
    pid_alive,
    put_model,
    runtime,
    s3,
    service,
    sm,
    wait_for,
    wait_for_endpoint,
)

DIMENSIONS = [{"Name": "EndpointName", "Value": "atelier"}, {"Name": "VariantName", "Value": "AllTraffic"}]


@pytest.fixture
def overrides() -> dict[str, Any]:
    """Fast alarm polling and metric flushes."""
    return {"alarm_poll_seconds": 0.1, "metrics_flush_seconds": 0.2}


@pytest.fixture
def cloudwatch(aws: None) -> Any:
    return boto3.client("cloudwatch", region_name=REGION)


@pytest.fixture
def endpoint_events(aws: None) -> Callable[[], list[dict[str, Any]]]:
    """A rule on the endpoint events delivering to SQS; returns a reader of every event so far."""
    events, sqs = boto3.client("events", region_name=REGION), boto3.client("sqs", region_name=REGION)
    queue_url = sqs.create_queue(QueueName="endpoint-events")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue_url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    events.put_rule(Name="endpoints", EventPattern=json.dumps({"source": ["aws.sagemaker"], "detail-type": [
        "SageMaker Endpoint State Change", "SageMaker Endpoint Deployment State Change"]}))
    events.put_targets(Rule="endpoints", Targets=[{"Id": "queue", "Arn": queue_arn}])
    received: list[dict[str, Any]] = []

    def read() -> list[dict[str, Any]]:
        while messages := sqs.receive_message(QueueUrl=queue_url, MaxNumberOfMessages=10).get("Messages", []):
            for message in messages:
                received.append(json.loads(message["Body"]))
                sqs.delete_message(QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"])
        return received

    return read


# --- helpers ------------------------------------------------------------------------------------

def blue_green(routing: dict[str, Any], termination_wait: int = 0, alarms: tuple[str, ...] = ()) -> dict[str, Any]:
    config: dict[str, Any] = {"BlueGreenUpdatePolicy": {
        "TrafficRoutingConfiguration": routing, "TerminationWaitInSeconds": termination_wait,
        "MaximumExecutionTimeoutInSeconds": 600}}
    if alarms:
        config["AutoRollbackConfiguration"] = {"Alarms": [{"AlarmName": name} for name in alarms]}
    return config


ALL_AT_ONCE = {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 0}


def put_alarm(cloudwatch: Any, name: str, metric: str = "Invocation5XXErrors", **overrides: Any) -> None:
    cloudwatch.put_metric_alarm(**{
        "AlarmName": name, "Namespace": "AWS/SageMaker", "MetricName": metric, "Dimensions": DIMENSIONS,
        "Statistic": "Sum", "Period": 10, "EvaluationPeriods": 1, "DatapointsToAlarm": 1, "Threshold": 1.0,
        "ComparisonOperator": "GreaterThanOrEqualToThreshold", "TreatMissingData": "notBreaching", **overrides})


def serving(sm: Any, s3: Any, *models: tuple[str, dict[str, str]]) -> None:
    """Models (name, environment) each with its config; an endpoint `atelier` InService on the first."""
    for name, environment in models:
        put_model(s3, sm, name, name, environment)
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName=models[0][0])
    wait_for_endpoint(sm, "atelier", "InService")


def stage(sm: Any) -> str | None:
    pending = sm.describe_endpoint(EndpointName="atelier").get("PendingDeploymentSummary")
    return pending["ProductionVariants"][0]["VariantStatus"][0]["Status"] if pending else None


def wait_for_stage(sm: Any, wanted: str) -> dict[str, Any]:
    wait_for(lambda: stage(sm) == wanted, what=f"deployment stage {wanted}")
    return sm.describe_endpoint(EndpointName="atelier")


def serve_pid(service: LocalSageMaker, config: str) -> int:
    return int((service.settings.state_dir / f"endpoints/atelier/{config}/opt_ml/serve.pid").read_text())


def update_ended(sm: Any) -> dict[str, Any]:
    return wait_for(lambda: (e := sm.describe_endpoint(EndpointName="atelier"))["EndpointStatus"] != "Updating"
                    and e, what="the update to end")


def of_type(events: list[dict[str, Any]], detail_type: str) -> list[dict[str, Any]]:
    return [event["detail"] for event in events if event["detail-type"] == detail_type]


# --- blue/green deployments ---------------------------------------------------------------------

def test_all_at_once_update_bakes_then_retires_the_old_container(
        sm: Any, s3: Any, runtime: Any, cloudwatch: Any, service: LocalSageMaker, endpoint_events: Callable) -> None:
    # GIVEN an endpoint serving v1 and a quiet rollback alarm
    serving(sm, s3, ("v1", {}), ("v2", {}))
    put_alarm(cloudwatch, "atelier-5xx")
    old_pid = serve_pid(service, "v1")
    config = blue_green(ALL_AT_ONCE, termination_wait=2, alarms=("atelier-5xx",))

    # WHEN it is updated to v2 all at once with a 2 s baking period
    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="v2", DeploymentConfig=config)

    # THEN while baking v2 takes every invocation, v1 is kept and the endpoint still names v1
    baking = wait_for_stage(sm, "Baking")
    assert (baking["EndpointStatus"], baking["EndpointConfigName"]) == ("Updating", "v1")
    assert baking["PendingDeploymentSummary"]["EndpointConfigName"] == "v2"
    assert baking["PendingDeploymentSummary"]["ProductionVariants"][0]["VariantStatus"][0]["StatusMessage"] == (
        "Baking for 2 seconds (TerminationWaitInSeconds) with traffic enabled on full capacity.")
    assert [invoke(runtime, "atelier", "x")[0]["model"] for _ in range(3)] == ["v2"] * 3
    assert pid_alive(old_pid)
    # AND after baking v2 is the endpoint's config and v1's container is gone
    endpoint = update_ended(sm)
    assert (endpoint["EndpointStatus"], endpoint["EndpointConfigName"]) == ("InService", "v2")
    assert "FailureReason" not in endpoint and "PendingDeploymentSummary" not in endpoint
    assert endpoint["LastDeploymentConfig"] == config
    wait_for(lambda: not pid_alive(old_pid), what="the old container to stop")
    # AND every status change was announced as SageMaker announces it
    states = wait_for(lambda: len(s := of_type(endpoint_events(), "SageMaker Endpoint State Change")) >= 4 and s,
                      what="four endpoint events")
    assert [(s["EndpointStatus"], s["EndpointConfigName"]) for s in states] == [
        ("CREATING", "v1"), ("IN_SERVICE", "v1"), ("UPDATING", "v1"), ("IN_SERVICE", "v2")]
    assert states[-1]["EndpointArn"] == "arn:aws:sagemaker:us-east-1:123456789012:endpoint/atelier"
    assert isinstance(states[-1]["LastModifiedTime"], int)  # epoch milliseconds, as in AWS's events
    stages = [(d["PendingDeploymentSummary"]["EndpointConfigName"],
               d["PendingDeploymentSummary"]["ProductionVariants"][0]["VariantStatus"][0]["Status"])
              for d in of_type(endpoint_events(), "SageMaker Endpoint Deployment State Change")]
    assert stages == [("v2", "ActivatingTraffic"), ("v2", "Baking")]


def test_an_alarm_during_baking_rolls_back_to_the_old_config(
        sm: Any, s3: Any, runtime: Any, cloudwatch: Any, service: LocalSageMaker, endpoint_events: Callable) -> None:
    serving(sm, s3, ("v1", {}), ("v2", {}))
    put_alarm(cloudwatch, "atelier-latency", metric="ModelLatency")
    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="v2", DeploymentConfig=blue_green(
        ALL_AT_ONCE, termination_wait=60, alarms=("atelier-latency",)))
    wait_for_stage(sm, "Baking")
    green_pid = serve_pid(service, "v2")

    cloudwatch.set_alarm_state(AlarmName="atelier-latency", StateValue="ALARM", StateReason="test")

    endpoint = update_ended(sm)
    assert (endpoint["EndpointStatus"], endpoint["EndpointConfigName"]) == ("InService", "v1")
    assert endpoint["FailureReason"] == ("Rolled back: CloudWatch alarm(s) atelier-latency in the "
                                         "AutoRollbackConfiguration went into ALARM during the deployment.")
    assert invoke(runtime, "atelier", "after")[0]["model"] == "v1"
    wait_for(lambda: not pid_alive(green_pid), what="the new container to stop")
    last = wait_for(lambda: (s := of_type(endpoint_events(), "SageMaker Endpoint State Change"))
                    and s[-1]["EndpointStatus"] == "IN_SERVICE" and len(s) == 4 and s[-1], what="the rollback event")
    assert (last["EndpointConfigName"], last["FailureReason"]) == ("v1", endpoint["FailureReason"])


def test_a_failing_model_trips_a_real_5xx_alarm_and_rolls_back_on_its_own(
        sm: Any, s3: Any, runtime: Any, cloudwatch: Any) -> None:
    # GIVEN an alarm on 5xx errors, the local evaluator, and a v2 whose container answers 500
    serving(sm, s3, ("v1", {}), ("v2", {"FAKE_INVOKE_STATUS": "500"}))
    put_alarm(cloudwatch, "atelier-5xx")
    evaluator = AlarmEvaluator(region=REGION, interval_seconds=0.2).start()
    try:
        sm.update_endpoint(EndpointName="atelier", EndpointConfigName="v2", DeploymentConfig=blue_green(
            ALL_AT_ONCE, termination_wait=60, alarms=("atelier-5xx",)))
        wait_for_stage(sm, "Baking")

        # WHEN clients keep invoking it
        def rolled_back() -> dict[str, Any] | None:
            try:
                invoke(runtime, "atelier", "x")
            except ClientError as error:
                assert error.response["Error"]["Code"] == "ModelError"
            endpoint = sm.describe_endpoint(EndpointName="atelier")
            return endpoint if endpoint["EndpointStatus"] != "Updating" else None
        # within the 60 s bake: past it the update would complete instead of rolling back
        endpoint = wait_for(rolled_back, timeout=50, what="the automatic rollback")
    finally:
        evaluator.stop()

    # THEN the alarm fired and the endpoint serves v1 again
    assert cloudwatch.describe_alarms(AlarmNames=["atelier-5xx"])["MetricAlarms"][0]["StateValue"] == "ALARM"
    assert (endpoint["EndpointStatus"], endpoint["EndpointConfigName"]) == ("InService", "v1")
    assert "atelier-5xx" in endpoint["FailureReason"]
    assert invoke(runtime, "atelier", "after")[0]["model"] == "v1"


def test_canary_sends_its_share_to_the_new_fleet_with_a_retained_config(
        sm: Any, s3: Any, runtime: Any, service: LocalSageMaker) -> None:
    # GIVEN an endpoint created with a 25% canary config, kept for its updates
    put_model(s3, sm, "v1", "v1")
    put_model(s3, sm, "v2", "v2")
    canary = blue_green({"Type": "CANARY", "WaitIntervalInSeconds": 60,
                         "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 25}}, termination_wait=60)
    sm.create_endpoint(EndpointName="atelier", EndpointConfigName="v1", DeploymentConfig=canary)
    wait_for_endpoint(sm, "atelier", "InService")

    # WHEN an update retains it
    sm.update_endpoint(EndpointName="atelier", EndpointConfigName="v2", RetainDeploymentConfig=True)

    # THEN while the canary bakes exactly a quarter of the invocations reach v2
    endpoint = wait_for_stage(sm, "Baking")
    assert endpoint["LastDeploymentConfig"] == canary
    assert endpoint["PendingDeploymentSummary"]["ProductionVariants"][0]["VariantStatus"][0]["StatusMessage"] == (
        "Baking for 60 seconds (WaitIntervalInSeconds) with traffic enabled on canary capacity of 25% of invocations.")
    models = [invoke(runtime, "atelier", f"p{i}")[0]["model"] for i in range(8)]
    assert sorted(models) == ["v1"] * 6 + ["v2"] * 2
    # AND deleting the endpoint mid-deployment stops both containers
    pids = [serve_pid(service, "v1"), serve_pid(service, "v2")]
    sm.delete_endpoint(EndpointName="atelier")
    wait_for(lambda: not any(pid_alive(pid) for pid in pids), what="both containers to stop")


def test_traffic_plans_follow_the_routing_type() -> None:
    linear = blue_green({"Type": "LINEAR", "WaitIntervalInSeconds": 5,
                         "LinearStepSize": {"Type": "INSTANCE_COUNT", "Value": 1}}, termination_wait=7)
    assert traffic_plan(linear, instance_count=3) == [
        Step(1 / 3, 5, "WaitIntervalInSeconds"), Step(2 / 3, 5, "WaitIntervalInSeconds"),
        Step(1.0, 7, "TerminationWaitInSeconds")]
    assert traffic_plan(blue_green(ALL_AT_ONCE, 9), 1) == [Step(1.0, 9, "TerminationWaitInSeconds")]
    assert traffic_plan(None, 1) == [Step(1.0, 0, "TerminationWaitInSeconds")]


# --- validation ---------------------------------------------------------------------------------

CANARY_50 = {"Type": "CANARY", "WaitIntervalInSeconds": 0, "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 60}}


@pytest.mark.parametrize(("config", "message"), [
    ({"BlueGreenUpdatePolicy": {"TrafficRoutingConfiguration": {"Type": "SOMETIMES", "WaitIntervalInSeconds": 4000}}},
     "2 validation errors detected: Value 'SOMETIMES' at 'deploymentConfig.blueGreenUpdatePolicy."
     "trafficRoutingConfiguration.type' failed to satisfy constraint: Member must satisfy enum value set: "
     "[ALL_AT_ONCE, CANARY, LINEAR]; Value '4000' at 'deploymentConfig.blueGreenUpdatePolicy."
     "trafficRoutingConfiguration.waitIntervalInSeconds' failed to satisfy constraint: Member must have value "
     "less than or equal to 3600"),
    ({"BlueGreenUpdatePolicy": {"TrafficRoutingConfiguration": ALL_AT_ONCE, "MaximumExecutionTimeoutInSeconds": 60}},
     "1 validation error detected: Value '60' at 'deploymentConfig.blueGreenUpdatePolicy."
     "maximumExecutionTimeoutInSeconds' failed to satisfy constraint: Member must have value greater than or "
     "equal to 600"),
    ({"BlueGreenUpdatePolicy": {}}, "1 validation error detected: Value null at 'deploymentConfig."
     "blueGreenUpdatePolicy.trafficRoutingConfiguration' failed to satisfy constraint: Member must not be null"),
    ({"AutoRollbackConfiguration": {"Alarms": []}}, "1 validation error detected: Value '[]' at 'deploymentConfig."
     "autoRollbackConfiguration.alarms' failed to satisfy constraint: Member must have length greater than or "
     "equal to 1"),
    (blue_green({"Type": "CANARY", "WaitIntervalInSeconds": 0}),
     "CanarySize must be specified when the TrafficRoutingConfiguration Type is CANARY."),
    (blue_green(CANARY_50), "CanarySize 60% is more than 50% of the variant's total instance count (1)."),
    (blue_green({"Type": "LINEAR", "WaitIntervalInSeconds": 0, "LinearStepSize": {"Type": "CAPACITY_PERCENT",
                                                                                   "Value": 5}}),
     "LinearStepSize 5% must be 10-50% of the variant's total instance count (1)."),
])
def test_bad_deployment_configs_are_validation_exceptions(sm: Any, s3: Any, config: dict, message: str) -> None:
    put_model(s3, sm, "v1", "v1")
    unchecked = boto3.client("sagemaker", region_name=REGION, config=Config(parameter_validation=False))

    assert error_of(lambda: unchecked.create_endpoint(EndpointName="atelier", EndpointConfigName="v1",
                                                      DeploymentConfig=config)) == ("ValidationException", message)
    assert error_of(lambda: sm.describe_endpoint(EndpointName="atelier"))[0] == "ValidationException"


# --- metrics ------------------------------------------------------------------------------------

def test_invocations_publish_sagemaker_metrics(sm: Any, s3: Any, runtime: Any, cloudwatch: Any) -> None:
    serving(sm, s3, ("v1", {}))
    for prompt in ("a", "b", "c"):
        invoke(runtime, "atelier", prompt)
    with pytest.raises(ClientError):  # no prompt: the container answers 400
        runtime.invoke_endpoint(EndpointName="atelier", ContentType="application/json", Body=b"{}")

    def statistic(metric: str, name: str = "Sum") -> float | None:
        now = datetime.now(UTC)
        points = cloudwatch.get_metric_statistics(
            Namespace="AWS/SageMaker", MetricName=metric, Dimensions=DIMENSIONS, StartTime=now - timedelta(minutes=5),
            EndTime=now + timedelta(minutes=1), Period=600, Statistics=[name])["Datapoints"]
        return points[0][name] if points else None

    assert wait_for(lambda: statistic("Invocations") == 4, what="four invocations counted")
    assert (statistic("Invocation4XXErrors"), statistic("Invocation5XXErrors")) == (1, 0)
    assert statistic("Invocation4XXErrors", "Average") == 0.25
    assert statistic("ModelLatency", "SampleCount") == 4
    assert 0 < statistic("ModelLatency", "Maximum") < 10_000_000  # microseconds
    names = {m["MetricName"] for m in cloudwatch.list_metrics(Namespace="AWS/SageMaker")["Metrics"]}
    assert names == {"Invocations", "Invocation4XXErrors", "Invocation5XXErrors", "ModelLatency"}


# --- the alarm evaluator ------------------------------------------------------------------------

def alarm(**fields: Any) -> dict[str, Any]:
    return {"AlarmName": "a", "Statistic": "Average", "Period": 60, "EvaluationPeriods": 3, "Threshold": 1.0,
            "ComparisonOperator": "GreaterThanThreshold", "StateValue": "OK", **fields}


@pytest.mark.parametrize(("operator", "value", "state"), [
    ("GreaterThanThreshold", 1.0, "OK"), ("GreaterThanThreshold", 1.5, "ALARM"),
    ("GreaterThanOrEqualToThreshold", 1.0, "ALARM"), ("GreaterThanOrEqualToThreshold", 0.5, "OK"),
    ("LessThanThreshold", 1.0, "OK"), ("LessThanThreshold", 0.5, "ALARM"),
    ("LessThanOrEqualToThreshold", 1.0, "ALARM"), ("LessThanOrEqualToThreshold", 1.5, "OK"),
])
def test_threshold_operators(operator: str, value: float, state: str) -> None:
    result = evaluate(alarm(EvaluationPeriods=1, ComparisonOperator=operator), [value])
    assert result is not None and result.state == state


def test_datapoints_to_alarm_is_m_out_of_n() -> None:
    two_of_three = alarm(DatapointsToAlarm=2)
    assert evaluate(two_of_three, [2.0, 0.0, 2.0]).state == "ALARM"
    assert evaluate(two_of_three, [2.0, 0.0, 0.0]).state == "OK"
    assert evaluate(alarm(), [2.0, 0.0, 2.0]).state == "OK"  # DatapointsToAlarm defaults to EvaluationPeriods
    assert evaluate(alarm(), [2.0, 2.0, 2.0]).reason == (
        "Threshold Crossed: 3 out of the last 3 datapoints [2, 2, 2] were greater than the threshold (1) "
        "(minimum 3 datapoints for ALARM).")


@pytest.mark.parametrize(("treat", "values", "state"), [
    ("missing", [None, None, None], "INSUFFICIENT_DATA"),
    (None, [None, None, None], "INSUFFICIENT_DATA"),  # `missing` is the default
    ("missing", [None, 0.0, None], "OK"),
    ("ignore", [None, None, None], None),  # the state is kept
    ("ignore", [None, None, 0.0], "OK"),
    ("breaching", [None, None, None], "ALARM"),
    ("breaching", [None, 2.0, 0.0], "OK"),
    ("notBreaching", [None, None, None], "OK"),
    ("notBreaching", [2.0, 2.0, None], "OK"),
])
def test_missing_data_is_treated_as_configured(treat: str | None, values: list, state: str | None) -> None:
    fields = {"TreatMissingData": treat} if treat else {}
    result = evaluate(alarm(**fields), values)
    assert (result.state if result else None) == state


def test_alarms_the_evaluator_cannot_evaluate_are_named() -> None:
    assert unsupported(alarm()) is None
    assert unsupported(alarm(Statistic=None, ExtendedStatistic="p99")) == "statistic p99 is not evaluated locally"
    assert unsupported(alarm(Metrics=[{"Id": "m1"}])) == "metric math alarms are not evaluated locally"


def test_evaluator_sets_alarm_states_from_moto_metrics(cloudwatch: Any) -> None:
    put_alarm(cloudwatch, "five-xx")
    put_alarm(cloudwatch, "quiet", metric="Invocation4XXErrors", TreatMissingData="missing")
    cloudwatch.put_metric_data(Namespace="AWS/SageMaker", MetricData=[{
        # a second back: moto keeps whole seconds, so a point stamped "now" can land after the window's end
        "MetricName": "Invocation5XXErrors", "Dimensions": DIMENSIONS, "Timestamp": datetime.now(UTC) - timedelta(seconds=1),
        "StatisticValues": {"SampleCount": 4, "Sum": 2, "Minimum": 0, "Maximum": 1}}])
    evaluator = AlarmEvaluator(region=REGION)

    assert evaluator.evaluate_once() == {"five-xx": "ALARM", "quiet": "INSUFFICIENT_DATA"}
    assert evaluator.evaluate_once() == {}  # no change, no call
    states = {a["AlarmName"]: a["StateValue"] for a in cloudwatch.describe_alarms()["MetricAlarms"]}
    assert states == {"five-xx": "ALARM", "quiet": "INSUFFICIENT_DATA"}
