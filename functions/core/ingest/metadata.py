"""Describe an upload: decode it, apply the acceptance policy and build its metadata record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from contracts import s3_layout
from contracts.aspect_buckets import aspect_bucket
from contracts.messages import Sample, Sidecar, UploadRef
from core.errors import RejectedUpload
from core.ingest import images
from core.ingest.settings import IngestSettings



@dataclass(frozen=True)
class Described:
    sample: Sample
    derivative: bytes | None  # the re-encoded bytes to store, when the upload's cannot be kept


def caption_of(sidecar: Sidecar, embedded: dict[str, str]) -> tuple[str, str]:
    """(caption, where it came from): the sidecar first, then IPTC, XMP, EXIF; else missing."""
    if sidecar.caption.strip():
        return sidecar.caption.strip(), "sidecar"
    for source in ("iptc", "xmp", "exif"):
        if embedded.get(source):
            return embedded[source], source
    return "", "missing"


def check_geometry(width: int, height: int, settings: IngestSettings) -> None:
    if min(width, height) < settings.min_short_side:
        raise RejectedUpload("too_small", f"{width}x{height}: short side under {settings.min_short_side}")
    if max(width, height) / min(width, height) > settings.max_aspect_ratio:
        raise RejectedUpload("bad_aspect", f"{width}x{height}: aspect ratio over {settings.max_aspect_ratio}")


def describe(data: bytes, upload: UploadRef, partner: str, sidecar: Sidecar, license_id: str,
             settings: IngestSettings) -> Described:
    """Decode `data` fully and return its record (and derivative), or raise RejectedUpload."""
    decoded = images.decode(data, settings.decode)
    check_geometry(decoded.width, decoded.height, settings)
    sha256 = hashlib.sha256(data).hexdigest()
    caption, caption_source = caption_of(sidecar, decoded.text)
    if len(caption) > settings.max_caption_chars:
        raise RejectedUpload("caption_too_long", f"{caption_source} caption of {len(caption)} characters "
                                                 f"> {settings.max_caption_chars}")
    derivative: bytes | None = None
    content_width, content_height = decoded.width, decoded.height
    if decoded.reencode:
        derivative, (content_width, content_height) = images.encode_jpeg(
            decoded.rgb, settings.decode.max_side, settings.jpeg_quality)
    # a kept upload is its own content: its bytes are not hashed a second time
    content_sha256 = hashlib.sha256(derivative).hexdigest() if derivative is not None else sha256
    sample = Sample(
        sha256=sha256, partner=partner, bucket=upload.bucket, key=upload.key, version_id=upload.version_id,
        format="jpeg" if derivative is not None else decoded.format,  # type: ignore[arg-type]
        width=decoded.width, height=decoded.height, size=len(data),
        caption=caption, caption_source=caption_source, license=license_id, source=sidecar.source.strip(),
        uploaded_at=upload.event_time, original_format=decoded.format, original_mode=decoded.mode,
        megapixels=round(decoded.width * decoded.height / 1e6, 3),
        aspect_bucket=aspect_bucket(decoded.width, decoded.height), phash=images.dhash(decoded.rgb),
        colour=images.colour_signature(decoded.rgb),
        content_bucket=settings.data_bucket if derivative is not None else upload.bucket,
        content_key=s3_layout.derived_key(sha256) if derivative is not None else upload.key,
        content_sha256=content_sha256,
        content_width=content_width, content_height=content_height, reencoded=decoded.reencode,
    )
    return Described(sample, derivative)
