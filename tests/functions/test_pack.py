"""core.pack.packer under moto: shards built across invocations from segments, sealed, indexed, announced."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any, Callable

import boto3
import moto.s3.models
import pytest
import webdataset as wds

from atelier.local.provision import Provisioned
from contracts import pipeline_table
from contracts.messages import Sample, ShardSealed
from core import aws
from core.pack import journal, shards
from core.pack.packer import SEAL_TIMER_S, pack_samples, seal_due
from core.pack.settings import PackSettings
from tests.functions.pack_helpers import check_shard, index_of, sealed_shards, settings_for, upload_sample
from tests.support import load_event


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


# --- a shard built across invocations -----------------------------------------------------------

def test_a_shard_built_from_many_invocations_is_one_valid_tar_of_every_sample(stack, settings) -> None:
    # GIVEN 40 samples (about 4.5 KiB each) arriving in batches of 3..7, shards of 80 KiB, parts of 4 KiB
    samples = [upload_sample(stack, n) for n in range(40)]
    settings = dataclasses.replace(settings, shard_target_bytes=80 << 10)
    # WHEN each batch is one invocation, and the timer seals what is left
    start = 0
    for size in [3, 7, 5, 4, 6, 5, 5, 5]:
        pack_samples(batch(samples[start:start + size]), settings)
        start += size
    seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    # THEN every sample is in exactly one shard, and each shard is what its record and index say
    found = sealed_shards(settings)
    keys = [k for shard in found.values() for k in shard.sample_keys]
    assert sorted(keys) == sorted(s.sha256 for s in samples)
    by_key = {s.sha256: s for s in samples}
    for shard_id, shard in found.items():
        check_shard(settings, shard_id, shard, by_key)
        assert len(shard.body) <= settings.shard_target_bytes
    assert len(found) >= 2 and max(len(index_of(settings, i)["segments"]) for i in found) >= 3


def test_shards_are_composed_by_server_side_copies_where_segments_are_large(stack, settings, monkeypatch) -> None:
    # GIVEN segments larger than the smallest part
    copies: list[tuple[str, int, int]] = []
    real_copy = aws.upload_part_copy

    def spy(bucket, key, upload_id, number, source_key, source_version, start, end):  # noqa: ANN001
        copies.append((source_key, start, end))
        return real_copy(bucket, key, upload_id, number, source_key, source_version, start, end)

    monkeypatch.setattr(aws, "upload_part_copy", spy)
    samples = [upload_sample(stack, n, size=3000) for n in range(12)]
    # WHEN three invocations of four samples fill one shard
    for start in range(0, 12, 4):
        pack_samples(batch(samples[start:start + 4]), dataclasses.replace(settings, shard_max_samples=12,
                                                                          shard_target_bytes=1 << 20))
    # THEN the three 12 KiB segments were copied server-side, and the shard is sealed and valid
    assert len(copies) == 3 and all(end - start >= settings.min_part_bytes for _, start, end in copies)
    [(shard_id, shard)] = sealed_shards(settings).items()
    check_shard(settings, shard_id, shard, {s.sha256: s for s in samples})


def test_segments_are_deleted_once_the_shard_is_announced(stack, settings) -> None:
    samples = [upload_sample(stack, n) for n in range(6)]
    for start in range(0, 6, 2):
        pack_samples(batch(samples[start:start + 2]), dataclasses.replace(settings, shard_max_samples=6))

    left = boto3.client("s3").list_object_versions(Bucket=settings.data_bucket, Prefix="segments/")
    assert left.get("Versions", []) == [] and left.get("DeleteMarkers", []) == []


def test_a_segment_whose_commit_lost_a_race_is_committed_next_round_not_written_again(
        stack, settings, monkeypatch) -> None:
    # GIVEN a second packer that commits its own batch just before this one's first commit
    from core.pack import segments
    samples = [upload_sample(stack, n) for n in range(6)]
    real_append, real_write, written = journal.append, segments.write_segment, []

    def append(table, head, shard, pending):  # noqa: ANN001
        if not written[1:]:  # only this packer's first commit is overtaken
            written.append("other")
            pack_samples(batch(samples[3:]), settings)
        return real_append(table, head, shard, pending)

    def write_segment(candidates, *args, **kwargs):  # noqa: ANN001
        written.append(sorted(c.sha256 for c in candidates))
        return real_write(candidates, *args, **kwargs)

    monkeypatch.setattr(journal, "append", append)
    monkeypatch.setattr(segments, "write_segment", write_segment)
    # WHEN this packer's commit fails and it goes round again
    report = pack_samples(batch(samples[:3]), settings)
    # THEN it commits the segment it had written (its samples compared whole, sidecar fields too)
    mine = sorted(s.sha256 for s in samples[:3])
    assert written.count(mine) == 1 and report.committed == 3
    seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    [(shard_id, shard)] = sealed_shards(settings).items()
    assert sorted(shard.sample_keys) == sorted(s.sha256 for s in samples)


def test_deliveries_under_different_lane_counts_pack_a_sample_once_in_its_recorded_lane(stack, settings) -> None:
    # GIVEN samples whose records ingest gave lane 3 (of four), and packers reading 1 and 4 lanes
    # (Lambda runs old and new configurations side by side while PackLanes changes)
    samples = [upload_sample(stack, n, pack_lane=3) for n in range(6)]
    one, four = (dataclasses.replace(settings, lanes=n, shard_target_bytes=1 << 20) for n in (1, 4))
    # WHEN each sample is delivered to both
    pack_samples(batch(samples[:3]), one)
    pack_samples(batch(samples), four)
    pack_samples(batch(samples[3:]), one)
    # THEN all went to lane 3's shard, each once
    assert journal.load_head(settings.table, 3).open.samples == 6  # type: ignore[union-attr]
    assert journal.load_head(settings.table, 0).version == 0
    seal_due(dataclasses.replace(four, shard_max_age_s=0))
    [shard] = sealed_shards(settings).values()
    assert sorted(shard.sample_keys) == sorted(s.sha256 for s in samples)


# --- two sealers of one shard ---------------------------------------------------------------------

def test_a_seal_that_fails_leaves_the_batch_and_the_other_seals_alone_and_fails_the_timer(
        stack, settings, monkeypatch) -> None:
    # GIVEN two lanes whose shards fill in one batch, and one of the two seals that keeps failing
    from core.pack import seal
    from core.pack.lanes import lane_of
    samples = [upload_sample(stack, n) for n in range(40)]
    by_lane = {lane: [s for s in samples if lane_of(s.sha256, 2) == lane][:4] for lane in (0, 1)}
    laned = dataclasses.replace(settings, lanes=2, shard_max_samples=4, shard_target_bytes=1 << 20)
    real_index, broken = seal._STEPS["sealing"], []

    def index(state, settings):  # noqa: ANN001
        if not broken or broken == [state.shard.shard_id]:
            broken[:] = [state.shard.shard_id]
            raise RuntimeError("index write refused")
        return real_index(state, settings)

    monkeypatch.setitem(seal._STEPS, "sealing", index)
    # WHEN the batch is packed
    report = pack_samples(batch(by_lane[0] + by_lane[1]), laned)
    # THEN the batch succeeds (its samples are committed) and the other lane's shard is sealed
    assert report.committed == 8 and len(report.sealed) == 1 and report.sealed[0].shard_id not in broken
    # AND the timer raises the failing seal, so its tick fails into the DLQ and the alarm
    with pytest.raises(RuntimeError, match="index write refused"):
        seal_due(laned)
    # AND once the fault is gone, the timer seals it
    monkeypatch.setitem(seal._STEPS, "sealing", real_index)
    assert [s.shard_id for s in seal_due(laned)] == broken
    assert sorted(k for shard in sealed_shards(settings).values() for k in shard.sample_keys) == \
        sorted(s.sha256 for s in by_lane[0] + by_lane[1])


def test_a_seal_leased_to_another_invocation_is_left_to_it_and_finished_once_the_lease_ends(
        stack, settings, monkeypatch) -> None:
    # GIVEN a full shard whose seal another invocation (still running) has claimed
    samples = [upload_sample(stack, n) for n in range(6)]
    leased = dataclasses.replace(settings, shard_max_samples=6, seal_lease_s=600)
    from core.pack import seal
    real_finish, claimed = seal.finish, []

    def claimed_elsewhere(shard_id, settings):  # noqa: ANN001
        now_ms = int(time.time() * 1000)
        assert journal.claim_seal(settings.table, shard_id, "another-invocation", now_ms + 600_000, now_ms)
        claimed.append(shard_id)
        monkeypatch.setattr(seal, "finish", real_finish)
        return real_finish(shard_id, settings)

    monkeypatch.setattr(seal, "finish", claimed_elsewhere)
    # WHEN this invocation fills the shard and comes to seal it
    report = pack_samples(batch(samples), leased)
    # THEN it leaves the seal alone: not announced, still listed, its messages packed all the same
    assert claimed and report.sealed == [] and report.committed == 6
    assert journal.load_head(settings.table).sealing == frozenset(claimed)
    assert seal_due(leased) == []  # the timer too, while the lease lasts
    # AND once the holder's lease has ended (it died), the timer finishes it
    item = aws.get_item(settings.table, pipeline_table.pack_shard_pk(claimed[0]))
    aws.update_item(settings.table, pipeline_table.pack_shard_pk(claimed[0]), "SET sealer_until = :past",
                    {":past": int(item["sealer_until"]) - 700_000})  # type: ignore[index]
    [sealed] = seal_due(leased)
    assert sealed.shard_id == claimed[0] and journal.load_head(settings.table).sealing == frozenset()
    assert "sealer" not in aws.get_item(settings.table, pipeline_table.pack_shard_pk(claimed[0]))  # released


@pytest.mark.parametrize(("per_batch", "copied"), [(1, False), (4, True)], ids=["parts-read-and-sent", "parts-copied"])
def test_a_sealer_overtaken_mid_compose_finishes_without_an_error(stack, settings, monkeypatch, per_batch: int,
                                                                   copied: bool) -> None:
    # GIVEN a second sealer (two packers run at once on AWS) that, as the first sends its first part,
    # completes the upload, announces the shard and deletes its segments (the first one's lease has
    # run out: settings_for leases seals for 0 s)
    from atelier.local.moto_shim import patch_multipart_gone
    from core.pack import seal
    patch_multipart_gone()
    real_part, overtaken = seal._part, []

    def part(number, part, upload_id, state, settings):  # noqa: ANN001
        if not overtaken:
            overtaken.append(part.copy)
            assert seal.finish(state.shard.shard_id, settings) is not None
        return real_part(number, part, upload_id, state, settings)

    monkeypatch.setattr(seal, "_part", part)
    samples = [upload_sample(stack, n, size=3000 if copied else 300) for n in range(12)]
    sealing = dataclasses.replace(settings, shard_max_samples=12, shard_target_bytes=1 << 20)
    # WHEN the first sealer goes on with its stale state
    for start in range(0, 12, per_batch):
        pack_samples(batch(samples[start:start + per_batch]), sealing)
    # THEN it finishes the seal without an error, and the shard was sealed and announced once
    assert overtaken == [copied]  # the part it was sending: copied server-side, or read and sent
    [(shard_id, shard)] = sealed_shards(settings).items()
    check_shard(settings, shard_id, shard, {s.sha256: s for s in samples})
    assert [e.shard_id for e in announced(stack)] == [shard_id]
    assert journal.load_seal(settings.table, shard_id).status == "done"  # type: ignore[union-attr]


# --- lanes ---------------------------------------------------------------------------------------

def test_lanes_fill_their_own_shards_and_every_sample_is_in_its_lanes_shard(stack, settings) -> None:
    # GIVEN four lanes and 40 samples arriving in batches that mix them
    from core.pack.lanes import lane_of
    laned = dataclasses.replace(settings, lanes=4, shard_target_bytes=1 << 20)
    samples = [upload_sample(stack, n) for n in range(40)]
    # WHEN the batches are packed (two of them twice: redeliveries)
    for start in (0, 10, 10, 20, 30, 30):
        pack_samples(batch(samples[start:start + 10]), laned)
    heads = {lane: journal.load_head(settings.table, lane) for lane in range(4)}
    # THEN each lane has its own open shard, holding exactly its samples
    assert all(head.open is not None and head.version for head in heads.values())
    assert len({head.open.shard_id for head in heads.values()}) == 4  # type: ignore[union-attr]
    assert sum(head.open.samples for head in heads.values()) == 40  # type: ignore[union-attr]
    # AND the timer seals every lane, each sample in exactly one shard, of its own lane
    assert len(seal_due(dataclasses.replace(laned, shard_max_age_s=0))) == 4
    found = sealed_shards(settings)
    assert sorted(k for shard in found.values() for k in shard.sample_keys) == sorted(s.sha256 for s in samples)
    assert all(len({lane_of(k, 4) for k in shard.sample_keys}) == 1 for shard in found.values())
    for shard_id, shard in found.items():
        check_shard(settings, shard_id, shard, {s.sha256: s for s in samples})
    assert all(journal.load_head(settings.table, lane).sealing == frozenset() for lane in range(4))


def test_the_timer_seals_a_lane_left_open_when_the_lane_count_was_lowered(stack, settings) -> None:
    # GIVEN samples packed over four lanes, then PackLanes lowered to 1 before their shards were sealed
    from core.pack.lanes import lane_of
    samples = [upload_sample(stack, n) for n in range(24)]
    assert {lane_of(s.sha256, 4) for s in samples} == {0, 1, 2, 3}
    pack_samples(batch(samples), dataclasses.replace(settings, lanes=4, shard_target_bytes=1 << 20))
    # WHEN the timer runs with one lane
    sealed = seal_due(dataclasses.replace(settings, lanes=1, shard_max_age_s=0, shard_target_bytes=1 << 20))
    # THEN the shards of lanes 1..3 are sealed too: nothing waits forever
    assert len(sealed) == 4
    assert sorted(k for shard in sealed_shards(settings).values() for k in shard.sample_keys) == \
        sorted(s.sha256 for s in samples)
    assert all(journal.load_head(settings.table, lane).open is None for lane in range(4))


# --- when a shard is sealed ---------------------------------------------------------------------

def test_a_shard_is_sealed_at_the_sample_limit(stack, settings) -> None:
    samples = [upload_sample(stack, n) for n in range(7)]

    report = pack_samples(batch(samples), dataclasses.replace(settings, shard_max_samples=3))

    assert sorted(s.samples for s in report.sealed) == [3, 3]
    assert journal.load_head(settings.table).open.samples == 1  # type: ignore[union-attr]


def test_a_shard_is_sealed_before_it_would_pass_the_target_size(stack, settings) -> None:
    samples = [upload_sample(stack, n, size=4000) for n in range(20)]

    report = pack_samples(batch(samples), dataclasses.replace(settings, shard_target_bytes=32 << 10))

    assert report.sealed and all(s.size <= 32 << 10 for s in report.sealed)
    # each sealed shard was full: one more sample would not have fitted
    assert all(s.size + 4000 + 3 * 512 > (32 << 10) - shards.TRAILER_MAX for s in report.sealed)


def test_a_sample_larger_than_the_target_gets_a_shard_of_its_own(stack, settings) -> None:
    big = upload_sample(stack, 1, size=80 << 10)

    report = pack_samples(batch([big]), settings)

    assert [s.samples for s in report.sealed] == [1]


def test_a_slow_trickle_is_sealed_by_age_on_the_timer(stack, settings) -> None:
    # GIVEN one sample in an open shard
    pack_samples(batch([upload_sample(stack, 1)]), settings)
    assert seal_due(settings) == []
    # WHEN the timer fires after the maximum age
    sealed = seal_due(dataclasses.replace(settings, shard_max_age_s=0))
    # THEN the shard is sealed with its one sample
    assert [s.samples for s in sealed] == [1] and journal.load_head(settings.table).open is None


# --- exactly once -------------------------------------------------------------------------------

def test_a_redelivered_batch_packs_nothing_twice(stack, settings) -> None:
    samples = [upload_sample(stack, n) for n in range(5)]
    first = pack_samples(batch(samples), settings)

    again = pack_samples(batch(samples + samples[:2]), settings)

    assert (first.committed, again.committed, again.already_packed) == (5, 0, 5)
    assert journal.load_head(settings.table).open.samples == 5  # type: ignore[union-attr]


def test_packed_samples_point_at_their_shard(stack, settings) -> None:
    samples = [upload_sample(stack, n) for n in range(4)]
    report = pack_samples(batch(samples), dataclasses.replace(settings, shard_max_samples=4))

    marks = {s.sha256: (aws.get_item(settings.table, pipeline_table.sample_pk(s.sha256)) or {}).get("packed_in")
             for s in samples}

    assert set(marks.values()) == {report.sealed[0].shard_id}


def test_a_sample_whose_bytes_are_gone_fails_alone(stack, settings) -> None:
    # GIVEN three samples, one deleted (every version) after ingest
    samples = [upload_sample(stack, n) for n in range(3)]
    s3 = boto3.client("s3")
    s3.delete_object(Bucket=samples[1].bucket, Key=samples[1].key, VersionId=samples[1].version_id)

    report = pack_samples(batch(samples), settings)

    assert (report.failed, report.committed) == ([f"m-{samples[1].sha256[:8]}"], 2)


def test_a_pinned_version_is_read_even_after_the_key_was_overwritten(stack, settings) -> None:
    # GIVEN a sample, then a new upload under the same key
    sample = upload_sample(stack, 1)
    boto3.client("s3").put_object(Bucket=sample.bucket, Key=sample.key, Body=b"something else")
    # WHEN it is packed and sealed
    report = pack_samples(batch([sample]), dataclasses.replace(settings, shard_max_samples=1))
    # THEN the shard holds the ingested bytes
    [shard] = sealed_shards(settings).values()
    assert hashlib.sha256(shard.members[0][1]).hexdigest() == sample.sha256 and report.sealed


def test_unpinned_bytes_that_do_not_match_the_record_fail(stack, settings) -> None:
    sample = upload_sample(stack, 1)
    unpinned = sample.model_copy(update={"version_id": ""})
    boto3.client("s3").put_object(Bucket=sample.bucket, Key=sample.key, Body=b"something else")

    report = pack_samples(batch([unpinned]), settings)

    assert (report.failed, report.committed) == ([f"m-{sample.sha256[:8]}"], 0)


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
    """A sample waits at most ShardMaxAgeSeconds: sealing at the first tick past the age would let
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
