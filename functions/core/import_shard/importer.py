"""Import stage: one existing WebDataset tar (img2dataset output, or any webdataset shard) -> its
valid, new samples rewritten as one pipeline shard, sealed and announced like a packed one.

Per source tar, one ImportQueue message (docs/import.md):
1. A shard already `done` in this batch is a no-op (SQS delivers at least once).
2. Stream the tar from S3 (never whole in memory); every sample is decoded and judged by ingest's
   own policy (core.ingest.metadata), then checked against the pipeline's samples: exact sha256 (of the
   stored bytes, and img2dataset's sha256 of the original download) and near duplicates
   (core.ingest.dedup, as the message's `near_duplicates` says: keep, flag or drop). Bad samples are
   quarantined (UPLOAD# records with the reason), duplicates left out.
3. Accepted samples are written as segments by the packer's own writer (core.pack.segments), so the
   shard has exactly a packed shard's bytes, index and digest.
4. Commit: one transaction creates the shard's import record (with its report) and its seal record
   (PACKSHARD#, as the packer's begin_seal would). Whoever commits first wins; a redelivery after
   it resumes from the records, never streams again.
5. Mark the samples `packed_in`, let core.pack.seal index, compose and announce it ("Shard Sealed"),
   then count the shard into the batch once (a conditional status change in the same transaction).
"""

from __future__ import annotations

from typing import Any

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from contracts.messages import ImportShard, Sample, UploadRef
from core import aws, telemetry
from core.errors import RejectedUpload
from core.import_shard.records import (DUPLICATE_REASONS, LISTED_NEAR_DUPLICATES, NearDuplicate, ShardReport, now,
                                       record_pk)
from core.import_shard.source_tar import (NotATar, SourceSample, describe, ends_cleanly, image_extension,
                                          read_samples, same_size, stats_key)
from core.ingest import dedup
from core.pack import journal, seal, segments, shards
from core.pack.journal import OpenShard, SealState
from core.partners import licensing
from core.import_shard.settings import ImportSettings

logger = Logger(child=True)
TRANSACTION_ITEMS = 100


def import_shard_id(message: ImportShard) -> str:
    """Deterministic per (batch, source): a redelivery rebuilds the same shard, another batch a new one."""
    return shards.shard_id_for([f"import:{message.batch_id}:{message.uri}"])


def import_shard(message: ImportShard, settings: ImportSettings) -> ShardReport:
    """Import one source tar exactly once into the pipeline; its report."""
    table = settings.ingest.table
    item = aws.get_item(table, record_pk(message))
    if item and item.get("status") == "done":
        return _published(ShardReport.model_validate_json(item["report"]))
    if item is None:
        report, written = _Reader(message, settings).run()
        item = _commit(message, report, written, settings)
    report = ShardReport.model_validate_json(item["report"])
    if report.shard_id:
        _seal(report.shard_id, settings)
    _count(message, report, settings)
    logger.info("shard imported", extra={"source": message.uri, "shard": report.shard_id, "status": report.status,
                                         "accepted": report.accepted, "quarantined": report.quarantined})
    return _published(report)


def _published(report: ShardReport) -> ShardReport:
    """The report, its metrics added: once per message handled (a redelivered one too)."""
    telemetry.count_by(telemetry.IMPORTED_SHARDS, "status", report.status)
    telemetry.count(telemetry.IMPORTED_SAMPLES, report.accepted)
    telemetry.count(telemetry.IMPORT_DUPLICATES, report.duplicates)
    telemetry.count(telemetry.IMPORT_NEAR_DUPLICATES, report.near_duplicates_found)
    telemetry.count(telemetry.IMPORT_REJECTS, report.rejected)
    return report


class _Reader:
    """One pass over a source tar: validate, deduplicate, write accepted samples as segments."""

    def __init__(self, message: ImportShard, settings: ImportSettings) -> None:
        self.message, self.settings = message, settings
        self.report = ShardReport(source=message.uri, status="empty")
        self.shard_id = import_shard_id(message)
        self.chunk: list[tuple[Sample, bytes]] = []
        self.chunk_bytes = 0
        self.written: list[segments.Written] = []
        self.head: dict[str, Any] = {}

    def run(self) -> tuple[ShardReport, list[segments.Written]]:
        rejected = self._check_source()
        if rejected is not None:
            return self._rejected(rejected), []
        damage: list[str] = []
        version = self.head.get("VersionId") or ""
        size, body = aws.open_object(self.message.bucket, self.message.key, version)
        try:
            with body:
                for sample in read_samples(body, self.settings.ingest.max_upload_bytes, damage,
                                           ends_cleanly(self.message, size, version)):
                    self._take(sample)
        except NotATar as exc:
            return self._rejected(RejectedUpload("not_a_tar", str(exc))), []
        self._flush()
        accepted = sum(w.segment.samples for w in self.written)
        self.report = self.report.model_copy(update={
            "status": "imported" if accepted else "empty", "shard_id": self.shard_id if accepted else None,
            "accepted": accepted, "truncated": bool(damage), "detail": "; ".join(damage)})
        return self.report, self.written

    def _check_source(self) -> RejectedUpload | None:
        head = aws.head_object(self.message.bucket, self.message.key)
        if head is None:
            return RejectedUpload("gone", f"{self.message.uri} does not exist")
        self.head = head
        partner = licensing.get_partner(self.settings.ingest.table, self.message.partner)
        if partner is None or self.message.license not in partner.licenses:
            return RejectedUpload("unlicensed", f"{self.message.partner!r} does not hold {self.message.license!r}")
        stats = aws.read_json_if_exists(self.message.bucket, stats_key(self.message.key)) or {}
        self.report.source_stats = {k: stats[k] for k in ("count", "successes", "failed_to_download",
                                                          "failed_to_resize") if k in stats}
        return None

    def _rejected(self, rejected: RejectedUpload) -> ShardReport:
        return self.report.model_copy(update={"status": "rejected", "reason": rejected.reason,
                                              "detail": rejected.detail})

    def _upload(self, sample_key: str) -> UploadRef:
        """The sample's provenance: the source tar (pinned to its version) and the member key."""
        modified = self.head.get("LastModified")
        return UploadRef(bucket=self.message.bucket, key=f"{self.message.key}#{sample_key}",
                         event_time=modified.isoformat() if modified else now(),
                         etag=str(self.head.get("ETag", "")).strip('"'), version_id=self.head.get("VersionId") or "")

    def _take(self, source: SourceSample) -> None:
        self.report.samples_read += 1
        upload = self._upload(source.key)
        sha256 = None
        try:
            described, original_sha256, claimed_size = describe(source, upload, self.message, self.settings)
            sha256 = described.sample.sha256
            sample = self._admit(described.sample, original_sha256, source.key)
        except RejectedUpload as rejected:
            self._quarantine(upload, rejected, sha256)
            return
        if described.derivative is not None:
            aws.write_object(*sample.content_location, described.derivative, "image/jpeg")
        if not aws.put_item_if_absent(self.settings.ingest.table, pipeline_table.sample_item(sample)) \
                and self._ours(sample.sha256, upload.key) is None:
            self._quarantine(upload, RejectedUpload("duplicate", "the same bytes arrived meanwhile"), sample.sha256)
            return
        dedup.remember(self.settings.ingest.table, sample.sha256, sample.phash, sample.colour)
        if sample.near_duplicate_of:
            self._list_near(source.key, sample)
        self.report.captions_missing += sample.caption_source == "missing"
        if not same_size(claimed_size, sample):
            self.report.size_mismatches += 1
            logger.warning("the tar's width/height disagree with the image", extra={
                "sample": upload.key, "claimed": claimed_size, "decoded": [sample.width, sample.height]})
        content = described.derivative if described.derivative is not None else source.members[image_extension(source)]
        self.chunk.append((sample, content))
        self.chunk_bytes += len(content)
        if self.chunk_bytes >= self.settings.chunk_bytes:
            self._flush()

    def _admit(self, sample: Sample, original_sha256: str | None, key: str) -> Sample:
        """The sample if it is new to the pipeline, flagged if the mode says so (or this very import's
        record, from an earlier attempt)."""
        table = self.settings.ingest.table
        if (ours := self._ours(sample.sha256, sample.key)) is not None:
            return ours
        for sha256 in filter(None, (sample.sha256, original_sha256)):
            item = aws.get_item(table, pipeline_table.sample_pk(sha256))
            if item:
                first = Sample.model_validate_json(item["record"]) if item.get("record") else None
                # the partner sees its own key, never another partner's (the sha256 points operators at it)
                where = first.key if first and first.partner == sample.partner else "a sample already in the dataset"
                raise RejectedUpload("duplicate", f"same {'bytes' if sha256 == sample.sha256 else 'original'} as {where}")
        return self._near_duplicate(sample, key)

    def _near_duplicate(self, sample: Sample, key: str) -> Sample:
        """`sample` as the message's mode has it: unchecked (keep), marked (flag), or refused (drop)."""
        ingest = self.settings.ingest
        if self.message.near_duplicates == "keep" or not sample.phash:
            return sample
        near = dedup.nearest(ingest.table, sample.phash, sample.colour, ingest.near_duplicate_distance,
                             ingest.near_duplicate_colour_distance, exclude=sample.sha256)
        if near is None:
            return sample
        flagged = dedup.flagged(sample, near)
        if self.message.near_duplicates == "drop":
            self._list_near(key, flagged)
            colour = "no colour signature to compare" if near.colour_distance is None \
                else f"{near.colour_distance} colour levels"
            raise RejectedUpload("near_duplicate", f"within {near.distance} bits ({colour}) of {near.sha256}")
        return flagged

    def _list_near(self, key: str, sample: Sample) -> None:
        self.report.near_duplicates_found += 1
        if len(self.report.near_duplicate_samples) < LISTED_NEAR_DUPLICATES:
            self.report.near_duplicate_samples.append(NearDuplicate(
                key=key, sha256=sample.sha256, of=sample.near_duplicate_of or "",
                distance=sample.near_duplicate_distance or 0, colour_distance=sample.near_duplicate_colour_distance))

    def _ours(self, sha256: str, key: str) -> Sample | None:
        """The record an earlier attempt at this very shard wrote (and packed here, if anywhere)."""
        item = aws.get_item(self.settings.ingest.table, pipeline_table.sample_pk(sha256))
        if not item or not item.get("record"):
            return None
        first = Sample.model_validate_json(item["record"])
        return first if first.key == key and item.get("packed_in") in (None, self.shard_id) else None

    def _quarantine(self, upload: UploadRef, rejected: RejectedUpload, sha256: str | None) -> None:
        duplicate_of = sha256 if rejected.reason in DUPLICATE_REASONS else None
        aws.put_item(self.settings.ingest.table, pipeline_table.upload_item(
            upload, "quarantined", self.message.partner, sha256=sha256, reason=rejected.reason,
            detail=rejected.detail, duplicate_of=duplicate_of) | {"import_batch": self.message.batch_id})
        self.report.quarantined[rejected.reason] = self.report.quarantined.get(rejected.reason, 0) + 1

    def _flush(self) -> None:
        if self.chunk:
            self.written.append(segments.write_segment_of(self.chunk, self.settings.pack.data_bucket,
                                                          self.settings.pack.part_bytes))
            self.chunk, self.chunk_bytes = [], 0


# --- commit, seal, count --------------------------------------------------------------------------

def _commit(message: ImportShard, report: ShardReport, written: list[segments.Written],
            settings: ImportSettings) -> dict[str, Any]:
    """The import record and the seal record, both or neither; the winner's record if another
    delivery committed first (its segments are then garbage for the lifecycle rule)."""
    table = settings.ingest.table
    item = {"pk": record_pk(message), "kind": "import-shard", "status": "committed", "report": report.model_dump_json(),
            "gsi1pk": pipeline_table.import_batch_pk(message.batch_id), "gsi1sk": message.uri}
    puts = [item]
    if written:
        shard = OpenShard(shard_id=report.shard_id or "", opened_at=now())
        for part in written:
            shard = shard.appended(part.segment, part.partners, part.aspects)
        puts.append({"pk": pipeline_table.pack_shard_pk(shard.shard_id), "kind": "pack-shard", "status": "sealing",
                     "state": SealState(shard=shard, status="sealing").model_dump_json(), "requested_at": now(),
                     "import_batch": message.batch_id})
    if aws.transact_updates(table, [], puts):
        return item
    winner = aws.get_item(table, record_pk(message))
    if winner is None:  # the seal record exists without ours: a shard id taken by something else
        raise RuntimeError(f"{pipeline_table.pack_shard_pk(report.shard_id or '')} exists without {record_pk(message)}")
    return winner


def _seal(shard_id: str, settings: ImportSettings) -> None:
    """Mark the shard's samples (before its segments are cleaned up), then the packer's seal steps."""
    state = journal.load_seal(settings.ingest.table, shard_id)
    if state is not None and state.status != "done":
        keys = [e.key for s in state.shard.segments for e in segments.read_index(settings.pack.data_bucket, s)]
        _mark(keys, shard_id, settings.ingest.table)
    seal.finish(shard_id, settings.pack)


def _mark(keys: list[str], shard_id: str, table: str) -> None:
    """`packed_in` on each sample's record, as the packer marks it (100 conditional updates a transaction)."""
    updates = [(pipeline_table.sample_pk(k), "SET packed_in = :s", "attribute_not_exists(packed_in) OR packed_in = :s",
                {":s": shard_id}) for k in keys]
    for start in range(0, len(updates), TRANSACTION_ITEMS):
        if not aws.transact_updates(table, updates[start:start + TRANSACTION_ITEMS], []):
            raise RuntimeError(f"a sample of {shard_id} is packed in another shard")


def _count(message: ImportShard, report: ShardReport, settings: ImportSettings) -> None:
    """Add the shard to its batch's totals exactly once: in the transaction that marks it done."""
    counters = {"shards_done": int(report.status != "rejected"), "shards_rejected": int(report.status == "rejected"),
                "samples_read": report.samples_read, "samples_accepted": report.accepted,
                "samples_duplicate": report.duplicates, "samples_near_duplicate": report.near_duplicates_found,
                "samples_rejected": report.rejected,
                "captions_missing": report.captions_missing, "size_mismatches": report.size_mismatches,
                **{f"reason_{reason}": n for reason, n in report.quarantined.items()}}
    if report.reason:
        counters[f"shard_reason_{report.reason}"] = 1
    names = {f"#c{i}": name for i, name in enumerate(counters)} | {"#s": "status"}
    values = {f":c{i}": n for i, n in enumerate(counters.values())}
    add = "ADD " + ", ".join(f"#c{i} :c{i}" for i in range(len(counters)))
    aws.transact_updates(settings.ingest.table, [
        (record_pk(message), "SET #s = :done", "#s = :committed", {":done": "done", ":committed": "committed"}),
        (pipeline_table.import_batch_pk(message.batch_id), add, "attribute_exists(pk) OR attribute_not_exists(pk)",
         values),
    ], [], names=names)
