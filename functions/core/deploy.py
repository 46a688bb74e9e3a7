"""Deploy stage: a Completed training job becomes the endpoint's model; other states are recorded.

Names derive from the job, so a duplicate event finds everything already created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aws_lambda_powertools import Logger

from core import aws, records
from core.errors import BadMessage
from core.settings import DeploySettings

logger = Logger(child=True)
VARIANT = "AllTraffic"


@dataclass(frozen=True)
class JobState:
    name: str
    status: str
    model_data_url: str | None
    failure_reason: str | None
    final_stage: bool = True  # a run plan's earlier stages train on; only the last is served


@dataclass(frozen=True)
class DeployResult:
    action: str  # "recorded" | "created" | "updated" | "unchanged"
    endpoint_config: str | None = None


def job_state_from_event(detail: dict[str, Any]) -> JobState:
    try:
        return JobState(
            name=detail["TrainingJobName"],
            status=detail["TrainingJobStatus"],
            model_data_url=(detail.get("ModelArtifacts") or {}).get("S3ModelArtifacts"),
            failure_reason=detail.get("FailureReason"),
            final_stage=_tags(detail.get("Tags")).get("atelier:final-stage", "true") != "false",
        )
    except KeyError as exc:
        raise BadMessage(f"training job state change without {exc}") from exc


def _tags(tags: object) -> dict[str, str]:
    """Event details carry tags as a map; DescribeTrainingJob-style lists are read too."""
    if isinstance(tags, dict):
        return {str(k): str(v) for k, v in tags.items()}
    if isinstance(tags, list):
        return {str(t.get("Key")): str(t.get("Value")) for t in tags if isinstance(t, dict)}
    return {}


def model_request(job: JobState, settings: DeploySettings) -> dict[str, Any]:
    return {
        "ModelName": job.name,
        "ExecutionRoleArn": settings.role_arn,
        "PrimaryContainer": {"Image": settings.image_uri, "ModelDataUrl": job.model_data_url},
        "EnableNetworkIsolation": True,
        "Tags": [{"Key": "atelier:training-job", "Value": job.name}],
    }


def endpoint_config_request(job: JobState, settings: DeploySettings) -> dict[str, Any]:
    return {
        "EndpointConfigName": job.name,
        "ProductionVariants": [{
            "VariantName": VARIANT, "ModelName": job.name,
            "InstanceType": settings.instance_type, "InitialInstanceCount": 1,
        }],
    }


def on_job_state(job: JobState, settings: DeploySettings) -> DeployResult:
    aws.update_item(settings.table, records.job_pk(job.name), "SET #s = :s, failure_reason = :r, model_data = :m",
                    {":s": job.status, ":r": job.failure_reason or "", ":m": job.model_data_url or ""},
                    names={"#s": "status"})
    if job.status != "Completed" or not job.final_stage:
        logger.info("training job state recorded", extra={"job": job.name, "status": job.status})
        return DeployResult("recorded")
    if not job.model_data_url:
        raise BadMessage(f"Completed job {job.name} has no ModelArtifacts")
    return deploy(job, settings)


def deploy(job: JobState, settings: DeploySettings) -> DeployResult:
    if not aws.sagemaker_exists("model", job.name):
        aws.sagemaker_call("create_model", model_request(job, settings))
    if not aws.sagemaker_exists("endpoint_config", job.name):
        aws.sagemaker_call("create_endpoint_config", endpoint_config_request(job, settings))
    endpoint = aws.describe_endpoint(settings.endpoint_name)
    if endpoint is None:
        aws.sagemaker_call("create_endpoint", {"EndpointName": settings.endpoint_name, "EndpointConfigName": job.name})
        action = "created"
    elif endpoint.get("EndpointConfigName") == job.name:
        action = "unchanged"
    else:
        aws.sagemaker_call("update_endpoint", {"EndpointName": settings.endpoint_name, "EndpointConfigName": job.name})
        action = "updated"
    logger.info("endpoint deployment", extra={"job": job.name, "endpoint": settings.endpoint_name, "action": action})
    return DeployResult(action, job.name)
