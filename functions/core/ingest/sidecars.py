"""What becomes of a `.json` upload, so that no object is silent (docs/metadata.md, "Sidecars").

A sidecar `<image path without extension>.json` is read by its image's ingest when it is there
first. Otherwise its own notification decides:
- image bytes under the `.json` name: quarantined (`image_named_json`). The name is a sidecar's,
  so such an image could never have one, and image bytes where a sidecar belongs usually mean a
  client wrote the wrong file there: accepting them would hide that the image beside it lost its
  caption;
- no image yet: `waiting`; the sweep re-drives it once `SIDECAR_ORPHAN_GRACE_S` have passed,
  and if its image is still missing it is quarantined (`orphan_sidecar`);
- its image's ingest read this very sidecar (the image records the sidecar's ETag): `read`;
- its image was accepted and its sample is not packed yet: the sample record's caption and source
  are set from it (`caption_updated`; packing takes the record, not the message);
- its image was quarantined, or its sample packed (a shard's members never change): quarantined
  (`sidecar_too_late`) with what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pydantic import ValidationError

from contracts import pipeline_table
from contracts.messages import EXTENSIONS, Sample, Sidecar, UploadRef
from core import aws
from core.errors import RejectedUpload
from core.ingest import images, uploads
from core.ingest.settings import IngestSettings


@dataclass(frozen=True)
class Fate:
    """A sidecar's record when it is not quarantined."""

    reason: str  # waiting | read | caption_updated
    detail: str
    image: str | None = None


def parse(raw: bytes | None, settings: IngestSettings) -> Sidecar:
    """A sidecar read up to its size limit, bounded in depth; `bad_sidecar` otherwise."""
    try:
        return Sidecar.model_validate(uploads.parse_sidecar(raw, settings.max_sidecar_bytes, settings.max_sidecar_depth))
    except ValidationError as exc:
        raise RejectedUpload("bad_sidecar", f"caption, license and source must be strings: {exc.errors()[0]['loc']}") from exc


def judge(upload: UploadRef, settings: IngestSettings, now: datetime) -> Fate:
    """This sidecar's fate, or RejectedUpload for one that is quarantined."""
    raw = aws.read_prefix_if_exists(upload.bucket, upload.key, settings.max_sidecar_bytes + 1)
    if raw is None:
        raise RejectedUpload("gone", "the object was deleted before ingest")
    stem = upload.key[:-len(uploads.SIDECAR_SUFFIX)]
    found = images.sniff_format(raw)
    if found:
        raise RejectedUpload("image_named_json", f"{found} image bytes under a .json key, which names a sidecar: "
                                                 f"upload the image as {stem}.{EXTENSIONS.get(found, found)}")
    sidecar = parse(raw, settings)
    image = image_of(upload.bucket, upload.key)
    if image is None:
        age = (now - datetime.fromisoformat(upload.event_time)).total_seconds() if upload.event_time else 0.0
        if age >= settings.sidecar_orphan_grace_s:
            raise RejectedUpload("orphan_sidecar", f"no image for it {settings.sidecar_orphan_grace_s} s after it was "
                                                   f"written: upload the image as {stem}.jpg (or .png, .webp), "
                                                   "then this sidecar again")
        return Fate(pipeline_table.SIDECAR_WAITING, f"no image at {stem}.* yet: read when it arrives (orphan_sidecar after "
                             f"{settings.sidecar_orphan_grace_s} s)")
    record = aws.get_item(settings.table, pipeline_table.upload_pk(upload.bucket, image))
    if record is None:
        return Fate(pipeline_table.SIDECAR_WAITING, f"read when {image} is ingested", image)
    if upload.etag and record.get("sidecar_etag") == upload.etag:
        return Fate("read", f"read with {image}", image)
    if record.get("status") != "accepted":
        raise RejectedUpload("sidecar_too_late", f"{image} was quarantined ({record.get('reason')}) before this "
                                                 f"sidecar arrived: upload {image} again to have it ingested with it")
    return _update_caption(str(record["sha256"]), sidecar, image, settings)


def _update_caption(sha256: str, sidecar: Sidecar, image: str, settings: IngestSettings) -> Fate:
    """Caption and source from a late sidecar, on a sample not yet packed (a conditional write, so
    a packer that marked it first wins and the sidecar is too late)."""
    item = aws.get_item(settings.table, pipeline_table.sample_pk(sha256)) or {}
    sample = Sample.model_validate_json(item["record"])
    too_late = RejectedUpload("sidecar_too_late", f"{image} was packed with its {sample.caption_source} caption "
                                                  "before this sidecar arrived, and a packed sample never changes: "
                                                  "upload a sidecar before its image")
    if item.get("packed_in"):
        raise too_late
    if sidecar.license.strip() and sidecar.license.strip() != sample.license:
        raise RejectedUpload("sidecar_too_late", f"{image} was accepted under {sample.license} before this sidecar "
                                                 f"(license {sidecar.license.strip()!r}) arrived: a license is chosen "
                                                 "once; ask the operator to take the sample down if it is wrong")
    caption = sidecar.caption.strip() or sample.caption
    if len(caption) > settings.max_caption_chars:
        raise RejectedUpload("caption_too_long", f"sidecar caption of {len(caption)} characters > "
                                                 f"{settings.max_caption_chars}")
    updated = sample.model_copy(update={
        "caption": caption, "caption_source": "sidecar" if sidecar.caption.strip() else sample.caption_source,
        "source": sidecar.source.strip() or sample.source})
    if not aws.update_item(settings.table, pipeline_table.sample_pk(sha256), "SET #record = :record",
                           {":record": updated.model_dump_json()}, condition="attribute_not_exists(packed_in)",
                           names={"#record": "record"}):
        raise too_late
    return Fate("caption_updated", f"the caption of {image} was set from this sidecar before it was packed", image)


def image_of(bucket: str, sidecar_key: str) -> str | None:
    """The upload this sidecar describes (the first by key when several share its stem), if any."""
    stem = sidecar_key[:-len(uploads.SIDECAR_SUFFIX)]
    return next((o["Key"] for o in aws.list_objects(bucket, prefix=stem)
                 if not uploads.is_sidecar(o["Key"]) and uploads.sidecar_key(o["Key"]) == sidecar_key), None)
