"""core.ingest.uploads: reading S3 notifications, partner ids and sidecar keys."""

from __future__ import annotations

import json

import pytest

from contracts.messages import UploadRef
from core.errors import BadMessage, RejectedUpload
from core.ingest.uploads import parse_notification, partner_of, sidecar_key

BUCKET = "atelier-uploads-123456789012-us-east-1"


def record(key: str, event: str = "ObjectCreated:Put", size: int = 1234) -> dict:
    """One S3 event record as S3 (and moto) sends it, the key URL-encoded."""
    return {
        "eventVersion": "2.1", "eventSource": "aws:s3", "eventName": event,
        "eventTime": "2026-11-29T12:00:00.000Z",
        "s3": {"bucket": {"name": BUCKET}, "object": {"key": key, "size": size}},
    }


def notification(*records: dict) -> str:
    return json.dumps({"Records": list(records)})


# --- parse_notification --------------------------------------------------------------------------

def test_parse_notification_returns_the_created_object() -> None:
    refs = parse_notification(notification(record("partner-a/cat.jpg")))

    assert refs == [UploadRef(bucket=BUCKET, key="partner-a/cat.jpg", size=1234,
                              event_time="2026-11-29T12:00:00.000Z")]


@pytest.mark.parametrize(("encoded", "decoded"), [
    ("partner-a/summer+catalog/red+circle.png", "partner-a/summer catalog/red circle.png"),
    ("partner-a/a%2Bb.png", "partner-a/a+b.png"),
    ("partner-a/%C3%B6lgem%C3%A4lde.jpg", "partner-a/ölgemälde.jpg"),
    ("partner-a%2Fnested%2Fx.jpg", "partner-a/nested/x.jpg"),  # moto encodes '/' too
    ("partner-a/2026+summer/Caf%C3%A9+au+lait+%2B+cr%C3%A8me.jpg", "partner-a/2026 summer/Café au lait + crème.jpg"),
    ("partner-a/100%25+real+%26+true.jpg", "partner-a/100% real & true.jpg"),
    ("partner-a/%E7%8C%AB/%F0%9F%90%88.png", "partner-a/猫/🐈.png"),
    ("partner-a/Cafe%CC%81.jpg", "partner-a/Cafe\u0301.jpg"),  # macOS names arrive decomposed (NFD): kept as is
    ("partner-a/a++b.jpg", "partner-a/a  b.jpg"),
])
def test_parse_notification_url_decodes_keys(encoded: str, decoded: str) -> None:
    [ref] = parse_notification(notification(record(encoded)))

    assert ref.key == decoded


def test_s3_test_event_names_no_objects() -> None:
    body = json.dumps({"Service": "Amazon S3", "Event": "s3:TestEvent", "Time": "2026-11-29T12:00:00.000Z",
                       "Bucket": BUCKET, "RequestId": "R", "HostId": "H"})

    assert parse_notification(body) == []


def test_records_other_than_object_created_are_skipped() -> None:
    body = notification(
        record("partner-a/gone.jpg", event="ObjectRemoved:Delete"),
        record("partner-a/kept.jpg", event="ObjectCreated:CompleteMultipartUpload"),
        record("partner-a/restored.jpg", event="ObjectRestore:Completed"),
    )

    assert [ref.key for ref in parse_notification(body)] == ["partner-a/kept.jpg"]


def test_records_keep_their_order() -> None:
    body = notification(record("partner-a/2.jpg"), record("partner-a/1.jpg"), record("partner-a/3.jpg"))

    assert [ref.key for ref in parse_notification(body)] == ["partner-a/2.jpg", "partner-a/1.jpg", "partner-a/3.jpg"]


def without_object_key() -> str:
    broken = record("partner-a/x.jpg")
    del broken["s3"]["object"]["key"]
    return notification(broken)


def without_bucket() -> str:
    broken = record("partner-a/x.jpg")
    del broken["s3"]["bucket"]
    return notification(broken)


@pytest.mark.parametrize("body", [
    pytest.param("{not json", id="malformed-json"),
    pytest.param("", id="empty-body"),
    pytest.param(json.dumps(["a", "list"]), id="not-an-object"),
    pytest.param(json.dumps({"Service": "Amazon S3"}), id="no-records"),
    pytest.param(json.dumps({"Records": {"eventName": "ObjectCreated:Put"}}), id="records-not-a-list"),
    pytest.param(without_object_key(), id="missing-object-key"),
    pytest.param(without_bucket(), id="missing-bucket"),
    pytest.param(notification({**record("partner-a/x.jpg"), "s3": None}), id="s3-not-an-object"),
    pytest.param(notification(record("partner-a/x.jpg", size="big")), id="size-not-a-number"),  # type: ignore[arg-type]
    pytest.param(json.dumps({"Records": ["ObjectCreated:Put"]}), id="record-not-an-object"),
])
def test_malformed_notifications_raise_bad_message(body: str) -> None:
    with pytest.raises(BadMessage):
        parse_notification(body)


# --- partner_of ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "partner"), [
    ("partner-a/x.jpg", "partner-a"),
    ("p/a/b/c.png", "p"),
    ("42/x.jpg", "42"),
    ("a" * 64 + "/x.jpg", "a" * 64),
])
def test_partner_of_returns_the_first_segment(key: str, partner: str) -> None:
    assert partner_of(key) == partner


@pytest.mark.parametrize("key", [
    pytest.param("Partner/x", id="upper-case"),
    pytest.param("x.jpg", id="no-prefix"),
    pytest.param("../x", id="dot-dot"),
    pytest.param("/x.jpg", id="empty-partner"),
    pytest.param("partner_a/x.jpg", id="underscore"),
    pytest.param("-partner/x.jpg", id="leading-dash"),
    pytest.param("a" * 65 + "/x.jpg", id="65-characters"),
    pytest.param("partner-a\n/x.jpg", id="trailing-newline"),
])
def test_partner_of_rejects_keys_without_a_partner_id(key: str) -> None:
    with pytest.raises(RejectedUpload) as raised:
        partner_of(key)

    assert raised.value.reason == "bad_key"


def test_partner_of_a_decoded_key_with_spaces_and_unicode() -> None:
    [ref] = parse_notification(notification(record("partner-a/summer+catalog/%C3%96lgem%C3%A4lde+%2B+1.jpg")))

    assert (partner_of(ref.key), sidecar_key(ref.key)) == ("partner-a", "partner-a/summer catalog/Ölgemälde + 1.json")


# --- sidecar_key ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "sidecar"), [
    ("p/a/b.jpg", "p/a/b.json"),
    ("p/a.b/c.png", "p/a.b/c.json"),
    ("p/noext", "p/noext.json"),
    ("p/a.b/noext", "p/a.b/noext.json"),
    ("p/archive.tar.webp", "p/archive.tar.json"),
])
def test_sidecar_key_replaces_only_the_last_extension_of_the_file_name(key: str, sidecar: str) -> None:
    assert sidecar_key(key) == sidecar
