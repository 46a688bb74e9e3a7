"""What the ImportFunction tests share: its settings, a batch's tars put in place, what it quarantined and announced."""

from __future__ import annotations

import dataclasses
import io
import json
from typing import Callable

import boto3
import moto.s3.models
import pytest

from atelier.catalog import make_catalog
from atelier.local.provision import Provisioned
from core import aws
from core.import_shard import importer, records
from contracts.messages import ImportShard
from core.import_shard.settings import ImportSettings

BATCH = "batch-1"


# 4, 11 and 12 are within 3 dHash bits of earlier pictures of other colours: left out, so that
# only the near-duplicate tests depend on the colour signature telling them apart
ITEMS = [item for n, item in enumerate(make_catalog(16, seed=3)) if n not in (4, 11, 12)]


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


@pytest.fixture
def settings(stack: Provisioned, partner: str, function_env: Callable) -> ImportSettings:
    function_env("ImportFunction")
    base = ImportSettings.from_env()
    return dataclasses.replace(base, chunk_bytes=6 << 10,
                               pack=dataclasses.replace(base.pack, min_part_bytes=4 << 10, part_bytes=8 << 10))


def put_tar(stack: Provisioned, name: str, body: bytes) -> ImportShard:
    bucket = stack.outputs["DataBucketName"]
    boto3.client("s3").put_object(Bucket=bucket, Key=f"imports/{BATCH}/{name}", Body=body)
    return ImportShard(batch_id=BATCH, bucket=bucket, key=f"imports/{BATCH}/{name}", partner="partner-a",
                       license="CC-BY-4.0")


def start_batch(stack: Provisioned, total: int) -> None:
    aws.put_item(stack.outputs["PipelineTableName"], records.batch_item(BATCH, "partner-a", "CC-BY-4.0", "tests", total))


def quarantined(stack: Provisioned) -> dict[str, str]:
    return {i["pk"].rsplit("#", 1)[1]: i["reason"] for i in aws.scan_prefix(stack.outputs["PipelineTableName"], "UPLOAD#")
            if i["status"] == "quarantined"}


def announced(stack: Provisioned) -> list[dict]:
    source = next(s for s in stack.sources if s.function == "StartTrainingFunction" and "ShardSealed" in s.rule_arn)
    sqs, found = boto3.client("sqs"), []
    while messages := sqs.receive_message(QueueUrl=source.queue_url, MaxNumberOfMessages=10).get("Messages"):
        found += [json.loads(m["Body"]) for m in messages]
        sqs.delete_message_batch(QueueUrl=source.queue_url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
    return found


def ingest_upload(stack: Provisioned, function_env: Callable, key: str, body: bytes) -> None:
    """An upload accepted by ingest, as a partner's upload would be."""
    from contracts.messages import UploadRef
    from core.ingest.admission import ingest_upload as ingest
    from core.ingest.settings import IngestSettings
    function_env("IngestFunction")
    boto3.client("s3").put_object(Bucket=stack.outputs["UploadsBucketName"], Key=key, Body=body)
    assert ingest(UploadRef(bucket=stack.outputs["UploadsBucketName"], key=key), IngestSettings.from_env()).status == "accepted"
    function_env("ImportFunction")


def table_rows(report: records.BatchReport) -> dict[str, str]:
    """`atelier import-report`'s table as {what: count}."""
    from rich.console import Console

    from atelier.cli_import import report_table
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(report_table(report))
    cells = [line.split("│")[1:-1] for line in console.export_text().splitlines() if line.startswith("│")]
    return {what.strip(): count.strip() for what, count in cells}
