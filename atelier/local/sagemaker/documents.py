"""Describe documents: their timestamps as the wire, the events and the state files spell them, and
the JSON state files written from them."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def utc_now() -> datetime:
    return datetime.now(UTC)


def convert_times(value: Any, stamp: Callable[[datetime], Any]) -> Any:
    """A copy of a describe-like document with every datetime passed through stamp."""
    if isinstance(value, datetime):
        return stamp(value)
    if isinstance(value, Mapping):
        return {key: convert_times(item, stamp) for key, item in value.items()}
    if isinstance(value, list):
        return [convert_times(item, stamp) for item in value]
    return value


def epoch_seconds(moment: datetime) -> float:
    """The JSON protocol's timestamp (botocore parses epoch seconds)."""
    return moment.timestamp()


def epoch_millis(moment: datetime) -> int:
    """SageMaker's EventBridge events carry epoch milliseconds."""
    return int(moment.timestamp() * 1000)


def write_state(path: Path, document: Mapping[str, Any]) -> None:
    """Write a describe document for humans and `atelier` status commands; atomic so a reader
    never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    temporary.write_text(json.dumps(convert_times(document, datetime.isoformat), indent=2, sort_keys=True))
    os.replace(temporary, path)
