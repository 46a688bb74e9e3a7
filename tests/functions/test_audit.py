"""atelier.audit under moto: uploads, records and sealed shards reconciled; each violation found."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone

import boto3
import moto.s3.models
import pytest

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import UploadRef
from core import aws
from core.pack import shards
from core.pack.packer import pack_samples, seal_due
from atelier import audit
from tests.functions.pack_helpers import settings_for, upload_sample

DAY = timedelta(days=1)


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


def targets(stack: Provisioned) -> audit.Targets:
    return audit.Targets(stack.outputs["UploadsBucketName"], stack.outputs["DataBucketName"],
                         stack.outputs["PipelineTableName"])


def run_audit(stack: Provisioned, grace_s: float = 60.0, now: datetime | None = None) -> audit.Report:
    now = now or datetime.now(timezone.utc)
    return audit.gather(targets(stack), now - DAY, now + timedelta(seconds=1), grace_s, now=now)


def record_upload(stack: Provisioned, key: str, status: str = "accepted", sha256: str | None = None) -> None:
    bucket = stack.outputs["UploadsBucketName"]
    etag = aws.head_object(bucket, key)["ETag"].strip('"')
    aws.put_item(stack.outputs["PipelineTableName"], pipeline_table.upload_item(
        UploadRef(bucket=bucket, key=key, etag=etag), status, key.split("/", 1)[0], sha256=sha256,
        reason=None if status == "accepted" else "corrupt"))


@pytest.fixture
def packed(stack: Provisioned) -> list[str]:
    """Twelve accepted uploads packed into sealed shards (about 4 per shard); their sample keys."""
    settings = settings_for(stack, shard_target_bytes=24 << 10)
    samples = [upload_sample(stack, n, size=3000) for n in range(12)]
    for sample in samples:
        record_upload(stack, sample.key, sha256=sample.sha256)
    pack_samples([(f"m-{s.sha256[:8]}", s) for s in samples], settings)
    seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    return [s.sha256 for s in samples]


def sealed_ids(stack: Provisioned) -> list[str]:
    return sorted(i["pk"].removeprefix("SEALED#") for i in aws.scan_prefix(stack.outputs["PipelineTableName"], "SEALED#"))


def test_a_clean_pipeline_passes(stack, packed) -> None:
    report = run_audit(stack)
    assert (report.ok, report.uploads, report.accepted, report.pending) == (True, 12, 12, [])
    assert report.shards == report.shards_verified == len(sealed_ids(stack)) >= 2


def test_an_unrecorded_upload_is_pending_within_the_grace_period_and_lost_after(stack, packed) -> None:
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key="partner-a/late.jpg", Body=b"x")
    soon = run_audit(stack, grace_s=3600)
    assert [(p.key, p.stage) for p in soon.pending] == [("partner-a/late.jpg", "unrecorded")] and soon.ok
    later = run_audit(stack, grace_s=3600, now=datetime.now(timezone.utc) + timedelta(hours=2))
    assert [(v.kind, v.subject) for v in later.violations] == [("lost", "partner-a/late.jpg")]


def test_quarantined_uploads_need_no_shard(stack, packed) -> None:
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key="partner-a/bad.jpg", Body=b"x")
    record_upload(stack, "partner-a/bad.jpg", status="quarantined")
    report = run_audit(stack, grace_s=0)
    assert (report.ok, report.quarantined) == (True, 1)


def test_an_accepted_sample_in_no_shard_is_lost_after_the_grace_period(stack, packed) -> None:
    sample = upload_sample(stack, 99, size=3000)
    record_upload(stack, sample.key, sha256=sample.sha256)
    report = run_audit(stack, grace_s=0)
    assert [(v.kind, v.subject, v.detail.split()[0]) for v in report.violations] == [("lost", sample.key, "unpacked")]


def test_a_sample_in_two_shards_is_a_violation(stack, packed) -> None:
    # GIVEN a second SEALED# record and index for a copy of the first shard
    table, data = stack.outputs["PipelineTableName"], stack.outputs["DataBucketName"]
    first = sealed_ids(stack)[0]
    original = json.loads(aws.get_item(table, pipeline_table.sealed_pk(first))["record"])
    copy = "shard-" + "f" * 32
    index = aws.read_object(data, shards.index_key(first))
    aws.write_object(data, shards.index_key(copy), index)
    aws.put_item(table, {"pk": pipeline_table.sealed_pk(copy), "kind": "sealed", "record": json.dumps(
        {**original, "shard_id": copy, "index_key": shards.index_key(copy), "index_uri": ""})})
    report = run_audit(stack)
    keys = [e["key"] for e in json.loads(index)["samples"]]
    assert sorted((v.kind, v.subject) for v in report.violations) == [("duplicated", k) for k in sorted(keys)]


def test_a_shard_whose_bytes_changed_is_corrupt_and_the_member_is_named(stack, packed) -> None:
    data = stack.outputs["DataBucketName"]
    shard_id = sealed_ids(stack)[0]
    index = json.loads(aws.read_object(data, shards.index_key(shard_id)))
    member = index["samples"][1]["members"][0]
    body = bytearray(aws.read_object(data, shards.shard_key(shard_id)))
    body[member["offset"] + shards.BLOCK + 7] ^= 0xFF  # one bit of one image
    boto3.client("s3").put_object(Bucket=data, Key=shards.shard_key(shard_id), Body=bytes(body))
    report = run_audit(stack)
    assert [(v.kind, v.subject, v.detail) for v in report.violations] == [
        ("corrupt", shard_id, f"member at {member['offset']} ({member['name']}) does not match its hashes")]


def test_a_truncated_shard_is_corrupt(stack, packed) -> None:
    data = stack.outputs["DataBucketName"]
    shard_id = sealed_ids(stack)[0]
    body = aws.read_object(data, shards.shard_key(shard_id))
    boto3.client("s3").put_object(Bucket=data, Key=shards.shard_key(shard_id), Body=body[:len(body) // 2])
    assert [v.kind for v in run_audit(stack).violations] == ["corrupt"]


def test_the_cli_exits_non_zero_on_a_violation_and_prints_json(stack, packed, capsys) -> None:
    from atelier import cli
    register_outputs(stack)
    assert cli.main(["audit", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key="partner-a/late.jpg", Body=b"x")
    assert cli.main(["audit", "--grace", "0", "--json"]) == 1
    assert [v["subject"] for v in json.loads(capsys.readouterr().out)["violations"]] == ["partner-a/late.jpg"]


def register_outputs(stack: Provisioned) -> None:
    """The outputs-only CloudFormation stack the local stack registers, so the CLI finds the resources."""
    template = {"Resources": {"Handle": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
                "Outputs": {k: {"Value": v} for k, v in stack.outputs.items()}}
    boto3.client("cloudformation").create_stack(StackName="atelier", TemplateBody=json.dumps(template))


def test_a_re_upload_after_its_shard_was_sealed_before_the_window_is_found_in_that_shard(stack, packed) -> None:
    # GIVEN the shards sealed long before the audited window (their SEALED# records say two days ago)
    table, bucket = stack.outputs["PipelineTableName"], stack.outputs["UploadsBucketName"]
    long_ago = (datetime.now(timezone.utc) - 2 * DAY).isoformat(timespec="milliseconds")
    for shard_id in sealed_ids(stack):
        item = aws.get_item(table, pipeline_table.sealed_pk(shard_id))
        aws.put_item(table, {**item, "record": json.dumps({**json.loads(item["record"]), "sealed_at": long_ago})})
    # AND one sample's upload made again now: the same bytes under the same key, recorded as ingest does
    index = json.loads(aws.read_object(stack.outputs["DataBucketName"], shards.index_key(sealed_ids(stack)[0])))
    sha256 = index["samples"][0]["key"]
    sample = json.loads(aws.get_item(table, pipeline_table.sample_pk(sha256))["record"])
    body = aws.read_object(bucket, sample["key"])
    boto3.client("s3").put_object(Bucket=bucket, Key=sample["key"], Body=body)
    record_upload(stack, sample["key"], sha256=sha256)
    # WHEN the last day is audited
    report = run_audit(stack, grace_s=0)
    # THEN every upload is found in its shard, whenever that was sealed; none is lost
    assert (report.ok, report.violations, report.accepted, report.pending) == (True, [], 12, [])


def test_a_sidecar_needs_a_record_like_any_upload(stack, packed) -> None:
    bucket = stack.outputs["UploadsBucketName"]
    boto3.client("s3").put_object(Bucket=bucket, Key="partner-a/a.json", Body=b'{"caption": "a"}')
    boto3.client("s3").put_object(Bucket=bucket, Key="partner-a/b.json", Body=b'{"caption": "b"}')
    record_upload(stack, "partner-a/b.json", status="quarantined")  # a sidecar: any record will do
    report = run_audit(stack, grace_s=0)
    assert [(v.kind, v.subject) for v in report.violations] == [("lost", "partner-a/a.json")]
    assert (report.sidecars, report.uploads, report.quarantined) == (1, 12, 0)  # counted apart from uploads
