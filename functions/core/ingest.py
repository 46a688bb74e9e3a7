"""Ingest stage: one uploaded object -> a metadata record and a pack message, or a rejection."""

from __future__ import annotations

from dataclasses import dataclass

from aws_lambda_powertools import Logger

from core import aws, metadata, records, uploads
from core.errors import RejectedUpload
from core.models import Sample, Sidecar, UploadRef
from core.settings import IngestSettings

logger = Logger(child=True)


@dataclass(frozen=True)
class Outcome:
    key: str
    status: records.UploadStatus | str
    sha256: str | None = None
    reason: str | None = None


def ingest_notification(body: str, settings: IngestSettings) -> list[Outcome]:
    """Handle one S3 notification message (usually one object; none for a test event)."""
    return [ingest_upload(ref, settings) for ref in uploads.parse_notification(body)]


def ingest_upload(upload: UploadRef, settings: IngestSettings) -> Outcome:
    if uploads.is_sidecar(upload.key):
        return Outcome(upload.key, "sidecar")  # read when its image arrives
    try:
        partner = uploads.partner_of(upload.key)
        sample = _describe(upload, partner, settings)
    except RejectedUpload as rejected:
        return _reject(upload, rejected, settings)
    return _accept(upload, sample, settings)


def _describe(upload: UploadRef, partner: str, settings: IngestSettings) -> Sample:
    head = aws.head_object(upload.bucket, upload.key)
    if head is None:
        raise RejectedUpload("gone", "the object was deleted before ingest")
    if head["ContentLength"] > settings.max_upload_bytes:
        raise RejectedUpload("too-large", f"{head['ContentLength']} bytes > {settings.max_upload_bytes}")
    data = aws.read_object(upload.bucket, upload.key, max_bytes=settings.max_upload_bytes)
    sidecar = Sidecar.model_validate(aws.read_json_if_exists(upload.bucket, uploads.sidecar_key(upload.key)) or {})
    at = upload.event_time or head["LastModified"].isoformat()
    return metadata.describe(data, upload.model_copy(update={"event_time": at}), partner, sidecar,
                             settings.max_image_pixels)


def _reject(upload: UploadRef, rejected: RejectedUpload, settings: IngestSettings) -> Outcome:
    logger.info("upload rejected", extra={"key": upload.key, "reason": rejected.reason})
    partner = upload.key.split("/", 1)[0]
    aws.put_item(settings.table, records.upload_item(
        upload.bucket, upload.key, "rejected", partner, upload.event_time,
        reason=rejected.reason, detail=rejected.detail))
    return Outcome(upload.key, "rejected", reason=rejected.reason)


def _accept(upload: UploadRef, sample: Sample, settings: IngestSettings) -> Outcome:
    """Record first, then hand over: a crash in between is healed by the redelivered message."""
    existing = None
    if not aws.put_item_if_absent(settings.table, records.sample_item(sample)):
        existing = aws.get_item(settings.table, records.sample_pk(sample.sha256)) or {}
    record = _record(existing) if existing else sample
    # The same bytes under another key are a duplicate; the same key again is a redelivery.
    status: records.UploadStatus = "accepted" if record.key == upload.key else "duplicate"
    aws.put_item(settings.table, records.upload_item(
        upload.bucket, upload.key, status, sample.partner, sample.uploaded_at, sha256=sample.sha256))
    if status == "accepted" and not (existing or {}).get("packed_in"):
        aws.send_message(settings.pack_queue_url, record.model_dump_json())
    logger.info("upload ingested", extra={"key": upload.key, "sha256": sample.sha256, "status": status})
    return Outcome(upload.key, status, sha256=sample.sha256)


def _record(item: dict) -> Sample:
    return Sample.model_validate_json(item["record"])
