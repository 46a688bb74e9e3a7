"""SageMaker: training jobs, models, endpoint configs and endpoints, their tags, and the
Application Auto Scaling of an endpoint's variant."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError

from core.aws import clients
from core.aws.clients import error_code


class ServiceQuotaExceeded(RuntimeError):
    """CreateTrainingJob's ResourceLimitExceeded: the account's quota for the instance type is used up."""


def create_training_job(request: dict[str, Any]) -> bool:
    """Start a job; False when a job of that name exists already (a redelivered event)."""
    try:
        clients.client("sagemaker").create_training_job(**request)
        return True
    except ClientError as exc:
        if error_code(exc) == "ResourceInUse":
            return False
        if error_code(exc) == "ResourceLimitExceeded":
            raise ServiceQuotaExceeded(f"ResourceLimitExceeded: {exc.response['Error'].get('Message', '')}") from exc
        raise


def describe_training_job(name: str) -> dict[str, Any] | None:
    try:
        return clients.client("sagemaker").describe_training_job(TrainingJobName=name)
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return None
        raise


def sagemaker_exists(kind: str, name: str) -> bool:
    """Whether a Model / EndpointConfig / Endpoint of that name exists."""
    describe = getattr(clients.client("sagemaker"), f"describe_{kind}")
    try:
        describe(**{f"{''.join(p.title() for p in kind.split('_'))}Name": name})
        return True
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return False
        raise


def describe_endpoint(name: str) -> dict[str, Any] | None:
    try:
        return clients.client("sagemaker").describe_endpoint(EndpointName=name)
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound"}:
            return None
        raise


def sagemaker_call(operation: str, request: dict[str, Any]) -> dict[str, Any]:
    return getattr(clients.client("sagemaker"), operation)(**request)


def sagemaker_tags(arn: str) -> dict[str, str]:
    tags: dict[str, str] = {}
    for page in clients.client("sagemaker").get_paginator("list_tags").paginate(ResourceArn=arn):
        tags.update({t["Key"]: t["Value"] for t in page.get("Tags", [])})
    return tags


def training_job_tags(name: str) -> dict[str, str] | None:
    """A training job's tags as SageMaker lists them (on the ARN DescribeTrainingJob gives); None when
    SageMaker will not say: no such job, or the caller may not read them. Other errors raise (the
    function's retries, then its DLQ)."""
    described = describe_training_job(name)
    if described is None:
        return None
    try:
        return sagemaker_tags(described["TrainingJobArn"])
    except ClientError as exc:
        if error_code(exc) in {"ValidationException", "ResourceNotFound", "AccessDeniedException", "AccessDenied"}:
            return None
        raise


def register_scalable_target(resource_id: str, minimum: int, maximum: int) -> None:
    clients.client("application-autoscaling").register_scalable_target(
        ServiceNamespace="sagemaker", ResourceId=resource_id,
        ScalableDimension="sagemaker:variant:DesiredInstanceCount", MinCapacity=minimum, MaxCapacity=maximum)


def put_target_tracking_policy(resource_id: str, name: str, target: float) -> None:
    clients.client("application-autoscaling").put_scaling_policy(
        PolicyName=name, ServiceNamespace="sagemaker", ResourceId=resource_id,
        ScalableDimension="sagemaker:variant:DesiredInstanceCount", PolicyType="TargetTrackingScaling",
        TargetTrackingScalingPolicyConfiguration={
            "TargetValue": target,
            "PredefinedMetricSpecification": {"PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
            "ScaleInCooldown": 300, "ScaleOutCooldown": 60})
