"""Typed settings, parsed once from the environment that template.yaml gives each function."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping

from core.errors import ConfigError


def _require(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(f"environment variable {name} is not set (template.yaml sets it)")
    return value


def _int(env: Mapping[str, str], name: str) -> int:
    raw = _require(env, name)
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc


@dataclass(frozen=True)
class IngestSettings:
    table: str
    pack_queue_url: str
    max_upload_bytes: int
    max_image_pixels: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "IngestSettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            pack_queue_url=_require(env, "PACK_QUEUE_URL"),
            max_upload_bytes=_int(env, "MAX_UPLOAD_BYTES"),
            max_image_pixels=_int(env, "MAX_IMAGE_PIXELS"),
        )


@dataclass(frozen=True)
class PackSettings:
    table: str
    data_bucket: str
    event_bus: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "PackSettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            data_bucket=_require(env, "DATA_BUCKET"),
            event_bus=_require(env, "EVENT_BUS_NAME"),
        )


@dataclass(frozen=True)
class TrainingSettings:
    table: str
    data_bucket: str
    models_bucket: str
    quota: int
    role_arn: str
    image_uri: str
    instance_type: str
    instance_count: int
    volume_gb: int
    max_runtime_s: int
    max_retries: int
    lineage: str
    hyperparameters: dict[str, str]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "TrainingSettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            data_bucket=_require(env, "DATA_BUCKET"),
            models_bucket=_require(env, "MODELS_BUCKET"),
            quota=_int(env, "TRAINING_QUOTA"),
            role_arn=_require(env, "SAGEMAKER_ROLE_ARN"),
            image_uri=_require(env, "TRAINING_IMAGE_URI"),
            instance_type=_require(env, "TRAINING_INSTANCE_TYPE"),
            instance_count=_int(env, "TRAINING_INSTANCE_COUNT"),
            volume_gb=_int(env, "TRAINING_VOLUME_GB"),
            max_runtime_s=_int(env, "TRAINING_MAX_RUNTIME_S"),
            max_retries=_int(env, "TRAINING_MAX_RETRIES"),
            lineage=_require(env, "TRAINING_LINEAGE"),
            hyperparameters=_hyperparameters(_require(env, "TRAINING_HYPERPARAMETERS")),
        )


@dataclass(frozen=True)
class DeploySettings:
    table: str
    role_arn: str
    image_uri: str
    endpoint_name: str
    instance_type: str

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "DeploySettings":
        return cls(
            table=_require(env, "PIPELINE_TABLE"),
            role_arn=_require(env, "SAGEMAKER_ROLE_ARN"),
            image_uri=_require(env, "INFERENCE_IMAGE_URI"),
            endpoint_name=_require(env, "ENDPOINT_NAME"),
            instance_type=_require(env, "ENDPOINT_INSTANCE_TYPE"),
        )


def _hyperparameters(raw: str) -> dict[str, str]:
    """SageMaker hyperparameters are a flat map of strings; reject anything else early."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"TRAINING_HYPERPARAMETERS is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError("TRAINING_HYPERPARAMETERS must be a JSON object")
    nested = sorted(k for k, v in value.items() if isinstance(v, (dict, list)))
    if nested:
        raise ConfigError(f"TRAINING_HYPERPARAMETERS must be flat; {nested} hold objects or lists")
    return {str(k): str(v) for k, v in value.items()}
