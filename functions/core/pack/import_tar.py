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

import json
import re
import tarfile
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from decimal import Decimal
from typing import IO, Any, Iterator, Literal

from aws_lambda_powertools import Logger
from pydantic import BaseModel

from contracts import pipeline_table, shard_members
from contracts.messages import DEFAULT_NEAR_DUPLICATES, ImportShard, NearDuplicates, Sample, Sidecar, UploadRef
from core import aws, telemetry
from core.errors import RejectedUpload
from core.ingest import dedup, metadata
from core.pack import journal, seal, segments, shards
from core.pack.journal import OpenShard, SealState
from core.partners import licensing
from core.pack.import_settings import ImportSettings

logger = Logger(child=True)
DUPLICATE_REASONS = ("duplicate", "near_duplicate")
# img2dataset's per-sample fields its tools read back (its docs, "Output format"), kept verbatim
SOURCE_FIELDS = ("url", "key", "status", "original_width", "original_height", "exif")
SOURCE_FIELDS_MAX_BYTES = 16 << 10
# webdataset's rule: the key is the name up to the first dot of its last path component.
_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
TRANSACTION_ITEMS = 100
# Near duplicates a tar's report names (all are counted): the report is one DynamoDB item (400 KB),
# and 100 of about 250 bytes keep it far from that.
LISTED_NEAR_DUPLICATES = 100


def record_pk(message: ImportShard) -> str:
    """The message's import record's key, in the table's layout."""
    return pipeline_table.import_shard_pk(message.batch_id, message.uri)


class NearDuplicate(BaseModel):
    """A sample of the tar near an earlier one: flagged and accepted, or left out."""

    key: str  # the sample's key in the tar
    sha256: str
    of: str  # the earlier sample's sha256 (SAMPLE#<of>)
    distance: int  # dHash bits
    colour_distance: int | None = None  # None: the earlier one has no colour signature (indexed before them)


class ShardReport(BaseModel):
    """What became of one source tar."""

    source: str
    status: Literal["imported", "empty", "rejected"]  # empty: it parsed, but no sample was new and valid
    reason: str | None = None  # why the whole tar was rejected
    detail: str = ""
    shard_id: str | None = None  # the pipeline shard it became
    samples_read: int = 0
    accepted: int = 0
    quarantined: dict[str, int] = {}  # reason -> samples (duplicates and dropped near duplicates included)
    near_duplicates_found: int = 0  # flagged (accepted) or dropped (in `quarantined` too), by the message's mode
    near_duplicate_samples: list[NearDuplicate] = []  # the first LISTED_NEAR_DUPLICATES of them
    captions_missing: int = 0  # accepted, flagged: no caption in the tar nor in the image
    size_mismatches: int = 0  # accepted, flagged: the .json's width/height are not the decoded image's
    truncated: bool = False  # the tar broke off; the samples before the break were kept
    source_stats: dict[str, Any] = {}  # img2dataset's own <shard>_stats.json counts, when present

    @property
    def duplicates(self) -> int:
        """Exact duplicates, left out (near duplicates are `near_duplicates_found`)."""
        return self.quarantined.get("duplicate", 0)

    @property
    def rejected(self) -> int:
        return sum(n for reason, n in self.quarantined.items() if reason not in DUPLICATE_REASONS)


class NotATar(ValueError):
    """The object does not even start as a tar archive."""


# --- the records ----------------------------------------------------------------------------------

def import_shard_id(message: ImportShard) -> str:
    """Deterministic per (batch, source): a redelivery rebuilds the same shard, another batch a new one."""
    return shards.shard_id_for([f"import:{message.batch_id}:{message.uri}"])


def batch_item(batch_id: str, partner: str, license_id: str, source: str, shards_total: int,
               near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES) -> dict[str, Any]:
    return {"pk": pipeline_table.import_batch_pk(batch_id), "kind": "import", "batch_id": batch_id, "partner": partner,
            "license": license_id, "source": source, "shards_total": shards_total, "near_duplicates": near_duplicates,
            "created_at": _now()}


# --- reading a tar as samples ---------------------------------------------------------------------

@dataclass
class SourceSample:
    key: str
    members: dict[str, bytes] = field(default_factory=dict)  # extension -> bytes
    problem: RejectedUpload | None = None


def split_name(name: str) -> tuple[str, str] | None:
    match = _NAME.match(name)
    return (match.group(1), match.group(2).lower()) if match else None


def read_samples(stream: IO[bytes], max_member_bytes: int, damage: list[str],
                 ends_cleanly: bool = True) -> Iterator[SourceSample]:
    """Samples in tar order, read as a stream: consecutive members sharing a key. A member over
    `max_member_bytes` is skipped unread; a tar that breaks off ends the samples, the one it broke
    in is `truncated`, and `damage` says where. Python's stream reader takes a tar cut at a member
    boundary for a complete one: without its end-of-archive blocks (`ends_cleanly`), the last
    sample may lack members, so it is `truncated` too."""
    try:
        tar = tarfile.open(fileobj=stream, mode="r|")
    except tarfile.ReadError as exc:
        raise NotATar(str(exc)) from exc
    current: SourceSample | None = None
    try:
        for member in tar:
            named = split_name(member.name) if member.isfile() else None
            if named is None:
                continue  # folders, links, names without an extension: not sample members
            key, extension = named
            if current is None or key != current.key:
                if current is not None:
                    yield current
                current = SourceSample(key)
            if member.size > max_member_bytes:
                current.problem = RejectedUpload("too_large", f"{member.name}: {member.size} bytes > {max_member_bytes}")
                continue
            reader = tar.extractfile(member)
            assert reader is not None
            data = reader.read()
            if len(data) < member.size:
                raise EOFError(f"{member.name} has {len(data)} of its {member.size} bytes")
            current.members[extension] = data
    except (tarfile.ReadError, EOFError) as exc:
        damage.append(f"the tar breaks off in sample {current.key if current else '(none)'}: {exc}")
        if current is not None:
            current.problem = RejectedUpload("truncated", f"the tar breaks off in this sample: {exc}")
    else:
        if not ends_cleanly:
            damage.append("the tar has no end-of-archive blocks: it may have been cut after its last member")
            if current is not None:
                current.problem = RejectedUpload("truncated", "the last sample of a tar without its end blocks")
    if current is not None:
        yield current


# --- one shard ------------------------------------------------------------------------------------

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
                                           _ends_cleanly(self.message, size, version)):
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
        stats = aws.read_json_if_exists(self.message.bucket, _stats_key(self.message.key)) or {}
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
                         event_time=modified.isoformat() if modified else _now(),
                         etag=str(self.head.get("ETag", "")).strip('"'), version_id=self.head.get("VersionId") or "")

    def _take(self, source: SourceSample) -> None:
        self.report.samples_read += 1
        upload = self._upload(source.key)
        sha256 = None
        try:
            described, original_sha256, claimed_size = _describe(source, upload, self.message, self.settings)
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
        if not _same_size(claimed_size, sample):
            self.report.size_mismatches += 1
            logger.warning("the tar's width/height disagree with the image", extra={
                "sample": upload.key, "claimed": claimed_size, "decoded": [sample.width, sample.height]})
        content = described.derivative if described.derivative is not None else source.members[_image_extension(source)]
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


def _describe(source: SourceSample, upload: UploadRef, message: ImportShard,
              settings: ImportSettings) -> tuple[metadata.Described, str | None, tuple[int, int] | None]:
    """Ingest's decision for one sample, fed with what the tar already says (caption, URL, sha256);
    img2dataset's original sha256 and its width/height, for the checks against the decoded image."""
    if source.problem is not None:
        raise source.problem
    extension = _image_extension(source)
    if extension is None:
        raise RejectedUpload("no_image", f"members {sorted(source.members)} hold no image")
    meta = _json(source.members.get(shard_members.RECORD))
    caption = next((source.members[e].decode("utf-8", "replace") for e in shard_members.SOURCE_CAPTIONS
                    if e in source.members), None)
    if caption is None:
        caption = str(meta.get("caption") or "")
    sidecar = Sidecar(caption=caption, license=message.license, source=str(meta.get("url") or ""))
    described = metadata.describe(source.members[extension], upload, message.partner, sidecar, message.license,
                                  settings.ingest)
    if kept := source_fields(meta):
        described = replace(described, sample=described.sample.model_copy(update={"source_fields": kept}))
    original = str(meta.get("sha256") or "").lower()
    width, height = meta.get("width"), meta.get("height")
    claimed = (width, height) if type(width) is int and type(height) is int else None
    return described, original if _SHA256.match(original) and original != described.sample.sha256 else None, claimed


def source_fields(meta: dict[str, Any]) -> dict[str, str | int | float | bool | None]:
    """img2dataset's own fields of the sample's .json that its tools read, kept for the shard's .json;
    JSON scalars only, and none at all past SOURCE_FIELDS_MAX_BYTES (an EXIF block can be large, and
    the record lives in a DynamoDB item)."""
    kept = {name: meta[name] for name in SOURCE_FIELDS
            if name in meta and (meta[name] is None or isinstance(meta[name], (str, int, float, bool)))}
    if len(json.dumps(kept)) > SOURCE_FIELDS_MAX_BYTES:
        kept.pop("exif", None)
    return kept if len(json.dumps(kept)) <= SOURCE_FIELDS_MAX_BYTES else {}


def _same_size(claimed: tuple[int, int] | None, sample: Sample) -> bool:
    """No claim, or the decoded size either way round: img2dataset measures before EXIF orientation
    (OpenCV's IMREAD_UNCHANGED), the safe decode after it."""
    return claimed is None or claimed in {(sample.width, sample.height), (sample.height, sample.width)}


def _ends_cleanly(message: ImportShard, size: int, version: str) -> bool:
    """A whole tar is 512-byte blocks ending in two zero blocks (one ranged GET of its last 1 KiB)."""
    end = 2 * shards.BLOCK
    if size < end or size % shards.BLOCK:
        return False
    return aws.read_range(message.bucket, message.key, size - end, size, version) == bytes(end)


def _image_extension(source: SourceSample) -> str | None:
    return next((e for e in shard_members.SOURCE_IMAGES if e in source.members), None)


def _json(data: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(data) if data else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _stats_key(key: str) -> str:
    """img2dataset writes `<n>.tar` with `<n>_stats.json` and `<n>.parquet` beside it."""
    return key.removesuffix(".tar") + "_stats.json"


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
        shard = OpenShard(shard_id=report.shard_id or "", opened_at=_now())
        for part in written:
            shard = shard.appended(part.segment, part.partners, part.aspects)
        puts.append({"pk": pipeline_table.pack_shard_pk(shard.shard_id), "kind": "pack-shard", "status": "sealing",
                     "state": SealState(shard=shard, status="sealing").model_dump_json(), "requested_at": _now(),
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


# --- the batch, as the CLI reads it ---------------------------------------------------------------

class BatchReport(BaseModel):
    batch_id: str
    partner: str = ""
    license: str = ""
    source: str = ""
    created_at: str = ""
    near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES  # batches begun before the option: what they did
    shards_total: int = 0
    shards_done: int = 0
    shards_rejected: int = 0
    samples_read: int = 0
    samples_accepted: int = 0
    samples_duplicate: int = 0  # exact, left out
    samples_near_duplicate: int = 0  # flagged or left out, as `near_duplicates` says
    samples_rejected: int = 0
    captions_missing: int = 0
    size_mismatches: int = 0
    reasons: dict[str, int] = {}  # sample quarantine reason -> count
    shard_reasons: dict[str, int] = {}  # whole-tar rejection reason -> count
    shards: list[ShardReport] = []

    @property
    def finished(self) -> int:
        return self.shards_done + self.shards_rejected

    @property
    def rejections(self) -> dict[str, int]:
        """The reasons of `samples_rejected`: duplicates, exact or near, are counted apart."""
        return {reason: n for reason, n in self.reasons.items() if reason not in DUPLICATE_REASONS}

    @property
    def complete(self) -> bool:
        return self.shards_total > 0 and self.finished >= self.shards_total


def batch_report(table: str, batch_id: str, with_shards: bool = True) -> BatchReport | None:
    item = aws.get_item(table, pipeline_table.import_batch_pk(batch_id))
    if item is None:
        return None
    fields = {k: int(v) if isinstance(v, Decimal) else v for k, v in item.items() if k in BatchReport.model_fields}
    report = BatchReport(**fields,
                         reasons={k.removeprefix("reason_"): int(v) for k, v in item.items() if k.startswith("reason_")},
                         shard_reasons={k.removeprefix("shard_reason_"): int(v) for k, v in item.items()
                                        if k.startswith("shard_reason_")})
    if with_shards:
        report.shards = [ShardReport.model_validate_json(i["report"])
                         for i in aws.query_index(table, pipeline_table.PENDING_INDEX,
                                                  pipeline_table.import_batch_pk(batch_id))
                         if i.get("status") == "done"]
    return report


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
