"""core.deploy's rollout: rollback, the endpoint's own events, the model and endpoint config requests AWS accepts."""

from __future__ import annotations

import boto3
import pytest

from contracts import pipeline_table
from core import aws
from core.deploy.candidates import on_job_state
from core.deploy.requests import deployment_config, endpoint_config_request, evaluation_job_request, model_request
from core.deploy.rollout import on_endpoint_state, on_rollback_request, rollback
from core.errors import BadMessage
from core.deploy.settings import DeploySettings
from tests.unit.settings_helpers import DEPLOY_REQUIRED
from tests.functions.deploy_helpers import (  # noqa: F401  (settings, updates: fixtures)
    ENDED,
    deploy_settings,
    JOB,
    completed,
    deploy_first,
    evaluation_finished,
    model_record,
    settings,
    updates,
)


# --- rollback and the endpoint's own events ---------------------------------------------------------

def test_rollback_restores_the_previous_model(settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)

    result = rollback(settings.table, settings.endpoint_name)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert updates[-1] == {"EndpointName": settings.endpoint_name, "EndpointConfigName": JOB,
                           "DeploymentConfig": deployment_config(settings)}
    assert model_record(settings, "atelier-second")["status"] == "rolled-back"
    # and a duplicate event of the rolled-back model does not bring it back
    assert on_job_state(completed("atelier-second", ENDED + 1000), settings).action == "duplicate"


def test_rollback_without_an_earlier_model_is_a_clear_error(settings: DeploySettings) -> None:
    deploy_first(settings)

    with pytest.raises(BadMessage, match="no earlier model"):
        rollback(settings.table, settings.endpoint_name)


def test_a_rollback_request_rolls_back_and_answers_on_the_endpoint_record(settings: DeploySettings,
                                                                         updates: list) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)

    result = on_rollback_request({"request_id": "r1", "to": None, "reason": "bad colours"}, settings)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert updates[-1]["EndpointConfigName"] == JOB
    assert model_record(settings, "atelier-second")["reason"] == "bad colours"
    answer = aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["last_rollback"]
    assert answer == {"id": "r1", "action": "rolled-back", "model": JOB, "reason": f"atelier-second -> {JOB}"}


def test_a_rollback_request_that_cannot_succeed_is_refused_with_the_reason_and_changes_nothing(
        settings: DeploySettings, updates: list) -> None:
    deploy_first(settings)
    before = len(updates)

    result = on_rollback_request({"request_id": "r2", "to": "atelier-never", "reason": ""}, settings)

    assert result.action == "refused" and "no earlier model" in result.reason
    assert len(updates) == before
    answer = aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["last_rollback"]
    assert (answer["id"], answer["action"]) == ("r2", "refused") and "no earlier model" in answer["reason"]


def test_an_automatic_rollback_is_recorded_when_the_endpoint_is_in_service(settings: DeploySettings,
                                                                           updates: list, monkeypatch) -> None:
    deploy_first(settings)
    on_job_state(completed("atelier-second", ENDED + 1000), settings)
    on_job_state(evaluation_finished(settings, "atelier-second", 0.09, baseline_loss=0.1), settings)
    # GIVEN SageMaker rolled the update back on an alarm: the first config serves again
    describe = aws.describe_endpoint
    monkeypatch.setattr(aws, "describe_endpoint", lambda name: {**describe(name), "EndpointConfigName": JOB})

    result = on_endpoint_state(settings.endpoint_name, settings)

    assert (result.action, result.model) == ("rolled-back", JOB)
    assert model_record(settings, "atelier-second")["status"] == "rolled-back"
    assert aws.get_item(settings.table, pipeline_table.endpoint_pk(settings.endpoint_name))["model"] == JOB


def test_an_endpoint_in_service_gets_autoscaling_on_invocations(settings: DeploySettings) -> None:
    deploy_first(settings)

    on_endpoint_state(settings.endpoint_name, settings)

    scaling = boto3.client("application-autoscaling")
    target = scaling.describe_scalable_targets(ServiceNamespace="sagemaker")["ScalableTargets"]
    policy = scaling.describe_scaling_policies(ServiceNamespace="sagemaker")["ScalingPolicies"]
    assert [(t["ResourceId"], t["MinCapacity"], t["MaxCapacity"]) for t in target] == [
        (f"endpoint/{settings.endpoint_name}/variant/AllTraffic", settings.min_instances, settings.max_instances)]
    assert policy[0]["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"][
        "PredefinedMetricType"] == "SageMakerVariantInvocationsPerInstance"


def test_model_request_names_the_job_and_manifest() -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models")

    request = model_request(completed(), settings)

    assert request["ModelName"] == JOB
    assert {t["Key"]: t["Value"] for t in request["Tags"]} == {"atelier:training-job": JOB, "atelier:manifest": "ab" * 32}
    assert request["EnableNetworkIsolation"] is True


def test_the_models_container_has_the_operators_server_settings_beside_its_provenance() -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              serve_environment={"SERVE_COMPILE": "off", "SERVE_WARMUP_IMAGES": "1,4"})

    environment = model_request(completed(), settings)["PrimaryContainer"]["Environment"]

    assert environment == {"SERVE_COMPILE": "off", "SERVE_WARMUP_IMAGES": "1,4", "ATELIER_MODEL_ID": JOB,
                           "ATELIER_MANIFEST_DIGEST": "ab" * 32,
                           "ATELIER_ATTRIBUTION_URI": f"s3://models/training/{JOB}/output/attribution.json"}


def test_a_signing_model_names_its_secret_and_is_not_network_isolated() -> None:
    # AWS: a network-isolated container gets no credentials and no network, so a server that reads its
    # signing secret at start runs without isolation (docs/deploy.md); without a secret it keeps it
    secret = "arn:aws:secretsmanager:us-east-1:123456789012:secret:atelier/c2pa-signing-AbCdEf"
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              signing_secret_arn=secret)

    request = model_request(completed(), settings)

    assert request["PrimaryContainer"]["Environment"]["ATELIER_C2PA_SECRET"] == secret
    assert request["EnableNetworkIsolation"] is False


# AWS: CreateEndpointConfig "fails" when KmsKeyId is given for an instance type with local storage,
# as CreateTrainingJob does for VolumeKmsKeyId (docs/aws-differences.md).
KEY = "arn:aws:kms:us-east-1:123456789012:key/k"


@pytest.mark.parametrize("instance_type, keyed", [("ml.g5.xlarge", False), ("ml.g4dn.xlarge", False),
                                                  ("ml.p4d.24xlarge", False), ("ml.m5.large", True),
                                                  ("ml.g6e.2xlarge", False), ("ml.inf2.xlarge", True)])
def test_the_endpoint_config_names_the_key_only_where_aws_accepts_it(instance_type: str, keyed: bool) -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type=instance_type, models_bucket="models", kms_key=KEY)

    request = endpoint_config_request(completed(), settings)

    assert request.get("KmsKeyId") == (KEY if keyed else None)


def test_the_endpoint_config_gives_the_compiling_server_its_startup_time() -> None:
    """trainer/serve/generation.py compiles before /ping answers 200 (102 s on an H200): the variant says how long
    SageMaker waits for that (ContainerStartupHealthCheckTimeoutInSeconds), the template's parameter."""
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              startup_timeout_s=1500)

    [variant] = endpoint_config_request(completed(), settings)["ProductionVariants"]

    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 1500


@pytest.mark.parametrize("instance_type, keyed", [("ml.g5.2xlarge", False), ("ml.m5.xlarge", True)])
def test_the_evaluation_job_encrypts_its_volume_only_where_aws_accepts_it(instance_type: str, keyed: bool) -> None:
    settings = deploy_settings(table="t", role_arn="arn:aws:iam::123456789012:role/r", image_uri="img",
                              endpoint_name="atelier", instance_type="ml.g5.xlarge", models_bucket="models",
                              kms_key=KEY, eval_instance_type=instance_type, eval_data_uri="s3://data/eval/")

    request = evaluation_job_request("m-eval", {"model": "m", "model_data": "s3://models/m.tar.gz"}, None, settings)

    assert request["ResourceConfig"].get("VolumeKmsKeyId") == (KEY if keyed else None)
    assert request["OutputDataConfig"]["KmsKeyId"] == KEY
