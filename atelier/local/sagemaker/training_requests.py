"""CreateTrainingJob's request: the checks botocore's model leaves out and the defaults DescribeTrainingJob shows."""

from __future__ import annotations

import json
from typing import Any

from atelier.local.sagemaker.s3_transfers import S3Uri
from atelier.local.sagemaker.training_instances import CONTAINER_CHECKPOINTS, CONTAINER_TENSORBOARD
from atelier.local.sagemaker.validation import check_volume_key, not_emulated, validation_error

# API reference, StoppingCondition.MaxRuntimeInSeconds: "The default value is 1 day."
DEFAULT_MAX_RUNTIME = 86400


def normalise_request(request: dict[str, Any]) -> dict[str, Any]:
    """Check what shape_checks cannot and fill the defaults DescribeTrainingJob shows."""
    if not (request.get("AlgorithmSpecification") or {}).get("TrainingImage"):
        raise not_emulated("a training job without AlgorithmSpecification.TrainingImage (AlgorithmName)")
    resources = request.get("ResourceConfig") or {}
    if not resources.get("InstanceType"):
        raise not_emulated("a training job without ResourceConfig.InstanceType (InstanceGroups, training plans)")
    if resources.get("InstanceCount", 1) < 1:  # the model allows 0, for InstanceGroups: not emulated
        raise validation_error(f"1 validation error detected: Value '{resources['InstanceCount']}' at "
                               "'resourceConfig.instanceCount' failed to satisfy constraint: Member must have value "
                               "greater than or equal to 1")
    check_volume_key(resources["InstanceType"], resources.get("VolumeKmsKeyId"), "VolumeKmsKeyId")
    # botocore's pattern also takes https:// URLs; every transfer here is an S3 call
    S3Uri.parse(request["OutputDataConfig"]["S3OutputPath"], "S3OutputPath")
    for member, uri in (("CheckpointConfig", "S3Uri"), ("TensorBoardOutputConfig", "S3OutputPath")):
        if request.get(member):
            S3Uri.parse(request[member][uri], f"{member}.{uri}")
    normalised = json.loads(json.dumps(request))  # a deep copy the caller cannot change
    normalised.setdefault("HyperParameters", {})
    normalised["ResourceConfig"].setdefault("InstanceCount", 1)
    normalised.setdefault("StoppingCondition", {}).setdefault("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME)
    if normalised.get("CheckpointConfig"):
        normalised["CheckpointConfig"].setdefault("LocalPath", CONTAINER_CHECKPOINTS)
    if normalised.get("TensorBoardOutputConfig"):
        normalised["TensorBoardOutputConfig"].setdefault("LocalPath", CONTAINER_TENSORBOARD)
    channels = normalised.get("InputDataConfig", [])
    names = [channel["ChannelName"] for channel in channels]
    # Developer Guide, "How Amazon SageMaker provides training information": a channel is
    # /opt/ml/input/data/<ChannelName> and inputdataconfig.json is keyed by its name
    if len(names) != len(set(names)):
        raise validation_error(f"Channel names must be unique: {names}")
    for channel in channels:
        source = channel["DataSource"].get("S3DataSource")
        if source:  # API reference, S3DataSource.S3DataDistributionType: FullyReplicated unless given
            source.setdefault("S3DataDistributionType", "FullyReplicated")
            S3Uri.parse(source["S3Uri"], "S3DataSource.S3Uri")
    return normalised
