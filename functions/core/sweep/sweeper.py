"""The reconciliation sweep: an upload whose S3 notification was lost is re-driven, not dropped.

S3 delivers notifications at least once but can (rarely) miss one, and a purged or misconfigured
queue loses them wholesale. Every run lists the uploads made between `lookback_s` and `grace_s`
ago, and for each that has no UPLOAD# record of its current version sends UploadsQueue the
message S3 would have sent. Ingest is idempotent on the object version, so a notification that
was only late, or a sweep that runs twice, still records the upload once.

A run is deferred while UploadsQueue holds more than `max_queue_depth` messages: ingest is behind,
its notifications are evidently arriving, and re-driving every upload the backlog has not reached
yet would multiply the backlog (the 10,000-upload load test grew its queue to 38,000 messages that
way). A lost notification is then re-driven by the first run after the backlog drains (the
lookback covers it): later, never dropped.

Sidecars are uploads too: one without a record is re-driven like an image, and one whose record
says it is still waiting for its image is re-driven once `sidecar_orphan_grace_s` has passed, so
ingest records what became of it (read with its image, or an orphan: core.ingest.sidecars).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote_plus

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from core import aws, telemetry
from core.sweep.settings import SweepSettings

logger = Logger(child=True)
EVENT_NAME = "ObjectCreated:Put"
SWEEP_MARKER = "atelier-sweep"  # in each re-driven record, so logs can tell them apart


@dataclass(frozen=True)
class SweepReport:
    listed: int
    redriven: tuple[str, ...]
    deferred_depth: int = 0  # the queue depth a deferred run found (0: the run was not deferred)


def sweep(settings: SweepSettings, now: datetime | None = None) -> SweepReport:
    depth = aws.queue_depth(settings.uploads_queue_url)
    if depth > settings.max_queue_depth:
        logger.info("sweep deferred: ingest is behind", extra={"queue_depth": depth, "max": settings.max_queue_depth})
        telemetry.count(telemetry.UPLOADS_REDRIVEN, 0)
        telemetry.count(telemetry.SWEEPS_DEFERRED)
        return SweepReport(0, (), depth)
    now = now or datetime.now(timezone.utc)
    oldest, newest = now - timedelta(seconds=settings.lookback_s), now - timedelta(seconds=settings.grace_s)
    orphaned = now - timedelta(seconds=settings.sidecar_orphan_grace_s)
    candidates = [o for o in aws.list_objects(settings.uploads_bucket) if oldest <= o["LastModified"] <= newest]
    found = aws.batch_get_items(settings.table, [pipeline_table.upload_pk(settings.uploads_bucket, o["Key"])
                                                 for o in candidates], ["pk", "etag", "status", "reason"])
    redriven = []
    for listed in candidates:
        record = found.get(pipeline_table.upload_pk(settings.uploads_bucket, listed["Key"]))
        waiting = bool(record) and record.get("status") == "sidecar" and record.get("reason") == pipeline_table.SIDECAR_WAITING \
            and listed["LastModified"] <= orphaned
        if record and record.get("etag") == _etag(listed) and not waiting:
            continue
        aws.send_message(settings.uploads_queue_url, notification(settings.uploads_bucket, listed))
        redriven.append(listed["Key"])
    if redriven:
        logger.warning("uploads re-driven: no record after the grace period",
                       extra={"count": len(redriven), "keys": redriven[:20]})
    telemetry.count(telemetry.UPLOADS_REDRIVEN, len(redriven))
    return SweepReport(len(candidates), tuple(redriven))


def _etag(listed: dict[str, Any]) -> str:
    return str(listed.get("ETag", "")).strip('"')


def notification(bucket: str, listed: dict[str, Any]) -> str:
    """The S3 event notification for one listed object (keys encoded as S3 encodes them)."""
    record = {
        "eventVersion": "2.1", "eventSource": "aws:s3", "eventName": EVENT_NAME,
        "eventTime": listed["LastModified"].isoformat(), SWEEP_MARKER: True,
        "s3": {"bucket": {"name": bucket, "arn": f"arn:aws:s3:::{bucket}"},
               "object": {"key": quote_plus(listed["Key"], safe="/"), "size": int(listed.get("Size", 0)),
                          "eTag": _etag(listed)}},
    }
    return json.dumps({"Records": [record]})
