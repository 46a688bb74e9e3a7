"""The end-to-end invariants, checked over a time window (docs/reliability.md).

For every upload in the window (sidecars too: each must have a record): it is quarantined, a
recorded sidecar, or its sample is in exactly one sealed shard (sealed in the window or at any time
before: a re-upload of bytes packed long ago is in that shard); one still on its way (no record yet, not packed, its shard not sealed) is *pending* while younger
than the grace period and *lost* after. No sample is in two shards. Every sealed shard's bytes are
what its index says: each member's header and data re-hashed at the index's offsets, padding and
trailer zero, and the index's tree digest equal to the announced one.

`reconcile` and `verify_shard` are pure (data in, findings out); `gather` fetches the data through
core.aws and calls them.
"""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO, Callable, Iterable, Literal

from pydantic import BaseModel

from contracts import pipeline_table
from contracts.messages import ShardSealed
from core import aws
from core.ingest import uploads
from core.pack import shards

READ_CHUNK = 1 << 20
Stage = Literal["unrecorded", "unpacked", "unsealed"]


@dataclass(frozen=True)
class UploadFact:
    """One uploaded object as S3 lists it."""

    key: str
    etag: str
    last_modified: datetime


@dataclass(frozen=True)
class ShardFact:
    """One sealed shard and the sample keys its index lists (in shard order)."""

    shard_id: str
    sealed_at: str
    sample_keys: tuple[str, ...]


class Pending(BaseModel):
    key: str
    stage: Stage
    age_s: float


class Violation(BaseModel):
    kind: Literal["lost", "duplicated", "corrupt", "missing_index"]
    subject: str  # an upload key, a sample key or a shard id
    detail: str


class Report(BaseModel):
    since: str
    until: str
    grace_s: float
    uploads: int = 0
    accepted: int = 0
    quarantined: int = 0
    sidecars: int = 0  # recorded sidecars (core.ingest.sidecars), whatever their fate: none needs a shard
    shards: int = 0  # whose index was read: sealed in the window, or earlier and holding an audited sample
    shards_verified: int = 0  # whose bytes were re-hashed: those sealed in the window
    pending: list[Pending] = []
    violations: list[Violation] = []

    @property
    def ok(self) -> bool:
        return not self.violations


# --- the reconciliation (pure) ------------------------------------------------------------------

def reconcile(facts: Iterable[UploadFact], upload_records: dict[str, dict[str, Any]],
              sample_records: dict[str, dict[str, Any]], sealed: Iterable[ShardFact], now: datetime,
              report: Report) -> Report:
    """Fill `report` with the uploads' fates. `upload_records` by key, `sample_records` by sha256."""
    where: dict[str, list[str]] = defaultdict(list)  # sample key -> the shards listing it (twice if twice)
    for shard in sealed:
        report.shards += 1
        for key in shard.sample_keys:
            where[key].append(shard.shard_id)
    for key, found in sorted(where.items()):
        if len(found) > 1:
            report.violations.append(Violation(kind="duplicated", subject=key, detail=f"in {sorted(found)}"))
    for fact in facts:
        sidecar = uploads.is_sidecar(fact.key)  # counted apart: any record of it will do
        report.uploads += not sidecar
        record = upload_records.get(fact.key)
        if record and record.get("etag") and fact.etag and record["etag"] != fact.etag:
            record = None  # a record of an earlier version of the key: this version is not handled yet
        stage: Stage | None
        if record is None:
            stage = "unrecorded"
        elif sidecar:
            report.sidecars += 1
            continue
        elif record.get("status") == "quarantined":
            report.quarantined += 1
            continue
        else:
            report.accepted += 1
            sha256 = str(record.get("sha256") or "")
            if where.get(sha256):
                continue
            stage = "unsealed" if (sample_records.get(sha256) or {}).get("packed_in") else "unpacked"
        age = (now - fact.last_modified).total_seconds()
        if age <= report.grace_s:
            report.pending.append(Pending(key=fact.key, stage=stage, age_s=round(age, 1)))
        else:
            report.violations.append(Violation(kind="lost", subject=fact.key,
                                               detail=f"{stage} {age:.0f} s after upload"))
    return report


# --- a shard's bytes against its index (pure over a stream) ------------------------------------

def index_members(index: dict[str, Any]) -> list[shards.MemberDigest]:
    return [shards.MemberDigest(m["offset"], m["header_sha256"], m["size"], m["sha256"])
            for sample in index["samples"] for m in sample["members"]]


def verify_shard(index: dict[str, Any], announced_sha256: str, stream: BinaryIO) -> list[str]:
    """What is wrong with a shard's bytes (read once, in order) against its index; [] if nothing."""
    members = index_members(index)
    problems = []
    if shards.tree_digest(members, index["bytes"]) != index["digest"]:
        problems.append("the index's members do not give its digest")
    if index["digest"] != announced_sha256:
        problems.append(f"index digest {index['digest'][:12]} is not the announced {announced_sha256[:12]}")
    position = 0
    for member in members:
        if member.offset != position:
            problems.append(f"member at {member.offset} does not follow the previous one (at {position})")
            return problems
        header = stream.read(shards.BLOCK)
        data_sha, read = _hash(stream, member.size)
        pad = stream.read(shards.padding(member.size))
        position += shards.member_span(member.size)
        if read < member.size:
            problems.append(f"truncated in the member at {member.offset}")
            return problems
        if hashlib.sha256(header).hexdigest() != member.header_sha256 or data_sha != member.sha256:
            problems.append(f"member at {member.offset} ({_name(header)}) does not match its hashes")
        if pad.count(0) != len(pad):
            problems.append(f"non-zero padding after the member at {member.offset}")
    rest = stream.read()
    if rest.count(0) != len(rest) or position + len(rest) != index["bytes"]:
        problems.append(f"trailer: {position + len(rest)} bytes in all, index says {index['bytes']}, "
                        f"{'zero' if rest.count(0) == len(rest) else 'not zero'}")
    return problems


def _hash(stream: BinaryIO, size: int) -> tuple[str, int]:
    digest, read = hashlib.sha256(), 0
    while read < size:
        chunk = stream.read(min(READ_CHUNK, size - read))
        if not chunk:
            break
        digest.update(chunk)
        read += len(chunk)
    return digest.hexdigest(), read


def _name(header: bytes) -> str:
    return header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")


# --- fetching (core.aws) ------------------------------------------------------------------------

@dataclass(frozen=True)
class Targets:
    uploads_bucket: str
    data_bucket: str
    table: str


def gather(targets: Targets, since: datetime, until: datetime, grace_s: float, verify_bytes: bool = True,
           now: datetime | None = None, on_shard: Callable[[int, int], None] | None = None) -> Report:
    """Audit the uploads made in [since, until) against every shard sealed since `since` and every
    earlier one that holds one of their samples; `on_shard(done, total)` follows the shards
    (re-hashing them is the long part). Shards sealed before `since` are re-hashed by the audit of
    their own window, not again here."""
    now = now or datetime.now(timezone.utc)
    report = Report(since=since.isoformat(), until=until.isoformat(), grace_s=grace_s)
    facts = [UploadFact(o["Key"], str(o.get("ETag", "")).strip('"'), o["LastModified"])
             for o in aws.list_objects(targets.uploads_bucket)
             if since <= o["LastModified"] < until]
    found = aws.batch_get_items(targets.table, [pipeline_table.upload_pk(targets.uploads_bucket, f.key) for f in facts])
    upload_records = {pk.removeprefix(pipeline_table.upload_pk(targets.uploads_bucket, "")): item
                      for pk, item in found.items()}
    accepted = [str(r["sha256"]) for r in upload_records.values() if r.get("status") == "accepted" and r.get("sha256")]
    samples = {pk.removeprefix(pipeline_table.sample_pk("")): item for pk, item in
               aws.batch_get_items(targets.table, [pipeline_table.sample_pk(s) for s in accepted], ["pk", "packed_in"]).items()}
    sealed = [ShardSealed.model_validate_json(i["record"]) for i in aws.scan_prefix(targets.table, pipeline_table.SEALED_PREFIX)]
    holding = {str(item["packed_in"]) for item in samples.values() if item.get("packed_in")}
    in_window = [s for s in sorted(sealed, key=lambda s: s.sealed_at) if datetime.fromisoformat(s.sealed_at) >= since]
    earlier = [s for s in sorted(sealed, key=lambda s: s.sealed_at)
               if datetime.fromisoformat(s.sealed_at) < since and s.shard_id in holding]
    facts_of_shards = []
    for done, shard in enumerate(in_window + earlier):
        if on_shard:
            on_shard(done, len(in_window) + len(earlier))
        index = aws.read_json_if_exists(shard.bucket, shard.index_key or shards.index_key(shard.shard_id))
        if index is None:
            report.violations.append(Violation(kind="missing_index", subject=shard.shard_id,
                                               detail=f"no index at {shard.index_uri or shard.index_key}"))
            continue
        facts_of_shards.append(ShardFact(shard.shard_id, shard.sealed_at, tuple(s["key"] for s in index["samples"])))
        if verify_bytes and done < len(in_window):
            problems = _verify_object(shard, index)
            report.shards_verified += 1
            report.violations += [Violation(kind="corrupt", subject=shard.shard_id, detail=p) for p in problems]
    if on_shard:
        on_shard(len(in_window) + len(earlier), len(in_window) + len(earlier))
    return reconcile(facts, upload_records, samples, facts_of_shards, now, report)


def _verify_object(shard: ShardSealed, index: dict[str, Any]) -> list[str]:
    if aws.head_object(shard.bucket, shard.key) is None:
        return [f"s3://{shard.bucket}/{shard.key} does not exist"]
    _, body = aws.open_object(shard.bucket, shard.key)
    try:
        return verify_shard(index, shard.sha256, body)
    finally:
        body.close()


def to_json(report: Report) -> str:
    return json.dumps({**report.model_dump(), "ok": report.ok}, indent=1)
