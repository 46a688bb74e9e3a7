"""Tags of the local SageMaker's resources, and the AddTags / ListTags / DeleteTags operations.

One store for every resource kind, keyed by ARN, because the API addresses tags by ARN alone. A
resource's tags start as its Create request's `Tags`, change only through AddTags and DeleteTags,
and go with the resource when it is deleted. The rules are SageMaker's (API reference, `Tag`,
`AddTags`, `ListTags`): at most 50 tags per resource, keys of 1..128 and values of 0..256 letters,
digits, spaces and `_.:/=+-@`, no `aws:` keys; AddTags replaces the value of a key it names again;
DeleteTags ignores keys the resource does not have; ListTags pages with NextToken, MaxResults >= 50;
an ARN of no resource is a ValidationException.
"""

from __future__ import annotations

import re
import threading
import unicodedata
from collections.abc import Mapping
from typing import Any

from atelier.local.sagemaker.validation import page, require, validation_error

MAX_TAGS = 50
MAX_KEY_LENGTH, MAX_VALUE_LENGTH = 128, 256
MIN_LIST_RESULTS = 50
ARN_PATTERN = re.compile(r"arn:aws[a-z-]*:sagemaker:[a-z0-9-]*:[0-9]{12}:.+")
SYMBOLS = frozenset("_.:/=+-@")
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
        arn = checked_arn(request)
        tags = require(request, "Tags")
        added = checked_tags(tags)
        with self._lock:
            current = self._resource(arn)
            merged = {**current, **added}
            if len(merged) > MAX_TAGS:
                raise validation_error(f"Adding {len(added)} tags would give {arn} {len(merged)} tags: a resource "
                                       f"can have at most {MAX_TAGS}.")
            current.update(added)
        return {"Tags": as_list(added)}

    def list_tags(self, request: dict[str, Any]) -> dict[str, Any]:
        arn = checked_arn(request)
        size = request.get("MaxResults")
        if size is not None and int(size) < MIN_LIST_RESULTS:
            raise validation_error(f"1 validation error detected: Value '{size}' at 'maxResults' failed to satisfy "
                                   f"constraint: Member must have value greater than or equal to {MIN_LIST_RESULTS}")
        with self._lock:
            tags = as_list(self._resource(arn))
        items, token = page(tags, request, default_size=MIN_LIST_RESULTS)
        return {"Tags": items, **({"NextToken": token} if token else {})}

    def delete_tags(self, request: dict[str, Any]) -> dict[str, Any]:
        arn = checked_arn(request)
        keys = require(request, "TagKeys")
        if not 1 <= len(keys) <= MAX_TAGS:
            raise validation_error(f"1 validation error detected: Value at 'tagKeys' failed to satisfy constraint: "
                                   f"Member must have length between 1 and {MAX_TAGS}")
        with self._lock:
            current = self._resource(arn)
            for key in keys:
                current.pop(key, None)
        return {}

    def _resource(self, arn: str) -> dict[str, str]:
        """Called under the lock: the live tag map of a resource that exists."""
        if arn not in self._tags:
            raise validation_error(f"Could not find resource {arn}.")
        return self._tags[arn]


def checked_arn(request: Mapping[str, Any]) -> str:
    arn = require(request, "ResourceArn")
    if not isinstance(arn, str) or len(arn) > MAX_VALUE_LENGTH or not ARN_PATTERN.fullmatch(arn):
        raise validation_error(f"1 validation error detected: Value '{arn}' at 'resourceArn' failed to satisfy "
                               f"constraint: Member must satisfy regular expression pattern: {ARN_PATTERN.pattern}")
    return arn


def checked_tags(tags: Any) -> dict[str, str]:
    """A request's Tags list (None: none) as {key: value}, or the ValidationException SageMaker gives for it."""
    tags = [] if tags is None else tags
    if not isinstance(tags, list) or len(tags) > MAX_TAGS:
        raise validation_error(f"1 validation error detected: Value at 'tags' failed to satisfy constraint: "
                               f"Member must have length less than or equal to {MAX_TAGS}")
    checked: dict[str, str] = {}
    for tag in tags:
        key, value = require(tag, "Key"), require(tag, "Value")
        check_text(key, "key", 1, MAX_KEY_LENGTH)
        check_text(value, "value", 0, MAX_VALUE_LENGTH)
        if key.lower().startswith(RESERVED_PREFIX):
            raise validation_error(f"Tag key '{key}' is invalid: keys starting with '{RESERVED_PREFIX}' are reserved "
                                   "for AWS use.")
        checked[key] = value
    return checked


def check_text(text: Any, member: str, low: int, high: int) -> None:
    # SageMaker's pattern is [\p{L}\p{Z}\p{N}_.:/=+\-@]*: Unicode letters, separators and numbers
    allowed = isinstance(text, str) and all(
        c in SYMBOLS or unicodedata.category(c)[0] in "LZN" for c in text)
    if not allowed or not low <= len(text) <= high:
        raise validation_error(f"1 validation error detected: Value '{text}' at 'tags.member.{member}' failed to "
                               f"satisfy constraint: Member must have length between {low} and {high} and satisfy "
                               r"regular expression pattern: ([\p{L}\p{Z}\p{N}_.:/=+\-@]*)")


def as_list(tags: Mapping[str, str]) -> list[dict[str, str]]:
    return [{"Key": key, "Value": value} for key, value in tags.items()]
