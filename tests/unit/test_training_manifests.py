"""core.start_training.starter, the pure half: choosing shards (new and replay), digests and job names, the manifest file.

The orchestration against moto (claims, the lineage lock and queue, job ends, stages) is in
tests/functions/test_training_jobs_*.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from contracts.messages import Manifest
from core.start_training.manifests import job_name_for, manifest_file, manifest_from, replay_shards
from tests.unit.training_helpers import DATA, JOB_NAME, SETTINGS, manifest_of, ref, shard, with_replay


# --- manifest_from: which new shards -----------------------------------------------------------

def test_manifest_from_is_none_below_the_quota() -> None:
    assert manifest_from([shard(1)], [ref(9)], SETTINGS, sequence=1) is None


def test_manifest_from_is_none_without_shards() -> None:
    assert manifest_from([], [], SETTINGS, sequence=1) is None


def test_manifest_from_at_the_quota_takes_every_shard() -> None:
    assert manifest_from([shard(2), shard(1)], [], SETTINGS, sequence=1) == manifest_of(ref(1), ref(2))


def test_manifest_from_takes_the_oldest_quota_shards_by_sealed_at() -> None:
    pending = [shard(5), shard(1), shard(4), shard(2), shard(3)]

    assert manifest_from(pending, [], dataclasses.replace(SETTINGS, quota=3), sequence=1) \
        == manifest_of(ref(1), ref(2), ref(3))


def test_manifest_from_breaks_sealed_at_ties_by_shard_id() -> None:
    same_time, earlier = "2026-11-29T12:00:00+00:00", "2026-11-29T11:00:00+00:00"
    pending = [shard(3, same_time), shard(9, earlier), shard(1, same_time), shard(2, same_time)]

    assert manifest_from(pending, [], dataclasses.replace(SETTINGS, quota=3), sequence=1) == manifest_of(
        ref(9, earlier), ref(1, same_time), ref(2, same_time))


def test_manifest_records_the_lineage_and_its_sequence() -> None:
    manifest = manifest_from([shard(1), shard(2)], [], dataclasses.replace(SETTINGS, lineage="faces"), sequence=7)

    assert (manifest.lineage, manifest.sequence, manifest.bucket, manifest.prefix) == ("faces", 7, DATA, "shards/")


def test_manifest_shards_carry_sha256_samples_and_partners() -> None:
    manifest = manifest_from([shard(1), shard(2)], [], SETTINGS, sequence=1)

    assert [(s.sha256, s.samples, s.partners, s.role, s.weight) for s in manifest.shards] == [
        (f"{1:064x}", 1, ("partner-a",), "new", 1.0), (f"{2:064x}", 2, ("partner-a",), "new", 1.0)]


# --- replay ---------------------------------------------------------------------------------------

TRAINED = [ref(n) for n in range(101, 111)]  # ten shards trained by earlier jobs
NEW = [shard(n) for n in range(1, 5)]


def replayed(manifest: Manifest) -> list[str]:
    return [s.shard_id for s in manifest.shards if s.role == "replay"]


def test_replay_share_zero_adds_no_earlier_shard() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.0), quota=4), sequence=2)

    assert manifest.shards == tuple(ref(n) for n in range(1, 5))


def test_replay_half_of_four_new_shards_adds_exactly_four_trained_shards() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.5), quota=4), sequence=2)

    trained_ids = {s.shard_id for s in TRAINED}
    assert [s.shard_id for s in manifest.new_shards] == [shard(n).shard_id for n in range(1, 5)]
    assert len(replayed(manifest)) == 4
    assert set(replayed(manifest)) <= trained_ids
    assert len(set(replayed(manifest))) == 4
    assert [(s.role, s.weight) for s in manifest.shards[4:]] == [("replay", 1.0)] * 4
    assert replayed(manifest) == sorted(replayed(manifest))


def test_replay_shards_keep_their_sha256_and_samples() -> None:
    manifest = manifest_from(NEW, TRAINED, dataclasses.replace(with_replay(0.5), quota=4), sequence=2)

    by_id = {s.shard_id: s for s in TRAINED}
    assert [s.model_copy(update={"role": "new"}) for s in manifest.shards[4:]] \
        == [by_id[i] for i in replayed(manifest)]


def test_replay_is_deterministic_for_the_same_new_shards() -> None:
    settings = dataclasses.replace(with_replay(0.5), quota=4)

    first = manifest_from(NEW, TRAINED, settings, sequence=2)
    again = manifest_from(list(reversed(NEW)), list(reversed(TRAINED)), settings, sequence=2)

    assert replayed(first) == replayed(again)
    assert first.digest == again.digest


def test_replay_differs_for_different_new_shards() -> None:
    settings = dataclasses.replace(with_replay(0.5), quota=4)
    other_new = [shard(n) for n in range(5, 9)]

    assert replayed(manifest_from(NEW, TRAINED, settings, sequence=2)) \
        != replayed(manifest_from(other_new, TRAINED, settings, sequence=2))


def test_replay_never_takes_more_than_the_trained_shards() -> None:
    # 0.9 of the mix would want 36 earlier shards for 4 new ones; only 3 exist
    manifest = manifest_from(NEW, TRAINED[:3], dataclasses.replace(with_replay(0.9), quota=4), sequence=2)

    assert replayed(manifest) == [s.shard_id for s in TRAINED[:3]]


def test_replay_without_trained_shards_is_empty() -> None:
    assert replay_shards([ref(1), ref(2)], [], 0.5) == []


@pytest.mark.parametrize(("new", "share", "wanted"), [
    (4, 0.5, 4), (8, 0.2, 2), (4, 0.2, 1), (3, 0.25, 1), (8, 0.0, 0),
])
def test_replay_count_makes_up_the_share_of_the_mix(new: int, share: float, wanted: int) -> None:
    assert len(replay_shards([ref(n) for n in range(1, new + 1)], TRAINED, share)) == wanted


# --- digests and names ----------------------------------------------------------------------------

def test_job_name_is_a_valid_sagemaker_name() -> None:
    name = job_name_for(manifest_of(ref(1), ref(2)))

    assert len(name) <= 63 and JOB_NAME.match(name)


def test_job_name_is_atelier_and_20_hex_of_the_manifest_digest() -> None:
    manifest = manifest_of(ref(1), ref(2))

    assert job_name_for(manifest) == f"atelier-{manifest.digest[:20]}"


def test_stage_job_names_add_the_stage_index_after_the_first() -> None:
    manifest = manifest_of(ref(1), ref(2))

    assert [job_name_for(manifest, k) for k in (0, 1, 2)] == [
        f"atelier-{manifest.digest[:20]}", f"atelier-{manifest.digest[:20]}-s1", f"atelier-{manifest.digest[:20]}-s2"]
    assert all(JOB_NAME.match(job_name_for(manifest, k)) for k in (1, 29))


def test_job_name_is_stable_for_the_same_manifest() -> None:
    assert job_name_for(manifest_of(ref(1), ref(2))) == job_name_for(manifest_of(ref(1), ref(2)))


def test_job_name_differs_for_different_shards() -> None:
    assert job_name_for(manifest_of(ref(1), ref(2))) != job_name_for(manifest_of(ref(1), ref(3)))


def test_same_shards_at_the_next_sequence_name_a_new_job() -> None:
    # GIVEN the shards of a job that failed, claimed again as the lineage's next manifest
    pending = [shard(1), shard(2)]
    failed = manifest_from(pending, [], SETTINGS, sequence=1)
    retried = manifest_from(pending, [], SETTINGS, sequence=2)

    # THEN the digest and so the job name differ, though the shards are the same
    assert failed.shards == retried.shards
    assert failed.digest != retried.digest
    assert job_name_for(failed) != job_name_for(retried)


def test_digest_depends_on_the_lineage() -> None:
    assert manifest_of(ref(1), ref(2), lineage="main").digest != manifest_of(ref(1), ref(2), lineage="faces").digest


def test_digest_depends_on_a_shard_being_replayed() -> None:
    assert manifest_of(ref(1), ref(2)).digest != manifest_of(ref(1), ref(2, role="replay")).digest


# --- manifest_file --------------------------------------------------------------------------------

def test_manifest_file_is_a_prefix_then_relative_keys() -> None:
    assert manifest_file(manifest_of(ref(1), ref(2))) == [{"prefix": f"s3://{DATA}/shards/"},
                                                          f"{shard(1).shard_id}.tar", f"{shard(2).shard_id}.tar"]


def test_manifest_file_lists_replay_shards_too() -> None:
    manifest = manifest_of(ref(1), ref(101, role="replay"))

    assert manifest_file(manifest) == [{"prefix": f"s3://{DATA}/shards/"},
                                       f"{shard(1).shard_id}.tar", f"{shard(101).shard_id}.tar"]
