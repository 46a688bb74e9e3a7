"""core.deploy: training job state changes -> recorded; Completed -> the endpoint serves it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import boto3
import pytest
from tests.support import load_event

from atelier.local.provision import Provisioned
from core import aws, records
from core.deploy import (JobState, endpoint_config_request, job_state_from_event, model_request,
                         on_job_state)
from core.errors import BadMessage
from core.settings import DeploySettings

COMPLETED_JOB = "atelier-3f9a1c2b7d4e5f6a8b9c"  # events/deploy_job_*.json
MODEL_DATA = f"s3://atelier-models-123456789012-us-east-1/training/{COMPLETED_JOB}/output/model.tar.gz"
SETTINGS = DeploySettings(table="atelier-PipelineTable", role_arn="arn:aws:iam::123456789012:role/atelier-SageMakerRole",
                          image_uri="atelier-trainer:latest", endpoint_name="atelier", instance_type="ml.g5.xlarge")


# --- job_state_from_event -----------------------------------------------------------------------

def test_completed_event_gives_the_model_artifacts() -> None:
    state = job_state_from_event(load_event("deploy_job_completed")["detail"])

    assert state == JobState(name=COMPLETED_JOB, status="Completed", model_data_url=MODEL_DATA, failure_reason=None)


def test_failed_event_gives_the_failure_reason() -> None:
    state = job_state_from_event(load_event("deploy_job_failed")["detail"])

    assert state == JobState(name=COMPLETED_JOB, status="Failed", model_data_url=None,
                             failure_reason="AlgorithmError: loss became NaN at step 1200")


def test_null_model_artifacts_give_no_model() -> None:
    detail = {**load_event("deploy_job_failed")["detail"], "ModelArtifacts": None}

    assert job_state_from_event(detail).model_data_url is None


@pytest.mark.parametrize("missing", ["TrainingJobName", "TrainingJobStatus"])
def test_event_without_name_or_status_is_a_bad_message(missing: str) -> None:
    detail = dict(load_event("deploy_job_completed")["detail"])
    del detail[missing]

    with pytest.raises(BadMessage, match=missing):
        job_state_from_event(detail)


# --- requests -----------------------------------------------------------------------------------

COMPLETED = JobState(name=COMPLETED_JOB, status="Completed", model_data_url=MODEL_DATA, failure_reason=None)


def test_model_request_is_named_after_the_job_and_serves_its_artifacts() -> None:
    assert model_request(COMPLETED, SETTINGS) == {
        "ModelName": COMPLETED_JOB,
        "ExecutionRoleArn": "arn:aws:iam::123456789012:role/atelier-SageMakerRole",
        "PrimaryContainer": {"Image": "atelier-trainer:latest", "ModelDataUrl": MODEL_DATA},
        "EnableNetworkIsolation": True,
        "Tags": [{"Key": "atelier:training-job", "Value": COMPLETED_JOB}],
    }


def test_endpoint_config_request_sends_all_traffic_to_one_instance_of_the_model() -> None:
    assert endpoint_config_request(COMPLETED, SETTINGS) == {
        "EndpointConfigName": COMPLETED_JOB,
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": COMPLETED_JOB,
                                "InstanceType": "ml.g5.xlarge", "InitialInstanceCount": 1}],
    }


# --- on_job_state, against moto with the template's resources ----------------------------------------

@pytest.fixture
def settings(stack: Provisioned, function_env: Callable[[str], dict[str, str]]) -> DeploySettings:
    function_env("DeployFunction")
    return DeploySettings.from_env()


def event_state(name: str) -> JobState:
    return job_state_from_event(load_event(name)["detail"])


def test_first_completed_job_creates_the_endpoint(settings: DeploySettings) -> None:
    result = on_job_state(event_state("deploy_job_completed"), settings)

    sagemaker = boto3.client("sagemaker")
    assert (result.action, result.endpoint_config) == ("created", COMPLETED_JOB)
    assert sagemaker.describe_endpoint(EndpointName=settings.endpoint_name)["EndpointConfigName"] == COMPLETED_JOB
    assert sagemaker.describe_model(ModelName=COMPLETED_JOB)["PrimaryContainer"]["ModelDataUrl"] == MODEL_DATA


def test_same_completed_event_again_leaves_the_endpoint_unchanged(settings: DeploySettings) -> None:
    on_job_state(event_state("deploy_job_completed"), settings)

    again = on_job_state(event_state("deploy_job_completed"), settings)

    assert (again.action, again.endpoint_config) == ("unchanged", COMPLETED_JOB)
    assert [m["ModelName"] for m in boto3.client("sagemaker").list_models()["Models"]] == [COMPLETED_JOB]


def test_next_completed_job_updates_the_endpoint(settings: DeploySettings, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN an endpoint serving the first job, and UpdateEndpoint recorded (moto does not implement it)
    on_job_state(event_state("deploy_job_completed"), settings)
    updates: list[dict[str, Any]] = []
    real_call = aws.sagemaker_call

    def call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
        if operation == "update_endpoint":
            updates.append(request)
            return {}
        return real_call(operation, request)

    monkeypatch.setattr(aws, "sagemaker_call", call)
    second = dataclasses.replace(event_state("deploy_job_completed"), name="atelier-00000000000000000002",
                                 model_data_url="s3://models/training/atelier-00000000000000000002/output/model.tar.gz")

    # WHEN a second job completes
    result = on_job_state(second, settings)

    # THEN its model and config exist and the endpoint is switched to them
    sagemaker = boto3.client("sagemaker")
    assert (result.action, result.endpoint_config) == ("updated", second.name)
    assert updates == [{"EndpointName": settings.endpoint_name, "EndpointConfigName": second.name}]
    assert sagemaker.describe_endpoint_config(EndpointConfigName=second.name)["ProductionVariants"][0]["ModelName"] \
        == second.name


def test_failed_job_is_recorded_with_its_reason_and_not_deployed(settings: DeploySettings) -> None:
    result = on_job_state(event_state("deploy_job_failed"), settings)

    item = aws.get_item(settings.table, records.job_pk(COMPLETED_JOB))
    assert (result.action, result.endpoint_config) == ("recorded", None)
    assert (item["status"], item["failure_reason"]) == ("Failed", "AlgorithmError: loss became NaN at step 1200")
    assert boto3.client("sagemaker").list_models()["Models"] == []



# --- run plans: only the final stage is served --------------------------------------------------

def completed_with_tags(tags: object) -> dict[str, Any]:
    return {**load_event("deploy_job_completed")["detail"], "Tags": tags}


@pytest.mark.parametrize(("tags", "final"), [
    pytest.param({"atelier:final-stage": "false", "atelier:stage": "256"}, False, id="earlier-stage-map"),
    pytest.param([{"Key": "atelier:final-stage", "Value": "false"}], False, id="earlier-stage-list"),
    pytest.param({"atelier:final-stage": "true"}, True, id="final-stage"),
    pytest.param({}, True, id="untagged"),  # a job of no run plan is its own final stage
    pytest.param(None, True, id="no-tags"),
])
def test_event_tags_say_whether_the_job_is_a_run_plan_s_final_stage(tags: object, final: bool) -> None:
    assert job_state_from_event(completed_with_tags(tags)).final_stage is final


def test_event_without_tags_is_a_final_stage() -> None:
    assert job_state_from_event(load_event("deploy_job_completed")["detail"]).final_stage is True


def test_completed_earlier_stage_is_recorded_not_deployed(settings: DeploySettings) -> None:
    # GIVEN the Completed event of a run plan's first stage (tagged atelier:final-stage=false)
    state = job_state_from_event(completed_with_tags({"atelier:final-stage": "false"}))

    # WHEN the deploy stage handles it
    result = on_job_state(state, settings)

    # THEN its state is recorded, and no model, config or endpoint is made from it
    item = aws.get_item(settings.table, records.job_pk(COMPLETED_JOB))
    sagemaker = boto3.client("sagemaker")
    assert (result.action, result.endpoint_config) == ("recorded", None)
    assert (item["status"], item["model_data"]) == ("Completed", MODEL_DATA)
    assert sagemaker.list_models()["Models"] == []
    assert sagemaker.list_endpoint_configs()["EndpointConfigs"] == []
    assert aws.describe_endpoint(settings.endpoint_name) is None


def test_completed_final_stage_is_deployed(settings: DeploySettings) -> None:
    state = job_state_from_event(completed_with_tags({"atelier:final-stage": "true"}))

    result = on_job_state(state, settings)

    assert (result.action, result.endpoint_config) == ("created", COMPLETED_JOB)
    assert boto3.client("sagemaker").describe_endpoint(EndpointName=settings.endpoint_name)["EndpointConfigName"] \
        == COMPLETED_JOB
