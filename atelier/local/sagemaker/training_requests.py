"""CreateTrainingJob's request: what the local runner checks and the defaults DescribeTrainingJob shows."""

from __future__ import annotations

import json
from typing import Any

from atelier.local.sagemaker.s3_transfers import S3Uri
from atelier.local.sagemaker.training_instances import CONTAINER_CHECKPOINTS, CONTAINER_TENSORBOARD
from atelier.local.sagemaker.validation import (
    TRAINING_ENVIRONMENT,
    check_environment,
    check_volume_key,
    require,
    validation_error,
)

DEFAULT_MAX_RUNTIME = 86400  # SageMaker's default: one day


def normalise_request(request: dict[str, Any]) -> dict[str, Any]:
    """Check what the local runner needs and fill the defaults DescribeTrainingJob shows."""
    for member in ("RoleArn", "AlgorithmSpecification.TrainingImage", "OutputDataConfig.S3OutputPath",
                   "ResourceConfig", "StoppingCondition"):
        require(request, member)
    S3Uri.parse(request["OutputDataConfig"]["S3OutputPath"], "S3OutputPath")
    if request.get("Environment") is not None:
        check_environment(request["Environment"], "environment", TRAINING_ENVIRONMENT)
    check_volume_key(require(request, "ResourceConfig.InstanceType"), request["ResourceConfig"].get("VolumeKmsKeyId"),
                     "VolumeKmsKeyId")
    if request.get("CheckpointConfig"):
        S3Uri.parse(require(request, "CheckpointConfig.S3Uri"), "CheckpointConfig.S3Uri")
    if request.get("TensorBoardOutputConfig"):
        S3Uri.parse(require(request, "TensorBoardOutputConfig.S3OutputPath"), "TensorBoardOutputConfig.S3OutputPath")
    normalised = json.loads(json.dumps(request))  # a deep copy the caller cannot change
    normalised.setdefault("HyperParameters", {})
    normalised["ResourceConfig"].setdefault("InstanceCount", 1)
    check_range(normalised["ResourceConfig"]["InstanceCount"], "resourceConfig.instanceCount", 1)
    if normalised.get("RetryStrategy") is not None:
        require(normalised, "RetryStrategy.MaximumRetryAttempts")  # its 1..30: shape_checks, before this
    normalised["StoppingCondition"].setdefault("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
    if normalised.get("CheckpointConfig"):
        normalised["CheckpointConfig"].setdefault("LocalPath", CONTAINER_CHECKPOINTS)
    if normalised.get("TensorBoardOutputConfig"):
        normalised["TensorBoardOutputConfig"].setdefault("LocalPath", CONTAINER_TENSORBOARD)
    names = [require(channel, "ChannelName") for channel in normalised.get("InputDataConfig", [])]
    if len(names) != len(set(names)):
        raise validation_error(f"Channel names must be unique: {names}")
    for channel in normalised.get("InputDataConfig", []):
        source = channel.get("DataSource", {}).get("S3DataSource")
        if source:
            source.setdefault("S3DataDistributionType", "FullyReplicated")
            S3Uri.parse(require(source, "S3Uri"), "S3DataSource.S3Uri")
    return normalised


def check_range(value: Any, member: str, low: int, high: int | None = None) -> None:
    """The ValidationException SageMaker gives an integer member out of its range."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise validation_error(f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy "
                               f"constraint: Member must have value greater than or equal to {low}")
    if high is not None and value > high:
        raise validation_error(f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy "
                               f"constraint: Member must have value less than or equal to {high}")
