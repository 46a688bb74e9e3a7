"""Refusing requests as SageMaker refuses them: its error shape, its name and member checks, paging.

Every operation answers a bad request with the ApiError AWS would send (botocore turns it into
ClientError with the same code and message), so pipeline code meets here what it meets on AWS.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from core.training.instance_types import has_instance_store

# SageMaker's resource-name rule (jobs, endpoints, endpoint configs); models allow inner runs of '-'.
NAME_PATTERN = r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$"
MODEL_NAME_PATTERN = r"^[a-zA-Z0-9]([\-a-zA-Z0-9]*[a-zA-Z0-9])?$"
MAX_NAME_LENGTH = 63


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
