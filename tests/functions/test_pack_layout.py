"""core.pack.packer under moto: the sealed shard's layout read back (webdataset, wids), and the handler."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any, Callable

import boto3
import pytest
import webdataset as wds

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from core import aws
from core.pack import journal, shards
from core.pack.packer import SEAL_TIMER_S, pack_samples, seal_due
from core.pack.settings import PackSettings
from tests.functions.pack_helpers import index_of, sealed_shards, upload_sample
from tests.functions.packer_helpers import (  # noqa: F401  (small_parts, settings: fixtures)
    announced,
    batch,
    settings,
    small_parts,
)
from tests.support import load_event


# --- the layout ---------------------------------------------------------------------------------

def test_member_names_are_safe_whatever_the_upload_key(stack, settings) -> None:
    hostile = "partner-a/../../etc/\x1b[31mpasswd\n.tar.gz/..jpg"
    sample = upload_sample(stack, 1, key=hostile)

    pack_samples(batch([sample]), dataclasses.replace(settings, shard_max_samples=1))

    [shard] = sealed_shards(settings).values()
    assert [name for name, _ in shard.members] == [f"{sample.sha256}.jpg", f"{sample.sha256}.json",
                                                   f"{sample.sha256}.txt"]
    assert json.loads(shard.members[1][1])["key"] == hostile  # provenance is kept, in the record


def test_the_same_batches_give_the_same_shard_bytes(stack, settings) -> None:
    samples = [upload_sample(stack, n) for n in range(9)]
    narrow = dataclasses.replace(settings, shard_max_samples=9, shard_target_bytes=1 << 20)
    for start in range(0, 9, 3):
        pack_samples(batch(samples[start:start + 3]), narrow)
    [(shard_id, first)] = sealed_shards(settings).items()
    # WHEN the same samples are packed again from scratch (the table and the shard forgotten)
    for item in aws.scan_prefix(settings.table, ""):
        boto3.client("dynamodb").delete_item(TableName=settings.table, Key={"pk": {"S": item["pk"]}})
    for sample in samples:
        aws.put_item(settings.table, pipeline_table.sample_item(sample))
    boto3.client("s3").delete_object(Bucket=settings.data_bucket, Key=first.key)
    for start in range(0, 9, 3):
        pack_samples(batch(samples[start:start + 3]), narrow)
    # THEN the rebuilt shard has the same id, bytes and digest
    [(again_id, again)] = sealed_shards(settings).items()
    assert (again_id, hashlib.sha256(again.body).digest()) == (shard_id, hashlib.sha256(first.body).digest())


def test_readers_read_every_sample_back(stack, settings, tmp_path: Path) -> None:
    # GIVEN a sealed shard of 12 samples built from four segments
    samples = [upload_sample(stack, n) for n in range(12)]
    for start in range(0, 12, 3):
        pack_samples(batch(samples[start:start + 3]), dataclasses.replace(settings, shard_max_samples=12,
                                                                          shard_target_bytes=1 << 20))
    [shard] = sealed_shards(settings).values()
    path = tmp_path / "shard.tar"
    path.write_bytes(shard.body)
    # THEN webdataset, GNU tar and tarfile all see the same samples, members contiguous per key
    read = {s["__key__"]: s for s in wds.WebDataset(str(path), shardshuffle=False)}
    assert sorted(read) == sorted(s.sha256 for s in samples)
    assert all(read[s.sha256]["txt"].decode() == s.caption for s in samples)
    listing = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True, check=True)
    assert listing.stdout.splitlines() == [name for name, _ in shard.members]
    with tarfile.open(path) as tar:
        assert all(m.mtime == 0 and m.uid == 0 and m.mode == 0o644 for m in tar.getmembers())


def test_wids_reads_the_shard_with_its_sample_count(stack, settings, tmp_path: Path) -> None:
    wids = pytest.importorskip("wids")
    samples = [upload_sample(stack, n) for n in range(5)]
    pack_samples(batch(samples), dataclasses.replace(settings, shard_max_samples=5))
    [(shard_id, shard)] = sealed_shards(settings).items()
    path = tmp_path / "shard.tar"
    path.write_bytes(shard.body)

    shard_list = [{"url": str(path), "nsamples": index_of(settings, shard_id)["samples_count"]}]
    dataset = wids.ShardListDataset(shard_list, transformations=[], cache_dir=str(tmp_path / "cache"))

    assert sorted(dataset[i]["__key__"] for i in range(len(dataset))) == sorted(s.sha256 for s in samples)


# --- the handler --------------------------------------------------------------------------------

def test_the_seal_timer_event_seals_an_old_shard_through_the_handler(
        stack: Provisioned, function_env: Callable, lambda_context: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    function_env("PackFunction")
    settings = PackSettings.from_env()
    pack_samples(batch([upload_sample(stack, 1)]), settings)
    monkeypatch.setenv("SHARD_MAX_AGE_S", "0")
    from pack.app import lambda_handler

    result = lambda_handler(load_event("pack_seal_timer"), lambda_context)

    [event] = announced(stack)
    assert result == {"sealed": [event.shard_id]}
    assert (event.uri, event.index_uri, event.samples) == (
        f"s3://{settings.data_bucket}/shards/{event.shard_id}.tar",
        f"s3://{settings.data_bucket}/indexes/{event.shard_id}.json", 1)
    assert event.digest_algorithm == shards.DIGEST_ALGORITHM
    body = boto3.client("s3").get_object(Bucket=settings.data_bucket, Key=event.key)["Body"].read()
    assert shards.digest_of_tar(io.BytesIO(body)) == (event.sha256, event.size)


def test_the_timer_seals_a_shard_that_would_pass_its_age_before_the_next_tick(
        stack: Provisioned, function_env: Callable, lambda_context: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample waits at most SHARD_MAX_AGE_S: sealing at the first tick past the age would let
    it wait up to a tick longer (p99 upload-to-shard of the load test: age + 60 s)."""
    function_env("PackFunction")
    monkeypatch.setenv("SHARD_MAX_AGE_S", str(SEAL_TIMER_S - 30))  # the shard is due half-way to the next tick
    settings = PackSettings.from_env()
    pack_samples(batch([upload_sample(stack, 1)]), settings)
    assert seal_due(settings) == []  # not yet old: a batch does not seal it
    from pack.app import lambda_handler

    result = lambda_handler(load_event("pack_seal_timer"), lambda_context)  # ... but the tick before its age does

    [event] = announced(stack)
    assert result == {"sealed": [event.shard_id]} and event.samples == 1
    # and a shard with more than a tick to go is left open
    pack_samples(batch([upload_sample(stack, 2)]), dataclasses.replace(settings, shard_max_age_s=3600))
    monkeypatch.setenv("SHARD_MAX_AGE_S", "3600")
    assert lambda_handler(load_event("pack_seal_timer"), lambda_context) == {"sealed": []}


def test_the_handler_fails_exactly_the_malformed_and_the_unreadable_records(
        stack: Provisioned, function_env: Callable, lambda_context: Any) -> None:
    # GIVEN a batch of two good samples, one whose bytes are gone, and one malformed record
    function_env("PackFunction")
    good = [upload_sample(stack, n) for n in range(2)]
    gone = upload_sample(stack, 3)
    boto3.client("s3").delete_object(Bucket=gone.bucket, Key=gone.key, VersionId=gone.version_id)
    records_ = [{"messageId": f"id-{i}", "body": s.model_dump_json()} for i, s in enumerate([*good, gone])]
    records_.append({"messageId": "id-bad", "body": '{"sha256": "not a sample"}'})
    from pack.app import lambda_handler
    # WHEN the handler runs
    result = lambda_handler({"Records": records_}, lambda_context)
    # THEN exactly those two go back to the queue, and the good ones are in the open shard
    assert result == {"batchItemFailures": [{"itemIdentifier": "id-bad"}, {"itemIdentifier": "id-2"}]}
    assert journal.load_head(stack.outputs["PipelineTableName"]).open.samples == 2  # type: ignore[union-attr]
