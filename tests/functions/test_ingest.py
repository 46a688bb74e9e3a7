"""IngestFunction under moto, fed the notifications moto's S3 itself sends to UploadsQueue."""

from __future__ import annotations

import hashlib
import io
import json
import threading
from typing import Any, Callable

import boto3
import pytest
from PIL import Image

from atelier.catalog import encode, picture
from atelier.local.provision import Provisioned
from atelier.local.runtime import sqs_event
from contracts import pipeline_table
from core import aws
from core.ingest import images
from core.partners.licensing import Partner, put_partner


@pytest.fixture
def ingest(stack: Provisioned, partner: str, function_env: Callable, lambda_context: Any):
    """Upload objects as a partner would, then deliver what UploadsQueue holds to the handler."""
    function_env("IngestFunction")
    from ingest.app import lambda_handler

    def run(uploads: dict[str, bytes], repeat: int = 1) -> list[dict]:
        s3, sqs = boto3.client("s3"), boto3.client("sqs")
        for key, body in uploads.items():
            s3.put_object(Bucket=stack.outputs["UploadsBucketName"], Key=key, Body=body)
        messages = drain(sqs, stack.outputs["UploadsQueueUrl"])
        source = next(s for s in stack.sources if s.function == "IngestFunction")
        return [lambda_handler(sqs_event(messages, source, "us-east-1"), lambda_context) for _ in range(repeat)]

    return run


def drain(sqs: Any, url: str) -> list[dict]:
    messages: list[dict] = []
    while batch := sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=0).get("Messages"):
        messages += batch
        sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                                                        for i, m in enumerate(batch)])
    return [m for m in messages if "s3:TestEvent" not in m["Body"]]


def uploads_table(stack: Provisioned) -> dict[str, dict]:
    bucket = stack.outputs["UploadsBucketName"]
    return {i["pk"].removeprefix(f"UPLOAD#{bucket}/"): i for i in aws.scan_prefix(stack.outputs["PipelineTableName"], "UPLOAD#")}


def pack_messages(stack: Provisioned) -> list[dict]:
    return [json.loads(m["Body"]) for m in drain(boto3.client("sqs"), stack.outputs["PackQueueUrl"])]


def tags(stack: Provisioned, key: str) -> dict[str, str]:
    tagging = boto3.client("s3").get_object_tagging(Bucket=stack.outputs["UploadsBucketName"], Key=key)
    return {t["Key"]: t["Value"] for t in tagging["TagSet"]}


RED = encode(picture("circle", "red", "blue"), "png")
GREEN = encode(picture("square", "green", "white"), "jpg")


def test_a_redelivered_notification_makes_one_record_and_one_hand_over(ingest, stack) -> None:
    # WHEN the same notifications are delivered three times
    results = ingest({"partner-a/red.png": RED}, repeat=3)
    # THEN nothing failed, one sample exists and packing got it once
    assert results == [{"batchItemFailures": []}] * 3
    assert len(aws.scan_prefix(stack.outputs["PipelineTableName"], "SAMPLE#")) == 1
    assert [m["key"] for m in pack_messages(stack)] == ["partner-a/red.png"]


def test_an_accepted_sample_keeps_the_pack_lane_it_was_first_given(ingest, stack, monkeypatch) -> None:
    # GIVEN four pack lanes, then a redelivery read under one (PackLanes changed between them)
    from core.pack.lanes import lane_of
    monkeypatch.setenv("PACK_LANES", "4")
    ingest({"partner-a/red.png": RED})
    monkeypatch.setenv("PACK_LANES", "1")
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key="partner-a/red.png", Body=RED)
    ingest({})
    # THEN the record keeps the lane of the first: the packer sends every delivery there
    [record] = aws.scan_prefix(stack.outputs["PipelineTableName"], "SAMPLE#")
    assert record["pack_lane"] == lane_of(hashlib.sha256(RED).hexdigest(), 4)


def test_the_same_bytes_under_another_name_are_quarantined_as_a_duplicate(ingest, stack) -> None:
    put_partner(stack.outputs["PipelineTableName"], Partner(partner_id="partner-b", licenses=("CC-BY-4.0",)))
    ingest({"partner-a/red.png": RED})
    ingest({"partner-b/copy of red.png": RED})
    records = uploads_table(stack)
    assert (records["partner-a/red.png"]["status"], records["partner-b/copy of red.png"]["reason"]) == (
        "accepted", "duplicate")
    assert tags(stack, "partner-b/copy of red.png") == {"atelier-quarantine": "duplicate"}
    assert [m["key"] for m in pack_messages(stack)] == ["partner-a/red.png"]


def test_concurrent_deliveries_of_one_image_under_two_names_accept_exactly_one(stack, partner, function_env) -> None:
    function_env("IngestFunction")
    from contracts.messages import UploadRef
    from core.ingest.admission import ingest_upload
    from core.ingest.settings import IngestSettings
    bucket = stack.outputs["UploadsBucketName"]
    for key in ("partner-a/one.png", "partner-a/two.png"):
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=RED)
    settings = IngestSettings.from_env()
    outcomes: list[Any] = []
    barrier = threading.Barrier(2)

    def deliver(key: str) -> None:
        barrier.wait()
        outcomes.append(ingest_upload(UploadRef(bucket=bucket, key=key), settings))

    threads = [threading.Thread(target=deliver, args=(k,)) for k in ("partner-a/one.png", "partner-a/two.png")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted((o.status, o.reason) for o in outcomes) == [("accepted", None), ("quarantined", "duplicate")]
    assert len(pack_messages(stack)) == 1


def test_racing_transactions_complete_and_exactly_one_wins(stack) -> None:
    """The write lock moto takes for every test is reentrant: a transaction's put runs inside it."""
    table = stack.outputs["PipelineTableName"]
    wins: list[bool] = []
    barrier = threading.Barrier(2)

    def claim(owner: str) -> None:
        barrier.wait()
        wins.append(aws.transact_updates(table, [], [{"pk": "claim#race", "owner": owner}]))

    threads = [threading.Thread(target=claim, args=(o,), daemon=True) for o in ("a", "b")]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert sorted(wins) == [False, True]


@pytest.mark.parametrize("key, sidecar, detail", [
    ("partner-z/x.png", None, "partner 'partner-z' is not in the registry"),
    ("partner-a/x.png", {"license": "all-rights-reserved"}, "license 'all-rights-reserved' is not one partner-a holds"),
])
def test_unlicensed_uploads_are_quarantined_with_the_reason(ingest, stack, key, sidecar, detail) -> None:
    objects = {key: RED}
    if sidecar:
        objects = {key.replace(".png", ".json"): json.dumps(sidecar).encode(), **objects}
    ingest(objects)
    record = uploads_table(stack)[key]
    assert (record["status"], record["reason"], record["detail"]) == ("quarantined", "unlicensed", detail)
    assert pack_messages(stack) == []


def test_a_key_outside_the_partners_prefixes_is_unlicensed(ingest, stack) -> None:
    put_partner(stack.outputs["PipelineTableName"],
                Partner(partner_id="partner-a", licenses=("CC-BY-4.0",), prefixes=("licensed/",)))
    ingest({"partner-a/licensed/ok.png": RED, "partner-a/private/no.png": GREEN})
    records = uploads_table(stack)
    assert records["partner-a/licensed/ok.png"]["status"] == "accepted"
    assert records["partner-a/private/no.png"]["reason"] == "unlicensed"


def test_a_too_large_upload_is_refused_without_reading_it(ingest, stack, monkeypatch) -> None:
    monkeypatch.setenv("MAX_UPLOAD_BYTES", "1000")
    reads: list[tuple] = []
    monkeypatch.setattr(aws, "read_object", lambda *a, **k: reads.append(a) or b"")
    ingest({"partner-a/big.png": RED + b"\0" * 2000})
    assert uploads_table(stack)["partner-a/big.png"]["reason"] == "too_large"
    assert reads == []


def test_one_unexpected_error_fails_only_its_record(stack, partner, function_env, lambda_context, monkeypatch) -> None:
    function_env("IngestFunction")
    real = aws.send_message

    def flaky(url: str, body: str) -> None:
        if "green" in body:
            raise ConnectionError("SQS is unreachable")
        real(url, body)

    monkeypatch.setattr(aws, "send_message", flaky)
    s3 = boto3.client("s3")
    bucket = stack.outputs["UploadsBucketName"]
    s3.put_object(Bucket=bucket, Key="partner-a/red.png", Body=RED)
    s3.put_object(Bucket=bucket, Key="partner-a/green.jpg", Body=GREEN)
    messages = drain(boto3.client("sqs"), stack.outputs["UploadsQueueUrl"])
    green_id = next(m["MessageId"] for m in messages if "green" in m["Body"])
    from ingest.app import lambda_handler
    source = next(s for s in stack.sources if s.function == "IngestFunction")
    result = lambda_handler(sqs_event(messages, source, "us-east-1"), lambda_context)
    assert result == {"batchItemFailures": [{"itemIdentifier": green_id}]}
    assert "partner-a/green.jpg" not in uploads_table(stack)  # not recorded: it will be retried


def test_a_near_duplicate_is_accepted_and_flagged(ingest, stack) -> None:
    ingest({"partner-a/red.png": RED})
    again = io.BytesIO()
    Image.open(io.BytesIO(RED)).convert("RGB").save(again, "JPEG", quality=70)
    ingest({"partner-a/red again.jpg": again.getvalue()})
    messages = {m["key"]: m for m in pack_messages(stack)}
    original = messages["partner-a/red.png"]["sha256"]
    assert messages["partner-a/red again.jpg"]["near_duplicate_of"] == original
    assert messages["partner-a/red again.jpg"]["near_duplicate_distance"] <= 3


def test_a_recoloured_upload_is_not_flagged_as_a_near_duplicate(ingest, stack) -> None:
    # GIVEN a picture, and the same picture with its hue turned: a luminance hash cannot tell them apart
    from tests.support import hue_turned
    ingest({"partner-a/red.png": RED})
    turned = io.BytesIO()
    hue_turned(Image.open(io.BytesIO(RED)), 120).save(turned, "PNG")
    ingest({"partner-a/red turned.png": turned.getvalue()})

    messages = {m["key"]: m for m in pack_messages(stack)}
    original, recoloured = messages["partner-a/red.png"], messages["partner-a/red turned.png"]
    assert images.hamming(original["phash"], recoloured["phash"]) <= 3
    # THEN its colours make it another sample
    assert images.colour_distance(original["colour"], recoloured["colour"]) > 16
    assert recoloured["near_duplicate_of"] is None


def test_flat_images_past_an_index_keys_cap_are_accepted_and_no_longer_compared(ingest, stack, monkeypatch) -> None:
    # GIVEN index keys that fill past 1 member, and flat grey pictures: other bytes, the same dHash
    from core.ingest import dedup
    monkeypatch.setattr(dedup, "MAX_MEMBERS", 1)
    flat = {f"partner-a/grey {n}.png": encode(Image.new("RGB", (96 + n, 96), (128, 128, 128)), "png") for n in range(3)}

    # WHEN they come one by one, the last one twice
    results = [ingest({key: body}, repeat=2 if n == 2 else 1) for n, (key, body) in enumerate(flat.items())]

    # THEN none failed; the second was flagged as a near duplicate of the first and filled every key
    # they share (counted once each), so the third was compared with nothing
    assert results == [[{"batchItemFailures": []}]] * 2 + [[{"batchItemFailures": []}] * 2]
    messages = {m["key"]: m for m in pack_messages(stack)}
    assert [messages[key]["near_duplicate_of"] for key in flat] == [messages["partner-a/grey 0.png"]["sha256"] if n == 1
                                                                    else None for n in range(3)]
    phash = messages["partner-a/grey 0.png"]["phash"]
    assert {messages[key]["phash"] for key in flat} == {phash}
    table = stack.outputs["PipelineTableName"]
    assert all("full_at" in item for item in aws.batch_get_items(table, dedup.index_keys(phash)).values())
    assert sorted(int(i["full_keys"]) for i in aws.scan_prefix(table, pipeline_table.PHASH_FULL_PREFIX)) == [1] * 16


def test_an_image_that_cannot_be_kept_is_stored_re_encoded(ingest, stack) -> None:
    rgba = io.BytesIO()
    Image.new("RGBA", (120, 100), (255, 0, 0, 0)).save(rgba, "PNG")
    ingest({"partner-a/transparent.png": rgba.getvalue()})
    [sample] = pack_messages(stack)
    assert (sample["format"], sample["original_format"], sample["reencoded"]) == ("jpeg", "png", "mode RGBA")
    assert sample["content_key"] == f"derived/{sample['sha256']}.jpg"
    stored = boto3.client("s3").get_object(Bucket=sample["content_bucket"], Key=sample["content_key"])["Body"].read()
    image = Image.open(io.BytesIO(stored))
    assert (image.format, image.size, image.getpixel((0, 0))) == ("JPEG", (120, 100), (255, 255, 255))


def test_every_quarantined_object_is_tagged_with_its_reason(ingest, stack) -> None:
    ingest({"partner-a/page.jpg": b"<html><body>not an image</body></html>", "partner-a/empty.png": b""})
    assert tags(stack, "partner-a/page.jpg") == {"atelier-quarantine": "not_an_image"}
    assert tags(stack, "partner-a/empty.png") == {"atelier-quarantine": "empty"}
    assert {k: r["reason"] for k, r in uploads_table(stack).items()} == {
        "partner-a/page.jpg": "not_an_image", "partner-a/empty.png": "empty"}


def test_a_multipart_upload_s_two_notifications_make_one_sample(stack, partner, function_env, lambda_context) -> None:
    # GIVEN moto's two events (Put and CompleteMultipartUpload) for one multipart upload
    function_env("IngestFunction")
    from ingest.app import lambda_handler
    bucket, key = stack.outputs["UploadsBucketName"], "partner-a/big/red.png"
    s3 = boto3.client("s3")
    upload_id = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etag = s3.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=RED)["ETag"]
    s3.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                 MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]})
    messages = drain(boto3.client("sqs"), stack.outputs["UploadsQueueUrl"])
    source = next(s for s in stack.sources if s.function == "IngestFunction")
    # WHEN each notification is delivered in its own batch, as they may be
    results = [lambda_handler(sqs_event([m], source, "us-east-1"), lambda_context) for m in messages]
    # THEN one record, one hand-over
    assert len(messages) >= 2 and results == [{"batchItemFailures": []}] * len(messages)
    assert [m["key"] for m in pack_messages(stack)] == [key]
    assert uploads_table(stack)[key]["status"] == "accepted"


def test_empty_too_large_and_gone_records_carry_the_object_s_version(ingest, stack, monkeypatch) -> None:
    # GIVEN an empty object, one over the size limit, and one deleted before its notification is read
    monkeypatch.setenv("MAX_UPLOAD_BYTES", "1000")
    s3, bucket = boto3.client("s3"), stack.outputs["UploadsBucketName"]
    gone = s3.put_object(Bucket=bucket, Key="partner-a/gone.png", Body=RED)["VersionId"]
    s3.delete_object(Bucket=bucket, Key="partner-a/gone.png")  # a delete marker over that version
    # WHEN they are ingested (moto's notifications carry no versionId, as a sweep's re-drive does not)
    ingest({"partner-a/empty.png": b"", "partner-a/big.png": RED + b"\0" * 2000})
    # THEN each record names the version it is about, as every other record does
    versions = {key: s3.head_object(Bucket=bucket, Key=key)["VersionId"] for key in ("partner-a/empty.png", "partner-a/big.png")}
    records = uploads_table(stack)
    assert {k: (r["reason"], r["version_id"]) for k, r in records.items()} == {
        "partner-a/empty.png": ("empty", versions["partner-a/empty.png"]),
        "partner-a/big.png": ("too_large", versions["partner-a/big.png"]),
        "partner-a/gone.png": ("gone", gone)}


@pytest.mark.parametrize("meanwhile", ["overwritten", "deleted", "version deleted"])
def test_the_bytes_read_are_the_version_the_record_names(ingest, stack, monkeypatch, meanwhile) -> None:
    """A partner may overwrite or delete its upload between ingest's HEAD and its GET: the sample is
    still the version HEAD saw (its bytes and its version id), never the newer bytes, never a failure;
    a version deleted for good is `gone`."""
    s3, bucket, key = boto3.client("s3"), stack.outputs["UploadsBucketName"], "partner-a/raced.png"
    real_head, heads = aws.head_object, []

    def head_then_race(bucket_name: str, object_key: str):
        head = real_head(bucket_name, object_key)
        if object_key == key and not heads:
            heads.append(head["VersionId"])
            if meanwhile == "overwritten":
                s3.put_object(Bucket=bucket, Key=key, Body=GREEN)
            elif meanwhile == "deleted":
                s3.delete_object(Bucket=bucket, Key=key)  # a delete marker: the version is still there
            else:
                s3.delete_object(Bucket=bucket, Key=key, VersionId=head["VersionId"])  # that version, for good
        return head

    monkeypatch.setattr(aws, "head_object", head_then_race)
    results = ingest({key: RED})

    assert results == [{"batchItemFailures": []}]
    record = uploads_table(stack)[key]
    if meanwhile == "version deleted":
        assert (record["status"], record["reason"], record["version_id"]) == ("quarantined", "gone", heads[0])
    else:
        assert (record["status"], record["version_id"], record["sha256"]) == ("accepted", heads[0], hashlib.sha256(RED).hexdigest())


def test_a_duplicate_of_another_partner_s_sample_does_not_name_its_key(ingest, stack) -> None:
    from atelier.reports import partner_report
    put_partner(stack.outputs["PipelineTableName"], Partner(partner_id="partner-b", licenses=("CC-BY-4.0",)))
    ingest({"partner-a/secret/red.png": RED})
    ingest({"partner-b/red.png": RED})
    record = uploads_table(stack)["partner-b/red.png"]
    # THEN partner-b reads that the bytes are already in the dataset; operators keep the pointer
    assert (record["reason"], record["detail"]) == ("duplicate", "same bytes as a sample already in the dataset")
    assert record["duplicate_of_key"] == "partner-a/secret/red.png"
    report = partner_report(stack.outputs, "partner-b")
    assert [(i["key"], i["reason"], i["detail"]) for i in report["items"]] == [
        ("partner-b/red.png", "duplicate", "same bytes as a sample already in the dataset")]
    assert "partner-a" not in json.dumps(report)


def test_a_duplicate_of_the_partner_s_own_sample_names_it(ingest, stack) -> None:
    ingest({"partner-a/red.png": RED})
    ingest({"partner-a/red copy.png": RED})
    assert uploads_table(stack)["partner-a/red copy.png"]["detail"] == "same bytes as partner-a/red.png"
