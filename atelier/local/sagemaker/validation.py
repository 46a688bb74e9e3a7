"""Refusing requests as SageMaker refuses them: its error shape, the rules botocore's model does not
hold (each with its source), what the local SageMaker does not emulate, paging.

Every operation answers a bad request with the ApiError AWS would send (botocore turns it into
ClientError with the same code and message), so pipeline code meets here what it meets on AWS.
What botocore's model holds (types, required members, lengths, ranges, patterns, enums) is
checked for every request first, by shape_checks.py.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import botocore.session
from botocore.model import ServiceModel

from core.start_training.instance_types import has_instance_store

# API reference, ContainerDefinition.Environment: "The maximum length of all keys and values in the
# map, combined, is 32 KB" (not in botocore's model).
MAX_MODEL_ENVIRONMENT_BYTES = 32 * 1024


@functools.cache
def sagemaker_model() -> ServiceModel:
    """botocore's model of the SageMaker API, loaded once a process (about 40 ms)."""
    return botocore.session.get_session().get_service_model("sagemaker")


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


def not_emulated(what: str) -> ApiError:
    """A request AWS may accept that the local SageMaker cannot run (docs/local-sagemaker.md, "Not emulated")."""
    return validation_error(f"The local SageMaker does not emulate {what}")


def check_model_environment_size(environment: Mapping[str, str]) -> None:
    """CreateModel's Environment over 32 KB in all; the message leaves the values out (they may be secrets)."""
    total = sum(len(key.encode()) + len(value.encode()) for key, value in environment.items())
    if total > MAX_MODEL_ENVIRONMENT_BYTES:
        raise validation_error("1 validation error detected: Value at 'primaryContainer.environment' failed to "
                               f"satisfy constraint: The maximum length of all keys and values in the map, combined, "
                               f"is {MAX_MODEL_ENVIRONMENT_BYTES} bytes; this map has {total}")


def page(items: list[dict[str, Any]], request: Mapping[str, Any], default_size: int = 10) -> tuple[list, str | None]:
    """One page of a List* answer; the NextToken is the offset of the next item."""
    try:
        start = int(request.get("NextToken") or 0)
    except ValueError:
        raise validation_error("Invalid pagination token") from None
    end = start + int(request.get("MaxResults") or default_size)
    return items[start:end], (str(end) if end < len(items) else None)


def listing(summaries: list[dict[str, Any]], request: Mapping[str, Any], kind: str, key: str,
            default_order: str) -> dict[str, Any]:
    """A List* answer: NameContains, StatusEquals, CreationTimeBefore/After, SortBy, SortOrder (Ascending by
    default for ListTrainingJobs, Descending for ListModels and ListEndpoints, as their API references say), paged."""
    if request.get("NameContains"):
        summaries = [s for s in summaries if request["NameContains"] in s[f"{kind}Name"]]
    if request.get("StatusEquals"):
        summaries = [s for s in summaries if s.get(f"{kind}Status") == request["StatusEquals"]]
    if request.get("CreationTimeBefore") is not None:  # botocore sends timestamps as epoch seconds
        summaries = [s for s in summaries if s["CreationTime"].timestamp() < float(request["CreationTimeBefore"])]
    if request.get("CreationTimeAfter") is not None:
        summaries = [s for s in summaries if s["CreationTime"].timestamp() > float(request["CreationTimeAfter"])]
    sort_key = {"Name": f"{kind}Name", "Status": f"{kind}Status"}.get(request.get("SortBy", ""), "CreationTime")
    summaries.sort(key=lambda s: s[sort_key], reverse=request.get("SortOrder", default_order) == "Descending")
    items, token = page(summaries, request)
    return {key: items, **({"NextToken": token} if token else {})}


def check_volume_key(instance_type: str, key: str | None, member: str) -> None:
    """SageMaker refuses a KMS key for the volumes of an instance type with instance store (API reference,
    ResourceConfig.VolumeKmsKeyId and CreateEndpointConfig.KmsKeyId; core/start_training/instance_types.py)."""
    if key and has_instance_store(instance_type):
        raise validation_error(f"{member} is not supported for instance type {instance_type}: its local instance "
                               "storage is encrypted by the instance's hardware module; do not specify a KMS key "
                               "for it")
