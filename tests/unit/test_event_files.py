"""The files in events/ are what AWS would deliver: every SQS record's md5OfBody is its body's MD5."""

from __future__ import annotations

import hashlib
import json

import pytest
from tests.support import EVENTS


def sqs_records() -> list[tuple[str, dict]]:
    """(file name, record) for every SQS record of every event file."""
    found = []
    for path in sorted(EVENTS.glob("*.json")):
        document = json.loads(path.read_text())
        records = document.get("Records", []) if isinstance(document, dict) else []
        found += [(path.name, r) for r in records if r.get("eventSource") == "aws:sqs"]
    return found


def test_the_event_files_hold_sqs_records() -> None:
    # the check below must not pass by finding nothing: an SQS event per queue handler at least
    assert {name.split("_")[0] for name, _ in sqs_records()} >= {"ingest", "pack", "import"}


@pytest.mark.parametrize(("name", "record"), sqs_records(), ids=lambda v: v if isinstance(v, str) else v["messageId"])
def test_md5_of_body_is_the_md5_of_the_body(name: str, record: dict) -> None:
    # SQS computes it over the body's UTF-8 bytes; Powertools' and the SDKs' checks compare against that
    assert record["md5OfBody"] == hashlib.md5(record["body"].encode("utf-8")).hexdigest()
