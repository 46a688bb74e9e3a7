"""Reading S3 event notifications, from real S3 and from moto alike."""

from __future__ import annotations

import json
import re
from urllib.parse import unquote_plus

from contracts.messages import UploadRef
from core.errors import BadMessage, RejectedUpload

PARTNER_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")  # always used with fullmatch
SIDECAR_SUFFIX = ".json"


def parse_notification(body: str) -> list[UploadRef]:
    """Return the created objects named by an S3 notification; `s3:TestEvent` names none."""
    try:
        message = json.loads(body)
    except json.JSONDecodeError as exc:
        raise BadMessage(f"not JSON: {exc}") from exc
    if not isinstance(message, dict):
        raise BadMessage("an S3 notification is a JSON object")
    if message.get("Event") == "s3:TestEvent":
        return []
    records = message.get("Records")
    if not isinstance(records, list):
        raise BadMessage("no Records in S3 notification")
    if not all(isinstance(r, dict) for r in records):
        raise BadMessage("every S3 record is a JSON object")
    return [_upload_ref(r) for r in records if str(r.get("eventName", "")).startswith("ObjectCreated")]


def _upload_ref(record: dict) -> UploadRef:
    try:
        s3 = record["s3"]
        return UploadRef(
            bucket=s3["bucket"]["name"],
            # S3 encodes keys as in a form: '+' is a space, a literal '+' arrives as %2B.
            key=unquote_plus(s3["object"]["key"]),
            size=int(s3["object"].get("size", 0)),
            event_time=record.get("eventTime", ""),
            etag=str(s3["object"].get("eTag", "")).strip('"'),
            version_id=str(s3["object"].get("versionId") or ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BadMessage(f"malformed S3 record: {exc!r}") from exc


def partner_of(key: str) -> str:
    """The partner id is the first key segment; anything else is not a partner upload."""
    partner = key.split("/", 1)[0]
    if "/" not in key or not PARTNER_PATTERN.fullmatch(partner):
        raise RejectedUpload("bad_key", f"{key!r} is not <partner>/<path> with a lower-case partner id")
    return partner


def is_sidecar(key: str) -> bool:
    return key.lower().endswith(SIDECAR_SUFFIX)


def sidecar_key(key: str) -> str:
    """`partner/a/b.jpg` -> `partner/a/b.json`."""
    stem = key.rsplit(".", 1)[0] if "." in key.rsplit("/", 1)[-1] else key
    return stem + SIDECAR_SUFFIX


def parse_sidecar(raw: bytes | None, max_bytes: int, max_depth: int) -> dict:
    """A sidecar's JSON object, refused (`bad_sidecar`) when over `max_bytes` or nested deeper
    than `max_depth`. `raw` is at most max_bytes + 1 bytes of it (a ranged read), None if absent."""
    if raw is None:
        return {}
    if len(raw) > max_bytes:
        raise RejectedUpload("bad_sidecar", f"the sidecar is over {max_bytes} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise RejectedUpload("bad_sidecar", f"the sidecar is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(value, dict):
        raise RejectedUpload("bad_sidecar", "the sidecar is not a JSON object")
    if _depth(value) > max_depth:
        raise RejectedUpload("bad_sidecar", f"the sidecar's JSON is nested deeper than {max_depth}")
    return value


def _depth(value: object) -> int:
    """Nesting depth: a scalar is 0, `{}` and `{"a": 1}` are 1."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0
