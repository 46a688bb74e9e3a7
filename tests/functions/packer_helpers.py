"""What the core.pack.packer tests share: small multipart parts on moto, PackSettings, batches, announced shards."""

from __future__ import annotations

import json

import boto3
import moto.s3.models
import pytest

from atelier.local.provision import Provisioned
from contracts.messages import Sample, ShardSealed
from core.pack.settings import PackSettings
from tests.functions.pack_helpers import settings_for


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto enforces S3's 5 MiB smallest part; these shards are kilobytes (settings_for matches)."""
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


@pytest.fixture
def settings(stack: Provisioned) -> PackSettings:
    return settings_for(stack)


def batch(samples: list[Sample]) -> list[tuple[str, Sample]]:
    return [(f"m-{s.sha256[:8]}", s) for s in samples]


def announced(stack: Provisioned) -> list[ShardSealed]:
    """The "Shard Sealed" events that reached the start-training function's delivery queue."""
    source = next(s for s in stack.sources if s.function == "StartTrainingFunction" and "ShardSealed" in s.rule_arn)
    sqs, events = boto3.client("sqs"), []
    while messages := sqs.receive_message(QueueUrl=source.queue_url, MaxNumberOfMessages=10).get("Messages"):
        events += [ShardSealed.model_validate(json.loads(m["Body"])["detail"]) for m in messages]
        sqs.delete_message_batch(QueueUrl=source.queue_url, Entries=[
            {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])
    return events
