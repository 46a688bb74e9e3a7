"""A training manifest: which shards a job trains on (the oldest pending ones, a replay share of
trained ones, less what licensing screens out), its name, and the files that list it in S3: the
manifest itself, its ManifestFile (the jobs' `train` channel), the ManifestFile of its shards'
sample tables (their `indexes` channel) and its wids shard list."""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Callable

from contracts import pipeline_table, s3_layout
from contracts.messages import Manifest, ShardRef, ShardSealed
from core import aws
from core.partners import licensing
from core.provenance import Verdict, screen_shard
from core.start_training.settings import TrainingSettings


def job_name_for(manifest: Manifest, plan_index: int = 0) -> str:
    """At most 63 characters of [a-zA-Z0-9-], unique per manifest and run-plan job."""
    return f"atelier-{manifest.digest[:20]}" + (f"-s{plan_index}" if plan_index else "")


def manifest_from(pending: list[ShardSealed], trained: list[ShardRef], settings: TrainingSettings,
                  sequence: int, screen: Callable[[ShardRef], Verdict] | None = None) -> Manifest | None:
    """The oldest `quota` pending shards that `screen` leaves something of, plus a replay share of
    trained ones; None below quota. Samples and shards screened out are listed with their reasons."""
    if len(pending) < settings.quota:
        return None
    new: list[ShardRef] = []
    verdicts: dict[str, Verdict] = {}
    for s in sorted(pending, key=lambda s: (s.sealed_at, s.shard_id)):
        if len(new) == settings.quota:
            break
        ref = ShardRef(shard_id=s.shard_id, key=s.key, sha256=s.sha256, samples=s.samples, partners=tuple(s.partners),
                       table_key=s.table_key)
        verdicts[s.shard_id] = screen(ref) if screen else Verdict()
        if not verdicts[s.shard_id].whole:
            new.append(ref)
    if len(new) < settings.quota:
        return None
    replay = []
    for ref in replay_shards(new, trained, settings.replay_share):
        verdicts[ref.shard_id] = screen(ref) if screen else Verdict()
        if not verdicts[ref.shard_id].whole:
            replay.append(ref)
    return Manifest(bucket=settings.data_bucket, prefix=s3_layout.SHARDS, shards=tuple(new + replay),
                    lineage=settings.lineage, sequence=sequence,
                    exclude={i: v.keys for i, v in verdicts.items() if v.keys and not v.whole},
                    left_out=tuple(sorted((e for v in verdicts.values() for e in v.left_out),
                                          key=lambda e: (e.shard_id, e.sha256))))


class Screen:
    """The registry's terms and the takedowns as of now, applied to a shard at most once."""

    def __init__(self, pending: list[ShardSealed], trained: list[ShardRef], settings: TrainingSettings) -> None:
        partners = {p for s in pending for p in s.partners} | {p for s in trained for p in s.partners}
        self.rules = licensing.rules_for(settings.table, partners, settings.use)
        self.settings = settings
        self.verdicts: dict[str, Verdict] = {}

    def __call__(self, shard: ShardRef) -> Verdict:
        if shard.shard_id not in self.verdicts:
            self.verdicts[shard.shard_id] = screen_shard(shard, self.rules, self.settings.data_bucket, self.settings.table)
        return self.verdicts[shard.shard_id]


def leave_out_whole(verdicts: dict[str, Verdict], pending: set[str], settings: TrainingSettings) -> None:
    """Pending shards with nothing left to train on leave the pending index for good, with the reason
    (after the claim: a crash before this leaves them pending, and the next manifest lists them again)."""
    for shard_id, verdict in verdicts.items():
        if verdict.whole and shard_id in pending:
            aws.update_item(settings.table, pipeline_table.shard_pk(shard_id),
                            "SET #s = :excluded, excluded_reason = :r REMOVE gsi1pk, gsi1sk",
                            {":excluded": "excluded", ":r": verdict.left_out[0].reason, ":pending": "pending"},
                            condition="#s = :pending", names={"#s": "status"})


def replay_shards(new: list[ShardRef], trained: list[ShardRef], share: float) -> list[ShardRef]:
    """Earlier shards making up `share` of the mix, drawn with a seed from the new shards."""
    if share <= 0 or not trained:
        return []
    wanted = min(len(trained), int(len(new) * share / (1 - share) + 0.5))  # half up, not to even
    seed = int(hashlib.sha256("".join(s.shard_id for s in new).encode()).hexdigest()[:16], 16)
    picked = random.Random(seed).sample(sorted(trained, key=lambda s: s.shard_id), wanted)
    return [s.model_copy(update={"role": "replay"}) for s in sorted(picked, key=lambda s: s.shard_id)]


def manifest_file(manifest: Manifest) -> list[Any]:
    """A SageMaker ManifestFile: a prefix, then keys relative to it."""
    relative = [s.key.removeprefix(manifest.prefix) for s in manifest.shards]
    return [{"prefix": s3_layout.uri(manifest.bucket, manifest.prefix)}, *relative]


def indexes_file(manifest: Manifest) -> list[Any] | None:
    """The ManifestFile of the shards' sample tables, for the `indexes` channel; None when no shard has
    one (sealed before tables): SageMaker fails a job whose channel lists nothing. A shard without a
    table is indexed by walking its tar (trainer/data/shards.py)."""
    tables = [s.table_key.removeprefix(s3_layout.INDEXES) for s in manifest.shards if s.table_key]
    return [{"prefix": s3_layout.uri(manifest.bucket, s3_layout.INDEXES)}, *tables] if tables else None


def write_files(manifest: Manifest, name: str, bucket: str) -> None:
    """The manifest's files under the job's name (deterministic content: writing them twice is harmless)."""
    files = {s3_layout.MANIFEST_JSON: manifest.model_dump_json(indent=1),
             s3_layout.MANIFEST_FILE: json.dumps(manifest_file(manifest)),
             s3_layout.WIDS_LIST: json.dumps(wids_shard_list(manifest, name), indent=1)}
    if (tables := indexes_file(manifest)) is not None:
        files[s3_layout.INDEXES_MANIFEST] = json.dumps(tables)
    for suffix, text in files.items():
        aws.write_object(bucket, s3_layout.manifest_key(name, suffix), text.encode(), "application/json")


def wids_shard_list(manifest: Manifest, name: str) -> dict[str, Any]:
    """The manifest as the shard-list JSON `wids.ShardListDataset` opens (webdataset's wids spec).

    URLs are relative to the list's own key (`manifests/`), so the list opens in place on S3 or in a
    synced copy of the bucket. `nsamples` counts every sample in the tar, as wids indexes it; samples
    the trainer skips (revoked or no longer licensed) are listed per shard under `atelier_exclude`,
    which wids ignores: a reader must drop those `__key__`s itself (docs/pack.md).
    """
    depth = s3_layout.MANIFESTS.count("/")
    shards = []
    for shard in manifest.shards:
        entry: dict[str, Any] = {"url": "../" * depth + shard.key, "nsamples": shard.samples}
        if manifest.exclude.get(shard.shard_id):
            entry["atelier_exclude"] = list(manifest.exclude[shard.shard_id])
        shards.append(entry)
    return {"__kind__": "wids-shard-index-v1", "wids_version": 1, "name": name, "shardlist": shards}
