"""core.pack.packer under moto: a shard built across invocations from segments, and two sealers of one shard."""

from __future__ import annotations

import dataclasses
import time

import boto3
import pytest

from contracts import pipeline_table
from core import aws
from core.pack import journal
from core.pack.packer import pack_samples, seal_due
from tests.functions.pack_helpers import check_shard, index_of, sealed_shards, upload_sample
from tests.functions.packer_helpers import (  # noqa: F401  (small_parts, settings: fixtures)
    announced,
    batch,
    settings,
    small_parts,
)


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
