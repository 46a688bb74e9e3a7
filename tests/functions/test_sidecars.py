"""Sidecars under moto: every `.json` object ends with a record (core.ingest.sidecars), none is silent."""

from __future__ import annotations

import dataclasses
import json

import boto3
import moto.s3.models
import pytest

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import Sample
from core import aws
from core.pack.packer import pack_samples, seal_due
from tests.functions.pack_helpers import sealed_shards, settings_for
from tests.functions.test_ingest import GREEN, RED, ingest, pack_messages, tags, uploads_table  # noqa: F401
from tests.functions.test_sweep import run  # noqa: F401

IMAGE, SIDECAR = "partner-a/red.png", "partner-a/red.json"
CAPTION = json.dumps({"caption": "a red circle on blue"}).encode()


@pytest.fixture(autouse=True)
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", 4 << 10)


def orphan_grace(stack: Provisioned, seconds: int) -> None:
    """SIDECAR_ORPHAN_GRACE_S as both functions get it in their environment."""
    for function in ("IngestFunction", "SweepFunction"):
        stack.functions[function].environment["SIDECAR_ORPHAN_GRACE_S"] = str(seconds)


def sample_of(stack: Provisioned, key: str) -> Sample:
    sha256 = uploads_table(stack)[key]["sha256"]
    return Sample.model_validate_json(aws.get_item(stack.outputs["PipelineTableName"], pipeline_table.sample_pk(sha256))["record"])


def pack(stack: Provisioned, messages: list[dict]) -> None:
    """PackFunction's work on these PackQueue messages, the shard sealed at once."""
    settings = settings_for(stack)
    pack_samples([(f"m-{n}", Sample.model_validate(m)) for n, m in enumerate(messages)], settings)
    seal_due(dataclasses.replace(settings, shard_max_age_s=0))


def record(stack: Provisioned, key: str) -> tuple:
    item = uploads_table(stack)[key]
    return item["status"], item["reason"], item["detail"]


def test_image_bytes_under_a_json_name_are_quarantined_with_what_to_do(ingest, stack) -> None:
    ingest({"partner-a/picture.json": GREEN})
    assert record(stack, "partner-a/picture.json") == (
        "quarantined", "image_named_json",
        "jpeg image bytes under a .json key, which names a sidecar: upload the image as partner-a/picture.jpg")
    assert tags(stack, "partner-a/picture.json") == {"atelier-quarantine": "image_named_json"}
    assert pack_messages(stack) == []


def test_a_late_sidecar_sets_the_caption_of_a_sample_not_yet_packed_and_its_shard_carries_it(ingest, stack) -> None:
    # GIVEN an image accepted without a sidecar, its sample on its way to packing
    ingest({IMAGE: RED})
    assert sample_of(stack, IMAGE).caption_source == "missing"
    # WHEN its sidecar arrives
    ingest({SIDECAR: CAPTION})
    # THEN the sidecar is recorded as applied, and the sample record has its caption
    assert record(stack, SIDECAR) == ("sidecar", "caption_updated",
                                      f"the caption of {IMAGE} was set from this sidecar before it was packed")
    assert (sample_of(stack, IMAGE).caption, sample_of(stack, IMAGE).caption_source) == ("a red circle on blue", "sidecar")
    # AND the shard packed from the (older) PackQueue message carries the sidecar's caption
    pack(stack, pack_messages(stack))
    [shard] = sealed_shards(settings_for(stack)).values()
    stored = json.loads(next(data for name, data in shard.members if name.endswith(".json")))
    assert (stored["caption"], stored["caption_source"]) == ("a red circle on blue", "sidecar")


def test_a_sidecar_after_its_sample_was_packed_is_too_late_and_says_what_to_do(ingest, stack) -> None:
    ingest({IMAGE: RED})
    pack(stack, pack_messages(stack))
    ingest({SIDECAR: CAPTION})
    assert record(stack, SIDECAR) == (
        "quarantined", "sidecar_too_late", f"{IMAGE} was packed with its missing caption before this sidecar "
                                           "arrived, and a packed sample never changes: upload a sidecar before its image")
    assert sample_of(stack, IMAGE).caption == ""


def test_a_sidecar_after_its_image_was_quarantined_is_too_late(ingest, stack) -> None:
    ingest({"partner-a/page.png": b"<html>not an image</html>"})
    ingest({"partner-a/page.json": CAPTION})
    assert record(stack, "partner-a/page.json") == (
        "quarantined", "sidecar_too_late", "partner-a/page.png was quarantined (not_an_image) before this sidecar "
                                           "arrived: upload partner-a/page.png again to have it ingested with it")


def test_a_sidecar_read_with_its_image_waits_and_is_then_recorded_as_read(ingest, stack, run) -> None:
    sweep, ingest_queue = run
    # GIVEN a sidecar whose notification is handled before its image's
    ingest({SIDECAR: CAPTION, IMAGE: RED})
    assert record(stack, SIDECAR) == ("sidecar", "waiting", f"read when {IMAGE} is ingested")
    assert sample_of(stack, IMAGE).caption == "a red circle on blue"
    # WHEN the sweep looks again after the orphan grace period
    orphan_grace(stack, 0)
    assert sweep()["redriven"] == [SIDECAR]
    ingest_queue()
    # THEN it is recorded as read with its image, and the next sweep leaves it alone
    assert record(stack, SIDECAR) == ("sidecar", "read", f"read with {IMAGE}")
    assert sweep()["redriven"] == []


def test_an_orphan_sidecar_is_recorded_as_such_after_the_grace_period(ingest, stack, run) -> None:
    sweep, ingest_queue = run
    ingest({"partner-a/lonely.json": CAPTION})
    assert record(stack, "partner-a/lonely.json")[:2] == ("sidecar", "waiting")
    assert sweep()["redriven"] == []  # within SIDECAR_ORPHAN_GRACE_S (its default, 3,600 s)
    orphan_grace(stack, 0)
    assert sweep()["redriven"] == ["partner-a/lonely.json"]
    ingest_queue()
    assert record(stack, "partner-a/lonely.json") == (
        "quarantined", "orphan_sidecar", "no image for it 0 s after it was written: upload the image as "
                                         "partner-a/lonely.jpg (or .png, .webp), then this sidecar again")
    assert tags(stack, "partner-a/lonely.json") == {"atelier-quarantine": "orphan_sidecar"}


def test_a_sidecar_under_no_partner_is_quarantined_not_silent(ingest, stack) -> None:
    ingest({"loose.json": CAPTION})
    assert record(stack, "loose.json")[:2] == ("quarantined", "bad_key")
