"""Tags of the local SageMaker's resources, and the AddTags / ListTags / DeleteTags operations.

One store for every resource kind, keyed by ARN, because the API addresses tags by ARN alone. A
resource's tags start as its Create request's `Tags`, change only through AddTags and DeleteTags,
and go with the resource when it is deleted. Lengths, patterns and list sizes are botocore's model
(shape_checks.py). The rest, with their sources: at most 50 tags per resource and no `aws:` keys
("Tagging AWS resources", tag naming limits); AddTags overwrites the value of a key it names again
and DeleteTags takes keys (API reference, AddTags, DeleteTags); an ARN of no resource is a
ValidationException ("Could not find resource", as SageMaker answers).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from atelier.local.sagemaker.validation import page, validation_error

MAX_TAGS = 50  # per resource ("Tagging AWS resources")
LIST_PAGE_SIZE = 50  # ListTags' MaxResults is at least 50 (botocore's model)
RESERVED_PREFIX = "aws:"


class ResourceTags:
    """Every resource's tags, {ARN: {key: value}} in the order the keys were first added."""

    def __init__(self) -> None:
        self._tags: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    # --- what resources do at create and delete ---------------------------------------------------

    def created(self, arn: str, tags: Mapping[str, str]) -> None:
        """A resource came to be with its request's Tags (`checked_tags` of them, checked before the
        resource was made: a refused request must leave no tags behind)."""
        with self._lock:
            self._tags[arn] = dict(tags)

    def deleted(self, arn: str) -> None:
        with self._lock:
            self._tags.pop(arn, None)

    def of(self, arn: str) -> dict[str, str]:
        """The resource's tags now, as SageMaker's events carry them: {key: value}."""
        with self._lock:
            return dict(self._tags.get(arn, {}))

    # --- the API -----------------------------------------------------------------------------------

    def add_tags(self, request: dict[str, Any]) -> dict[str, Any]:
        arn, added = request["ResourceArn"], checked_tags(request["Tags"])
        with self._lock:
            current = self._resource(arn)
            merged = {**current, **added}
            if len(merged) > MAX_TAGS:
                raise validation_error(f"Adding {len(added)} tags would give {arn} {len(merged)} tags: a resource "
                                       f"can have at most {MAX_TAGS}.")
            current.update(added)
        return {"Tags": as_list(added)}

    def list_tags(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            tags = as_list(self._resource(request["ResourceArn"]))
        items, token = page(tags, request, default_size=LIST_PAGE_SIZE)
        return {"Tags": items, **({"NextToken": token} if token else {})}

    def delete_tags(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            current = self._resource(request["ResourceArn"])
            for key in request["TagKeys"]:
                current.pop(key, None)
        return {}

    def _resource(self, arn: str) -> dict[str, str]:
        """Called under the lock: the live tag map of a resource that exists."""
        if arn not in self._tags:
            raise validation_error(f"Could not find resource {arn}.")
        return self._tags[arn]


def checked_tags(tags: list[dict[str, str]] | None) -> dict[str, str]:
    """A request's Tags list (None: none), shape-checked already, as {key: value}; keys starting with
    `aws:` are AWS's own and refused."""
    checked = {tag["Key"]: tag["Value"] for tag in tags or []}
    for key in checked:
        if key.lower().startswith(RESERVED_PREFIX):
            raise validation_error(f"Tag key '{key}' is invalid: keys starting with '{RESERVED_PREFIX}' are reserved "
                                   "for AWS use.")
    return checked


def as_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": key, "Value": value} for key, value in tags.items()]
