"""Ingest's input limits: sidecar size and depth, caption length; each refused with a clear reason."""

from __future__ import annotations

import json

import pytest

from core.errors import RejectedUpload
from core.ingest import uploads
from tests.functions.test_ingest import RED, ingest, pack_messages, uploads_table  # noqa: F401  (ingest: fixture)


@pytest.mark.parametrize("raw, detail", [
    (b'{"caption": "' + b"x" * 100 + b'"}', "the sidecar is over 64 bytes"),
    (b'{"caption": [[[["deep"]]]]}', "the sidecar's JSON is nested deeper than 4"),
    (b"[1, 2]", "the sidecar is not a JSON object"),
    (b"{not json", "the sidecar is not JSON"),
])
def test_a_bad_sidecar_is_refused_with_the_reason(raw: bytes, detail: str) -> None:
    with pytest.raises(RejectedUpload) as refused:
        uploads.parse_sidecar(raw, max_bytes=64, max_depth=4)
    assert refused.value.reason == "bad_sidecar" and refused.value.detail.startswith(detail)


def test_a_sidecar_within_the_limits_is_read_and_none_is_empty() -> None:
    assert uploads.parse_sidecar(b'{"caption": "a", "extra": {"k": [1]}}', 64, 3) == {"caption": "a", "extra": {"k": [1]}}
    assert uploads.parse_sidecar(None, 64, 3) == {}


@pytest.mark.parametrize("sidecar, env, reason, detail", [
    (b'{"caption": "' + b"x" * 300 + b'"}', {"MAX_SIDECAR_BYTES": "256"}, "bad_sidecar", "the sidecar is over 256 bytes"),
    (json.dumps({"caption": "x" * 51}).encode(), {"MAX_CAPTION_CHARS": "50"}, "caption_too_long",
     "sidecar caption of 51 characters > 50"),
    (b'{"caption": {"nested": 1}}', {}, "bad_sidecar", "caption, license and source must be strings: ('caption',)"),
])
def test_ingest_quarantines_uploads_over_a_limit(ingest, stack, monkeypatch, sidecar, env, reason, detail) -> None:  # noqa: F811
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ingest({"partner-a/red.json": sidecar, "partner-a/red.png": RED})
    record = uploads_table(stack)["partner-a/red.png"]
    assert (record["status"], record["reason"], record["detail"]) == ("quarantined", reason, detail)
    assert pack_messages(stack) == []


def test_ingest_reads_no_more_of_a_sidecar_than_its_limit(ingest, stack, monkeypatch) -> None:  # noqa: F811
    from core import aws
    reads: list[int] = []
    real = aws.s3.read_object  # the one aws.read_prefix_if_exists calls
    monkeypatch.setattr(aws.s3, "read_object", lambda b, k, max_bytes=None: reads.append(max_bytes) or real(b, k, max_bytes))
    monkeypatch.setenv("MAX_SIDECAR_BYTES", "1000")
    ingest({"partner-a/red.json": b'{"caption": "' + b"x" * 5_000_000 + b'"}', "partner-a/red.png": RED})
    assert reads[0] == 1001 and uploads_table(stack)["partner-a/red.png"]["reason"] == "bad_sidecar"
