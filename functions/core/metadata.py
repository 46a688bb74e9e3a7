"""Describe an uploaded image: decode it safely and build its metadata record."""

from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image, UnidentifiedImageError

from core.errors import RejectedUpload
from core.models import Sample, Sidecar, UploadRef

# Only formats the trainer can read from a shard unchanged; the extension is never trusted.
PILLOW_FORMATS: dict[str, str] = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp"}
# What Pillow reports -> our format. MPO is the multi-picture JPEG phones write; Pillow's JPEG
# plugin opens it as MPO.
REPORTED_FORMATS: dict[str, str] = {**PILLOW_FORMATS, "MPO": "jpeg"}


def describe(data: bytes, upload: UploadRef, partner: str, sidecar: Sidecar, max_pixels: int) -> Sample:
    """Decode `data` fully and return its record, or raise RejectedUpload with a reason."""
    width, height, fmt = decode(data, max_pixels)
    return Sample(
        sha256=hashlib.sha256(data).hexdigest(),
        partner=partner,
        bucket=upload.bucket,
        key=upload.key,
        format=fmt,
        width=width,
        height=height,
        size=len(data),
        caption=sidecar.caption.strip(),
        license=sidecar.license.strip(),
        source=sidecar.source.strip(),
        uploaded_at=upload.event_time,
    )


def decode(data: bytes, max_pixels: int) -> tuple[int, int, str]:
    """Sniff the format and decode every pixel: `verify()` alone misses truncated data."""
    Image.MAX_IMAGE_PIXELS = max_pixels  # the decompression-bomb guard stays on, at our limit
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(PILLOW_FORMATS)) as image:
                image.load()
                return image.width, image.height, REPORTED_FORMATS[image.format or ""]
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise RejectedUpload("too-many-pixels", str(exc)) from exc
    except UnidentifiedImageError as exc:
        raise RejectedUpload("unsupported-format", "not a JPEG, PNG or WebP image") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise RejectedUpload("undecodable", str(exc)) from exc
