"""Ingest stage: one uploaded object -> a licensed, described sample handed to packing, or a
quarantined upload with a reason. Never silent: every upload, sidecars included (core.ingest.sidecars),
ends with an UPLOAD# record.

Order of side effects (each repeatable): derivative object -> sample record (create-only: the
exact-duplicate check) -> near-duplicate index -> pack message -> upload record. The upload
record comes last, so a redelivered notification whose upload record exists is a no-op, and one
that arrives after a crash redoes only what is missing (pack drops a sample sent twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from aws_lambda_powertools import Logger
from botocore.exceptions import ClientError

from contracts import pipeline_table
from contracts.messages import Sample, Sidecar, UploadRef
from core import aws, telemetry
from core.errors import RejectedUpload
from core.ingest import dedup, metadata, sidecars, uploads
from core.pack import lanes
from core.partners import licensing
from core.ingest.settings import IngestSettings

logger = Logger(child=True)
QUARANTINE_TAG = "atelier-quarantine"


@dataclass(frozen=True)
class Outcome:
    key: str
    status: str  # accepted | quarantined | sidecar (its fate in `reason`) | repeat
    sha256: str | None = None
    reason: str | None = None
    near_duplicate_of: str | None = None


def ingest_notification(body: str, settings: IngestSettings) -> list[Outcome]:
    """Handle one S3 notification message (usually one object; none for a test event)."""
    return [ingest_upload(ref, settings) for ref in uploads.parse_notification(body)]


def ingest_upload(upload: UploadRef, settings: IngestSettings) -> Outcome:
    """One upload, its log lines correlated by its key (pack's lines for its sample carry it too)."""
    with telemetry.correlated(upload.key):
        outcome = _ingest(upload, settings)
    _record(outcome)
    return outcome


def _record(outcome: Outcome) -> None:
    """The outcome's metrics; a redelivery ("repeat") and a sidecar count nothing."""
    if outcome.status == "accepted":
        telemetry.count(telemetry.UPLOADS_ACCEPTED)
        if outcome.near_duplicate_of:
            telemetry.count(telemetry.UPLOADS_NEAR_DUPLICATE)
    elif outcome.status == "quarantined":
        telemetry.count_by(telemetry.UPLOADS_REJECTED, telemetry.REASON, outcome.reason or "unknown")
        if outcome.reason == "duplicate":
            telemetry.count(telemetry.UPLOADS_DUPLICATE)


def _ingest(upload: UploadRef, settings: IngestSettings) -> Outcome:
    done = _already_handled(upload, settings)
    if done is not None:
        return done
    partner = upload.key.split("/", 1)[0]
    sidecar_etag = ""
    try:
        uploads.partner_of(upload.key)
        upload = _with_object_facts(upload, settings)
        if uploads.is_sidecar(upload.key):
            return _record_sidecar(upload, partner, sidecars.judge(upload, settings, datetime.now(timezone.utc)),
                                   settings)
        sidecar, sidecar_etag = _sidecar(upload, settings)
        license_id = licensing.license_for(licensing.get_partner(settings.table, partner), partner,
                                           upload.key, sidecar.license)
        data = _read_upload(upload, settings)
        described = metadata.describe(data, upload, partner, sidecar, license_id, settings)
    except RejectedUpload as rejected:
        return quarantine(rejected.upload or upload, partner, rejected, settings, sidecar_etag=sidecar_etag)
    return _accept(upload, described, settings, sidecar_etag)


def _read_upload(upload: UploadRef, settings: IngestSettings) -> bytes:
    """The version the record names: an overwrite or a delete after the HEAD changes nothing read
    here. A version that no longer exists (deleted for good since its notification) is gone."""
    try:
        return aws.read_object(upload.bucket, upload.key, max_bytes=settings.max_upload_bytes, version_id=upload.version_id)
    except ClientError as error:
        if aws.error_code(error) in {"NoSuchVersion", "NoSuchKey"}:
            raise RejectedUpload("gone", f"version {upload.version_id or '(latest)'} was deleted before ingest read it",
                                 upload) from error
        raise


def _sidecar(upload: UploadRef, settings: IngestSettings) -> tuple[Sidecar, str]:
    """The sidecar (read only up to its size limit, bounded in depth) and its ETag ("" if none): the
    image's record keeps the ETag, so the sidecar's own notification knows it was read (core.ingest.sidecars)."""
    found = aws.read_prefix_with_etag(upload.bucket, uploads.sidecar_key(upload.key), settings.max_sidecar_bytes + 1)
    return sidecars.parse(found[0] if found else None, settings), found[1] if found else ""


def _record_sidecar(upload: UploadRef, partner: str, fate: sidecars.Fate, settings: IngestSettings) -> Outcome:
    aws.put_item(settings.table, pipeline_table.upload_item(upload, "sidecar", partner, reason=fate.reason,
                                                     detail=fate.detail, image=fate.image))
    logger.info("sidecar recorded", extra={"key": upload.key, "reason": fate.reason, "image": fate.image})
    return Outcome(upload.key, "sidecar", reason=fate.reason)


def _already_handled(upload: UploadRef, settings: IngestSettings) -> Outcome | None:
    """The outcome recorded for this very object version, if a delivery already finished it (a
    sidecar waiting for its image is judged again: the sweep re-drives it for that)."""
    item = aws.get_item(settings.table, pipeline_table.upload_pk(upload.bucket, upload.key))
    if not item or not upload.etag or item.get("etag") != upload.etag:
        return None
    if item.get("status") == "sidecar" and item.get("reason") == pipeline_table.SIDECAR_WAITING:
        return None
    if upload.version_id and item.get("version_id") != upload.version_id:
        return None  # the same bytes uploaded again as a new version: a new upload
    return Outcome(upload.key, "repeat", item.get("sha256"), item.get("reason"))


def _with_object_facts(upload: UploadRef, settings: IngestSettings) -> UploadRef:
    """The object's time, ETag, version and size from S3 where the event lacks them, then the size
    checks (before any byte is read). A refusal carries these facts like any other record."""
    head = aws.head_object(upload.bucket, upload.key)
    if head is None:
        version = upload.version_id or aws.version_with_etag(upload.bucket, upload.key, upload.etag)
        raise RejectedUpload("gone", "the object was deleted before ingest",
                             upload.model_copy(update={"version_id": version}))
    upload = upload.model_copy(update={
        "event_time": upload.event_time or head["LastModified"].isoformat(),
        "etag": upload.etag or str(head.get("ETag", "")).strip('"'),
        "version_id": upload.version_id or head.get("VersionId") or "",
        "size": head["ContentLength"],
    })
    if head["ContentLength"] == 0:
        raise RejectedUpload("empty", "the object has no bytes", upload)
    if head["ContentLength"] > settings.max_upload_bytes:
        raise RejectedUpload("too_large", f"{head['ContentLength']} bytes > {settings.max_upload_bytes}", upload)
    return upload


def quarantine(upload: UploadRef, partner: str, rejected: RejectedUpload, settings: IngestSettings,
               sha256: str | None = None, duplicate_of: str | None = None, duplicate_of_key: str | None = None,
               sidecar_etag: str = "") -> Outcome:
    """Record why, and tag the object so the quarantine is visible in S3 itself."""
    if rejected.reason != "gone":
        aws.tag_object(upload.bucket, upload.key, {QUARANTINE_TAG: rejected.reason})
    aws.put_item(settings.table, pipeline_table.upload_item(
        upload, "quarantined", partner, sha256=sha256, reason=rejected.reason, detail=rejected.detail,
        duplicate_of=duplicate_of, duplicate_of_key=duplicate_of_key, sidecar_etag=sidecar_etag))
    logger.info("upload quarantined", extra={"key": upload.key, "reason": rejected.reason, "detail": rejected.detail})
    return Outcome(upload.key, "quarantined", sha256, rejected.reason)


def _accept(upload: UploadRef, described: metadata.Described, settings: IngestSettings, sidecar_etag: str) -> Outcome:
    sample = described.sample
    if described.derivative is not None:
        bucket, key = sample.content_location
        aws.write_object(bucket, key, described.derivative, "image/jpeg")
    index = dedup.index_items(settings.table, sample.phash) if sample.phash else None  # read once, for both uses
    near = dedup.nearest(settings.table, sample.phash, sample.colour, settings.near_duplicate_distance,
                         settings.near_duplicate_colour_distance, exclude=sample.sha256, items=index) \
        if index is not None else None
    if near:
        sample = dedup.flagged(sample, near)
    existing = None
    lane = lanes.lane_of(sample.sha256, settings.pack_lanes)  # kept with the record: redeliveries use it
    if not aws.put_item_if_absent(settings.table, pipeline_table.sample_item(sample, pack_lane=lane)):
        existing = aws.get_item(settings.table, pipeline_table.sample_pk(sample.sha256)) or {}
        first = Sample.model_validate_json(existing["record"]) if existing.get("record") else sample
        if first.key != upload.key:  # the same bytes under another name: recorded once, packed once
            # A partner reads its records: another partner's key stays in the operators' field.
            where = first.key if first.partner == sample.partner else "a sample already in the dataset"
            return quarantine(upload, sample.partner, RejectedUpload("duplicate", f"same bytes as {where}"),
                              settings, sha256=sample.sha256, duplicate_of=sample.sha256, duplicate_of_key=first.key,
                              sidecar_etag=sidecar_etag)
        sample = first  # a redelivery of the first upload: hand over the record it already has
    dedup.remember(settings.table, sample.sha256, sample.phash, sample.colour, items=index)
    if not (existing or {}).get("packed_in"):
        aws.send_message(settings.pack_queue_url, sample.model_dump_json())
    aws.put_item(settings.table, pipeline_table.upload_item(upload, "accepted", sample.partner, sha256=sample.sha256,
                                                     sidecar_etag=sidecar_etag))
    logger.info("upload accepted", extra={"key": upload.key, "sha256": sample.sha256,
                                          "near_duplicate_of": sample.near_duplicate_of})
    return Outcome(upload.key, "accepted", sample.sha256, near_duplicate_of=sample.near_duplicate_of)
