"""core.pack.packer under moto: lanes, when a shard is sealed, every sample packed exactly once."""

from __future__ import annotations

import dataclasses
import hashlib

import boto3

from contracts import pipeline_table
from core import aws
from core.pack import journal, shards
from core.pack.packer import pack_samples, seal_due
from tests.functions.pack_helpers import check_shard, sealed_shards, upload_sample
from tests.functions.packer_helpers import batch, settings, small_parts  # noqa: F401  (small_parts, settings: fixtures)


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
