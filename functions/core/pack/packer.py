"""Pack stage: accepted samples -> segments of the open shard -> sealed shards, each sample once.

The commit protocol (docs/pack.md), which every invocation follows:
1. Read the journal head (core.pack.journal, version v) and finish the `packed_in` marks of its
   pending segment, so every sample of every committed segment is marked.
2. Drop the batch's samples that are marked: they are in a committed segment already. The others
   are packed with the caption their records hold now (a late sidecar may have set it: core.ingest.sidecars).
3. Stream the others, while they fit the open shard, into a new immutable segment (core.pack.segments).
4. Commit it with one conditional write of the head (`version = v`). If another packer committed
   first, go back to 1; the segment is reused if its samples are still unpacked.
5. Mark the segment's samples `packed_in` and clear pending.
6. A full or old shard leaves the head for a seal record in one transaction; core.pack.seal finishes
   it. The batch's messages are acknowledged only after all this returned.
A crash anywhere leaves either an uncommitted segment (garbage; the redelivered message packs the
sample again) or a committed one whose marks and seal the next invocation finishes.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from contracts.messages import Sample, ShardSealed
from core import aws, telemetry
from core.pack import journal, lanes, seal, segments, shards
from core.pack.journal import Head, OpenShard, Pending
from core.pack.settings import PackSettings

logger = Logger(child=True)
MAX_SEGMENTS = 1000  # per shard: bounds the head item (DynamoDB's 400 KB) and the parts (S3's 10,000)
MAX_SEGMENT_BYTES = 1 << 30
MIN_SAMPLE_SPAN = 4 * shards.BLOCK  # three headers and some data: below this room, a shard is full
TRANSACTION_ITEMS = 100  # DynamoDB's limit
MAX_ROUNDS = 50  # of lost races before an invocation gives up (its messages come back later)
SIDECAR_FIELDS = ("caption", "caption_source", "source")  # what a late sidecar may change (core.ingest.sidecars)
SEAL_TIMER_S = 60  # template.yaml's PackFunction SealTimer, rate(1 minute): how far ahead a tick seals


class PackContention(RuntimeError):
    """Other packers kept committing first; the batch is retried from the queue."""


@dataclass
class PackReport:
    committed: int = 0  # samples this invocation appended
    already_packed: int = 0  # samples some committed segment already held (redeliveries)
    failed: list[str] = field(default_factory=list)  # message ids whose sample cannot be read
    sealed: list[ShardSealed] = field(default_factory=list)  # shards this invocation announced


def pack_samples(messages: list[tuple[str, Sample]], settings: PackSettings) -> PackReport:
    """Append every sample of a batch to its lane's open shard exactly once, then seal what is due."""
    recorded = _recorded_lanes(sorted({sample.sha256 for _, sample in messages}), settings)
    by_lane: dict[int, list[tuple[str, Sample]]] = defaultdict(list)
    for message_id, sample in messages:
        lane = recorded.get(sample.sha256)
        by_lane[lanes.lane_of(sample.sha256, settings.lanes) if lane is None else lane].append((message_id, sample))
    report = PackReport()
    for lane in lanes.visiting_order(sorted(by_lane)):
        _pack_lane(lane, by_lane[lane], settings, report)
    report.sealed = seal_due(settings, sorted(by_lane))
    return report


def _pack_lane(lane: int, messages: list[tuple[str, Sample]], settings: PackSettings, report: PackReport) -> None:
    """The commit protocol on one lane's head, for the samples of the batch that hash to it."""
    samples = {sample.sha256: sample for _, sample in messages}  # a batch can hold one sample twice
    message_ids: dict[str, list[str]] = defaultdict(list)
    for message_id, sample in messages:
        message_ids[sample.sha256].append(message_id)
    committed = 0
    unavailable_keys: set[str] = set()
    todo = sorted(samples)
    spare: segments.Written | None = None  # written, but its commit lost a race
    for _ in range(MAX_ROUNDS + 2 * len(todo)):
        if not todo:
            break
        head = _settle(journal.load_head(settings.table, lane), settings)
        current = _records(todo, settings)
        todo = sorted(k for k in todo if not current.get(k, {}).get("packed_in"))
        if not todo:
            break
        samples.update({k: _with_sidecar_fields(samples[k], current[k])
                        for k in todo if current.get(k, {}).get("record")})
        try:
            written = None if head.open and _due(head.open, settings) else \
                _segment(head, [samples[k] for k in todo], spare, settings)
        except segments.SampleUnavailable as unavailable:
            logger.error("sample cannot be packed", extra={"sha256": unavailable.sample.sha256,
                                                           "error": str(unavailable)})
            unavailable_keys.add(unavailable.sample.sha256)
            report.failed += message_ids[unavailable.sample.sha256]
            todo.remove(unavailable.sample.sha256)
            continue
        if written is None:  # the open shard is due, or the next sample does not fit in it
            journal.begin_seal(settings.table, head, _now())
            continue
        if not _commit(head, written, settings):
            spare = written
            continue
        spare = None
        committed += written.segment.samples
        todo = sorted(set(todo) - {s.sha256 for s in written.samples})
    else:
        raise PackContention(f"lane {lane}: {len(todo)} samples still unpacked after {MAX_ROUNDS} rounds of lost races")
    report.committed += committed
    report.already_packed += len(samples) - committed - len(unavailable_keys)


def seal_due(settings: PackSettings, lanes_to_check: list[int] | None = None, ahead_s: float = 0) -> list[ShardSealed]:
    """Seal each lane's open shard if it is full or old, and finish every seal in progress.

    `ahead_s`: also seal a shard that would pass its maximum age within that many seconds. The timer
    gives its own period (SEAL_TIMER_S): the next tick would come too late for it, so no sample waits
    longer than SHARD_MAX_AGE_S for its shard (at most a tick less).

    Without `lanes_to_check` (the timer), every lane up to lanes.MAX_LANES is looked at, in one
    read: shards opened before PackLanes was lowered are sealed too.

    A seal that fails does not stop the others. After a batch (`lanes_to_check` given) it is logged
    and left to the timer: the batch's samples are committed, and failing it would only send them
    round again, and with a seal that keeps failing, every batch to the DLQ. The timer raises it
    once every seal had its turn, so the tick fails into PackScheduleDLQ and its alarm.
    """
    heads = [journal.load_head(settings.table, lane) for lane in lanes_to_check] if lanes_to_check is not None \
        else [head for head in journal.load_heads(settings.table, lanes.MAX_LANES) if head.version]
    sealed: list[ShardSealed] = []
    failures: list[Exception] = []
    for head in heads:
        head = _settle(head, settings)
        if head.open and _due(head.open, settings, ahead_s) and journal.begin_seal(settings.table, head, _now()):
            head = journal.load_head(settings.table, head.lane)
        for shard_id in sorted(head.sealing):
            try:
                if done := seal.finish(shard_id, settings):
                    sealed.append(done)
            except seal.SealBusy:  # its holder finishes it, or the timer once the holder's lease ends
                logger.info("seal in progress elsewhere", extra={"shard": shard_id, "lane": head.lane})
            except Exception as failed:  # noqa: BLE001 - each seal is retried on its own (docstring)
                logger.exception("seal failed; the timer retries it", extra={"shard": shard_id, "lane": head.lane})
                failures.append(failed)
    if failures and lanes_to_check is None:
        raise failures[0]
    return sealed


# --- the protocol's steps -----------------------------------------------------------------------

def _settle(head: Head, settings: PackSettings) -> Head:
    """Finish the marks of the last committed segment (step 1)."""
    if head.pending is None:
        return head
    keys = [entry.key for entry in segments.read_index(settings.data_bucket, head.pending.segment)]
    _mark(keys, head.pending.shard_id, settings)
    journal.clear_pending(settings.table, head)
    return dataclasses.replace(head, pending=None)


def _segment(head: Head, candidates: list[Sample], spare: segments.Written | None,
             settings: PackSettings) -> segments.Written | None:
    """Step 3: the segment to commit next (the one that lost a race, if it still fits), or None if full."""
    budget, slots = _room(head.open, settings)
    wanted = {c.sha256: c for c in candidates}  # samples are compared whole: a late sidecar changes the bytes
    if spare and all(wanted.get(s.sha256) == s for s in spare.samples) \
            and spare.segment.samples <= slots and (spare.segment.size <= budget or head.open is None):
        return spare
    return segments.write_segment(candidates, settings.data_bucket, budget, slots, take_first=head.open is None,
                                  part_bytes=settings.part_bytes)


def _with_sidecar_fields(sample: Sample, item: dict) -> Sample:
    """The caption and source as the record says now, not as the message did: a late sidecar may
    have set them since the message was sent (core.ingest.sidecars)."""
    record = Sample.model_validate_json(item["record"])
    return sample.model_copy(update={name: getattr(record, name) for name in SIDECAR_FIELDS})


def _recorded_lanes(keys: list[str], settings: PackSettings) -> dict[str, int]:
    """The lane each sample's record was given when ingest first wrote it. Every delivery of a sample
    then meets one head, even across a change of PackLanes; a record without one (written before
    lanes) takes the hash's lane under the current count."""
    items = aws.batch_get_items(settings.table, [pipeline_table.sample_pk(k) for k in keys], ["pk", "pack_lane"])
    return {pipeline_table.sample_sha256(pk): int(item["pack_lane"]) for pk, item in items.items()
            if item.get("pack_lane") is not None}


def _records(keys: list[str], settings: PackSettings) -> dict[str, dict]:
    """Each sample's item (its `record` and `packed_in`), by sha256; absent ones left out."""
    items = aws.batch_get_items(settings.table, [pipeline_table.sample_pk(k) for k in keys], ["pk", "record", "packed_in"])
    return {k: items[pipeline_table.sample_pk(k)] for k in keys if pipeline_table.sample_pk(k) in items}


def _commit(head: Head, written: segments.Written, settings: PackSettings) -> bool:
    """Step 4 and 5: append the segment if the head is still `head`, then mark its samples."""
    keys = [s.sha256 for s in written.samples]
    shard = head.open or OpenShard(shard_id=shards.shard_id_for(keys), opened_at=_now())
    shard = shard.appended(written.segment, written.partners, written.aspects)
    if not journal.append(settings.table, head, shard, Pending(shard_id=shard.shard_id, segment=written.segment)):
        logger.info("another packer committed first; retrying", extra={"version": head.version})
        return False
    logger.info("segment committed", extra={"shard": shard.shard_id, "segment": written.segment.key,
                                            "samples": written.segment.samples, "bytes": written.segment.size})
    _mark(keys, shard.shard_id, settings)
    journal.clear_pending(settings.table, dataclasses.replace(head, version=head.version + 1, open=shard, pending=None))
    _report_packed(written, shard.shard_id)
    return True


def _report_packed(written: segments.Written, shard_id: str) -> None:
    """One line per sample under its upload key (ingest's correlation id), and the stage's metrics."""
    telemetry.count(telemetry.SAMPLES_PACKED, written.segment.samples)
    telemetry.count(telemetry.SEGMENT_BYTES, written.segment.size, telemetry.MetricUnit.Bytes)
    for sample in written.samples:
        with telemetry.correlated(sample.key, sha256=sample.sha256):
            logger.info("sample packed", extra={"shard": shard_id, "segment": written.segment.key})
        latency = telemetry.seconds_since(sample.uploaded_at)
        if latency is not None:
            telemetry.count(telemetry.UPLOAD_TO_SHARD_SECONDS, latency, telemetry.MetricUnit.Seconds)


def _mark(keys: list[str], shard_id: str, settings: PackSettings) -> None:
    """`packed_in` on each sample's record, 100 to a transaction (one conditional update each)."""
    def update(key: str) -> tuple[str, str, str, dict]:
        return (pipeline_table.sample_pk(key), "SET packed_in = :s", "attribute_not_exists(packed_in) OR packed_in = :s",
                {":s": shard_id})

    for start in range(0, len(keys), TRANSACTION_ITEMS):
        chunk = keys[start:start + TRANSACTION_ITEMS]
        if aws.transact_updates(settings.table, [update(k) for k in chunk], []):
            continue
        for key in chunk:  # the protocol rules this out; find and report the sample that broke it
            pk, expression, condition, values = update(key)
            if not aws.update_item(settings.table, pk, expression, values, condition=condition):
                logger.error("sample already packed in another shard", extra={"sha256": key, "shard": shard_id})


def _room(shard: OpenShard | None, settings: PackSettings) -> tuple[int, int]:
    """(bytes, samples) the next segment may add to the open shard."""
    used_bytes, used_samples = (shard.bytes, shard.samples) if shard else (0, 0)
    budget = settings.shard_target_bytes - shards.TRAILER_MAX - used_bytes
    return min(MAX_SEGMENT_BYTES, budget), settings.shard_max_samples - used_samples


def _due(shard: OpenShard, settings: PackSettings, ahead_s: float = 0) -> bool:
    """Full (no room for a sample, or at a limit), or at its maximum age within `ahead_s` seconds."""
    budget, slots = _room(shard, settings)
    age = datetime.now(timezone.utc) - datetime.fromisoformat(shard.opened_at)
    return budget < MIN_SAMPLE_SPAN or slots <= 0 or len(shard.segments) >= MAX_SEGMENTS \
        or age.total_seconds() + ahead_s >= settings.shard_max_age_s


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
