"""Refusing requests as SageMaker refuses them: its error shape, its name and member checks, paging.

Every operation answers a bad request with the ApiError AWS would send (botocore turns it into
ClientError with the same code and message), so pipeline code meets here what it meets on AWS.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import botocore.session
from botocore.model import ServiceModel

from core.training.instance_types import has_instance_store

# SageMaker's resource-name rule (jobs, endpoints, endpoint configs); models allow inner runs of '-'.
NAME_PATTERN = r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$"
MODEL_NAME_PATTERN = r"^[a-zA-Z0-9]([\-a-zA-Z0-9]*[a-zA-Z0-9])?$"
MAX_NAME_LENGTH = 63


@dataclass(frozen=True)
class MapLimits:
    """What SageMaker accepts in a string-to-string map: entries, key length and pattern, value length."""

    max_entries: int
    max_key_length: int
    key_pattern: str
    max_value_length: int


@functools.cache
def sagemaker_model() -> ServiceModel:
    """botocore's model of the SageMaker API, loaded once a process (about 40 ms)."""
    return botocore.session.get_session().get_service_model("sagemaker")


def map_limits(map_shape: str) -> MapLimits:
    """The limits botocore's model of SageMaker gives a map shape (botocore checks neither max nor pattern)."""
    shape = sagemaker_model().shape_for(map_shape)
    return MapLimits(shape.metadata["max"], shape.key.metadata["max"], shape.key.metadata["pattern"],
                     shape.value.metadata["max"])


MODEL_ENVIRONMENT = map_limits("EnvironmentMap")  # CreateModel's PrimaryContainer.Environment
TRAINING_ENVIRONMENT = map_limits("TrainingEnvironmentMap")  # CreateTrainingJob's Environment
# Not in the service model; API_ContainerDefinition: "all keys and values in the map, combined, is 32 KB".
MAX_MODEL_ENVIRONMENT_BYTES = 32 * 1024


class ApiError(Exception):
    """A SageMaker error response: botocore raises it as ClientError with this code."""

    def __init__(self, code: str, message: str, status: int = 400, fields: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status
        self.fields = fields or {}


def validation_error(message: str) -> ApiError:
    return ApiError("ValidationException", message)


def check_name(value: Any, member: str, pattern: str = NAME_PATTERN) -> str:
    """The name, or the ValidationException SageMaker gives for one that breaks its rule."""
    if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or not re.fullmatch(pattern, value):
        raise validation_error(
            f"1 validation error detected: Value '{value}' at '{member}' failed to satisfy constraint: "
            f"Member must satisfy regular expression pattern: {pattern}")
    return value


def require(request: Mapping[str, Any], path: str) -> Any:
    """request[a][b] for path "a.b", or the ValidationException for a missing member."""
    value: Any = request
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            member = ".".join(p[0].lower() + p[1:] for p in path.split("."))
            raise validation_error(
                f"1 validation error detected: Value null at '{member}' failed to satisfy constraint: "
                "Member must not be null")
    return value


def check_environment(environment: Any, member: str, limits: MapLimits, max_total_bytes: int | None = None) -> None:
    """The ValidationException SageMaker gives an Environment map that breaks its limits. Like Lambda's
    for its environment, the message names the member but not the value: values may hold secrets."""
    def refuse(constraint: str) -> ApiError:
        return validation_error(f"1 validation error detected: Value at '{member}' failed to satisfy constraint: "
                                f"{constraint}")

    if not isinstance(environment, Mapping) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in environment.items()):
        raise refuse("Member must be a map of strings to strings")
    if len(environment) > limits.max_entries:
        raise refuse(f"Member must have length less than or equal to {limits.max_entries}")
    for key, value in environment.items():
        broken: list[str] = []
        if len(key) > limits.max_key_length:
            broken.append(f"Member must have length less than or equal to {limits.max_key_length}")
        if not re.fullmatch(limits.key_pattern, key):
            broken.append(f"Member must satisfy regular expression pattern: {limits.key_pattern}")
        if broken:
            raise refuse(f"Map keys must satisfy constraint: [{', '.join(broken)}]")
        if len(value) > limits.max_value_length:
            raise refuse("Map value must satisfy constraint: "
                         f"[Member must have length less than or equal to {limits.max_value_length}]")
    if max_total_bytes is None:
        return
    total = sum(len(key.encode()) + len(value.encode()) for key, value in environment.items())
    if total > max_total_bytes:
        raise refuse(f"The maximum length of all keys and values in the map, combined, is {max_total_bytes} bytes; "
                     f"this map has {total}")


def page(items: list[dict[str, Any]], request: Mapping[str, Any], default_size: int = 10) -> tuple[list, str | None]:
    """One page of a List* answer; the NextToken is the offset of the next item."""
    try:
        start = int(request.get("NextToken") or 0)
    except ValueError:
        raise validation_error("Invalid pagination token") from None
    size = int(request.get("MaxResults") or default_size)
    end = start + size
    return items[start:end], (str(end) if end < len(items) else None)


def check_volume_key(instance_type: str, key: str | None, member: str) -> None:
    """SageMaker refuses a KMS key for the volumes of an instance type with instance store (its
    hardware encrypts them; core/training/instance_types.py has the rule and its source)."""
    if key and has_instance_store(instance_type):
        raise validation_error(f"{member} is not supported for instance type {instance_type}: its local instance "
                               "storage is encrypted by the instance's hardware module; do not specify a KMS key "
                               "for it")
