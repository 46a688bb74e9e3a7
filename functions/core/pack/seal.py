"""Seal one shard: index + digest -> one object composed server-side -> recorded -> announced.

Each step is idempotent and recorded in the shard's journal item before the next starts
(sealing -> indexed -> composed -> announced -> done), so whichever invocation comes next (a
batch, the schedule) finishes a seal that another one started and did not finish.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator

from aws_lambda_powertools import Logger

from contracts import pipeline_table, shard_index
from contracts.aspect_buckets import bucket_ratio
from contracts.messages import ShardSealed
from core import aws, telemetry
from core.pack import journal, segments, shards
from core.pack.journal import SealState
from core.pack.settings import PackSettings

logger = Logger(child=True)
EVENT_SOURCE = "atelier.pack"
SHARD_SEALED = "Shard Sealed"
MAX_PART_BYTES = 5 << 30  # S3's largest part
INDEX_VERSION = 2  # of the JSON index: 2 names its sample table (`table_key`); 1 had no `version`
KEY_BYTES = 64  # a pipeline shard's sample key is its sha256 in hex: the sample table's key column


class SealBusy(RuntimeError):
    """Another invocation holds this seal's lease: it is finishing it."""


def finish(shard_id: str, settings: PackSettings) -> ShardSealed | None:
    """Run the remaining steps of one seal; the shard if this call announced it.

    Raises SealBusy if another invocation is sealing it (journal.claim_seal)."""
    with telemetry.correlated(shard_id):
        state = journal.load_seal(settings.table, shard_id)
        announced = None
        if state is not None and state.status != "done":
            owner, now_ms = uuid.uuid4().hex, int(time.time() * 1000)
            if not journal.claim_seal(settings.table, shard_id, owner, now_ms + int(settings.seal_lease_s * 1000),
                                      now_ms):
                raise SealBusy(f"{shard_id} is being sealed by another invocation")
            try:
                while state is not None and state.status != "done":
                    step = _STEPS[state.status](state, settings)
                    if step and journal.advance(settings.table, state, step[0], **step[1]) \
                            and step[0] == "announced":
                        announced = state.sealed
                    state = journal.load_seal(settings.table, shard_id)
            finally:
                journal.release_seal(settings.table, shard_id, owner)
        if state is not None:  # the record names the lane whose head lists it
            journal.forget_sealing(settings.table, state.lane, shard_id)
    if announced is not None:  # counted once: only one invocation moves the seal to "announced"
        telemetry.count(telemetry.SHARDS_SEALED)
        telemetry.count(telemetry.SHARD_BYTES, announced.size, telemetry.MetricUnit.Bytes)
    return announced


# --- steps: each returns the next status and what to record with it (None: another invocation
# moved the seal on meanwhile; read it again) ---------------------------------------------------

def _index(state: SealState, settings: PackSettings) -> tuple[str, dict]:
    """Stream the index sidecar (samples, offsets, sizes, member sha256s, counts), the sample table
    the jobs read at start (contracts.shard_index) and the digest.

    The index is one JSON object, written open-ended: the known fields, then the sample entries one
    segment at a time, then what is only known at the end (size, digest). The table is its header,
    then a row per entry, written as the entries stream by.
    """
    shard = state.shard
    key, index, table = (shards.shard_key(shard.shard_id), shards.index_key(shard.shard_id),
                         shards.table_key(shard.shard_id))
    size = shard.bytes + len(shards.trailer(shard.bytes))
    upload = segments.StreamUpload(settings.data_bucket, index, "application/json", settings.part_bytes)
    rows = segments.StreamUpload(settings.data_bucket, table, "application/octet-stream", settings.min_part_bytes)
    known = {"version": INDEX_VERSION, "shard_id": shard.shard_id, "key": key, "table_key": table,
             "samples_count": shard.samples, "partners": shard.partners, "aspect_buckets": shard.aspects,
             "segments": _segment_spans(shard)}
    upload.write(json.dumps(known)[:-1].encode() + b', "samples": [')
    rows.write(shard_index.TableHeader(shard.shard_id, size, shard.samples, KEY_BYTES).line())
    packer = shard_index.row_struct(KEY_BYTES)
    digest = hashlib.sha256(f"{shards.DIGEST_ALGORITHM}\n".encode())
    for n, entry in enumerate(_entries(shard, settings)):
        lines = [shards.MemberDigest(m.offset, m.header_sha256, m.size, m.sha256).line() for m in entry.members]
        for line in lines:
            digest.update(line.encode())
        upload.write((b", " if n else b"") + entry.model_dump_json().encode())
        rows.write(shard_index.row(packer, entry.key, entry.offset, entry.size, bucket_ratio(entry.aspect),
                                   shard_index.sample_digest(lines)))
    digest.update(f"{size}\n".encode())
    closing = {"bytes": size, "digest": digest.hexdigest(), "digest_algorithm": shards.DIGEST_ALGORITHM}
    upload.write(b"], " + json.dumps(closing)[1:].encode())
    upload.close()
    rows.close()
    sealed = ShardSealed(
        shard_id=shard.shard_id, bucket=settings.data_bucket, key=key, sha256=digest.hexdigest(), size=size,
        samples=shard.samples, partners=sorted(shard.partners), sealed_at=_now(),
        uri=f"s3://{settings.data_bucket}/{key}", index_key=index, index_uri=f"s3://{settings.data_bucket}/{index}",
        digest_algorithm=shards.DIGEST_ALGORITHM, table_key=table)
    return "indexed", {"sealed": sealed}


def _segment_spans(shard: journal.OpenShard) -> list[dict[str, int]]:
    spans, offset = [], 0
    for segment in shard.segments:
        spans.append({"offset": offset, "size": segment.size, "samples": segment.samples})
        offset += segment.size
    return spans


def _entries(shard: journal.OpenShard, settings: PackSettings) -> Iterator[segments.SampleEntry]:
    """Every sample's index entry, offsets within the shard; one segment's index in memory at a time."""
    offset = 0
    for segment in shard.segments:
        for entry in segments.read_index(settings.data_bucket, segment):
            yield entry.shifted(offset)
        offset += segment.size


def _compose(state: SealState, settings: PackSettings) -> tuple[str, dict] | None:
    """The shard object from its segments: UploadPartCopy where a part can be, small runs through here."""
    assert state.sealed is not None
    bucket, key = settings.data_bucket, state.sealed.key
    if _is_complete(bucket, key, state.sealed):
        return "composed", {}
    upload_id = state.upload_id or _start_upload(state, settings)
    if not upload_id:
        return None
    try:
        parts = [_part(number, part, upload_id, state, settings)
                 for number, part in enumerate(plan_parts([s.size for s in state.shard.segments],
                                                          settings.min_part_bytes), start=1)]
        aws.complete_multipart(bucket, key, upload_id, parts)
    except (aws.UploadGone, aws.ClientError) as failed:
        # Another sealer (two packers run at once) may have completed the upload, moved the seal on
        # and deleted the segments this one was still copying: then the failure is moot.
        current = journal.load_seal(settings.table, state.shard.shard_id)
        if current is None or current.status != state.status:
            return None
        if _is_complete(bucket, key, state.sealed):
            return "composed", {}
        if isinstance(failed, aws.UploadGone):  # aborted (a lifecycle rule): start again with a new upload
            journal.set_upload(settings.table, state, "")
        raise
    return "composed", {"upload_id": upload_id}


def _start_upload(state: SealState, settings: PackSettings) -> str:
    """A new multipart upload for the shard, unless another sealer recorded one first ("" if it moved on)."""
    assert state.sealed is not None
    upload_id = aws.create_multipart(settings.data_bucket, state.sealed.key, "application/x-tar",
                                     metadata={"atelier-digest": state.sealed.sha256}, checksum=False)
    if journal.set_upload(settings.table, state, upload_id):
        return upload_id
    aws.abort_multipart(settings.data_bucket, state.sealed.key, upload_id)
    current = journal.load_seal(settings.table, state.shard.shard_id)
    return current.upload_id if current and current.status == state.status else ""


def _is_complete(bucket: str, key: str, sealed: ShardSealed) -> bool:
    head = aws.head_object(bucket, key)
    return bool(head) and head.get("ContentLength") == sealed.size \
        and head.get("Metadata", {}).get("atelier-digest") == sealed.sha256


def _part(number: int, part: "Part", upload_id: str, state: SealState, settings: PackSettings) -> dict:
    bucket, key = settings.data_bucket, shards.shard_key(state.shard.shard_id)
    found = state.shard.segments
    if part.copy:
        (index, start, end), = part.pieces
        return aws.upload_part_copy(bucket, key, upload_id, number, found[index].key, found[index].version_id,
                                    start, end)
    pieces = [aws.read_range(bucket, found[index].key, start, end, found[index].version_id)
              for index, start, end in part.pieces]
    trailer = [shards.trailer(state.shard.bytes)] if part.last else []
    return aws.upload_part(bucket, key, upload_id, number, b"".join(pieces + trailer), checksum=False)


def _announce(state: SealState, settings: PackSettings) -> tuple[str, dict]:
    """The shard's record first (what a re-announcement would read), then the event."""
    assert state.sealed is not None
    aws.put_item_if_absent(settings.table, {"pk": pipeline_table.sealed_pk(state.shard.shard_id), "kind": "sealed",
                                            "record": state.sealed.model_dump_json()})
    aws.put_event(settings.event_bus, EVENT_SOURCE, SHARD_SEALED, state.sealed.model_dump_json())
    logger.info("shard sealed", extra={"shard": state.shard.shard_id, "samples": state.sealed.samples,
                                       "bytes": state.sealed.size})
    return "announced", {}


def _clean(state: SealState, settings: PackSettings) -> tuple[str, dict]:
    """The shard holds the bytes now: delete its segments and their indexes, for good."""
    for segment in state.shard.segments:
        aws.delete_object(settings.data_bucket, segment.key, segment.version_id)
        aws.delete_object(settings.data_bucket, segment.index_key, segment.index_version_id)
    return "done", {}


_STEPS = {"sealing": _index, "indexed": _compose, "composed": _announce, "announced": _clean}


# --- the part plan (pure) -----------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    pieces: tuple[tuple[int, int, int], ...]  # (segment, start, end) byte ranges
    copy: bool  # one range copied server-side; else the ranges are read and uploaded (plus the trailer if last)
    last: bool = False


def plan_parts(sizes: list[int], min_part: int, max_part: int = MAX_PART_BYTES) -> list[Part]:
    """Cover the segments, in order, with parts S3 accepts (>= min_part but the last, <= max_part).

    A run of a segment at least `min_part` long is copied server-side; shorter runs are gathered
    into assembled parts of at least `min_part` (so an assembled part is under 2 x min_part,
    whatever the shard's size). The last part is assembled and carries the tar trailer.
    """
    parts: list[Part] = []
    gathered: list[tuple[int, int, int]] = []
    gathered_bytes = 0
    for index, size in enumerate(sizes):
        start = 0
        if gathered_bytes:
            start = min(size, min_part - gathered_bytes)
            gathered.append((index, 0, start))
            gathered_bytes += start
            if gathered_bytes >= min_part:
                parts.append(Part(tuple(gathered), copy=False))
                gathered, gathered_bytes = [], 0
        rest = size - start
        if rest >= min_part:
            count = -(-rest // max_part)
            bounds = [start + rest * i // count for i in range(count + 1)]
            parts += [Part(((index, a, b),), copy=True) for a, b in zip(bounds, bounds[1:])]
        elif rest:
            gathered.append((index, start, size))
            gathered_bytes += rest
    parts.append(Part(tuple(gathered), copy=False, last=True))
    return parts


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
