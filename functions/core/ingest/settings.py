"""IngestFunction's settings: the acceptance policy every upload is judged by (ImportFunction applies it too)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from core.ingest.images import KNOWN_FORMATS, DecodePolicy
from core.pack.lanes import MAX_LANES
from core.settings import StageSettings, given, settings, names

# What an upload must be to become a sample, and how it is stored: tuning knobs (core/settings.py), each default the
# template parameter's it replaced. How transparent pixels, the image's size and the sidecar are read:
MAX_IMAGE_PIXELS = 178_956_970  # Pillow's own decompression-bomb limit, stated outright
ALPHA_BACKGROUND = (255, 255, 255)  # R,G,B that transparent pixels are composited over
# Four 16-bit bands find every hash within 3 bits (pigeonhole); beyond that some are missed.
MAX_NEAR_DISTANCE = 3
# A sidecar still waiting for its image this long after it was written is an orphan (core.ingest.sidecars); the
# sweep re-drives it then, so ingest records it as one (core/sweep/settings.py)
ORPHAN_GRACE_S = 3600


@settings
class IngestSettings(StageSettings):
    table: str = Field(validation_alias="PIPELINE_TABLE")
    pack_queue_url: str = Field(validation_alias="PACK_QUEUE_URL")
    data_bucket: str = Field(validation_alias="DATA_BUCKET")  # where re-encoded derivatives are stored
    # larger uploads are quarantined (too_large) without reading a byte
    max_upload_bytes: int = Field(200 << 20, ge=1, validation_alias="MAX_UPLOAD_BYTES")
    decode: DecodePolicy  # from ALLOWED_FORMATS, MAX_IMAGE_PIXELS, ALPHA_BACKGROUND, STORE_MAX_SIDE, REENCODE
    # uploads whose shorter side (after EXIF rotation) is smaller are quarantined (too_small)
    min_short_side: int = Field(256, ge=1, validation_alias="MIN_SHORT_SIDE")
    max_aspect_ratio: float = Field(4.0, ge=1.0, validation_alias="MAX_ASPECT_RATIO")  # long / short side (bad_aspect)
    jpeg_quality: int = Field(95, ge=50, le=100, validation_alias="STORE_JPEG_QUALITY")  # of re-encoded samples
    # perceptual-hash distance (bits) under which a sample is flagged as a near duplicate
    near_duplicate_distance: int = Field(MAX_NEAR_DISTANCE, ge=0, le=MAX_NEAR_DISTANCE,
                                         validation_alias="NEAR_DUPLICATE_DISTANCE")
    # Near duplicates' colour signatures (mean chroma of a 4x4 grid) differ by at most this many levels
    # (core.ingest.dedup); 255 compares luminance alone
    near_duplicate_colour_distance: int = Field(16, ge=0, le=255, validation_alias="NEAR_DUPLICATE_COLOUR_DISTANCE")
    # a caption (sidecar or embedded) longer than this is refused (caption_too_long)
    max_caption_chars: int = Field(2000, ge=1, le=100_000, validation_alias="MAX_CAPTION_CHARS")
    # A sidecar whose image is still missing this long after it was written is an orphan (core.ingest.sidecars).
    sidecar_orphan_grace_s: int = Field(ORPHAN_GRACE_S, ge=0, validation_alias="SIDECAR_ORPHAN_GRACE_S")
    pack_lanes: int = Field(ge=1, le=MAX_LANES, validation_alias="PACK_LANES")  # an accepted record's lane
    # Input limits besides bytes, pixels and caption (docs/reliability.md): tuning knobs
    max_sidecar_bytes: int = Field(65536, ge=2, le=1 << 20, validation_alias="MAX_SIDECAR_BYTES")
    max_sidecar_depth: int = Field(4, ge=1, le=64, validation_alias="MAX_SIDECAR_DEPTH")

    @model_validator(mode="before")
    @classmethod
    def _decode_policy(cls, values: Any) -> Any:
        """The decode policy from its five variables, each checked and named."""
        values = given(values)
        if not isinstance(values, dict) or "decode" in values:
            return values
        return {**values, "decode": DecodePolicyEnv.from_env(values).policy()}


@settings
class DecodePolicyEnv(StageSettings):
    """The variables of core.ingest.images.DecodePolicy."""

    # formats ingest decodes (sniffed, never the extension); others are quarantined
    allowed: frozenset[str] = Field(frozenset({"jpeg", "png", "webp", "tiff"}), validation_alias="ALLOWED_FORMATS")
    max_pixels: int = Field(MAX_IMAGE_PIXELS, ge=1, validation_alias="MAX_IMAGE_PIXELS")
    background: tuple[int, int, int] = Field(ALPHA_BACKGROUND, validation_alias="ALPHA_BACKGROUND")
    max_side: int = Field(2048, ge=16, validation_alias="STORE_MAX_SIDE")  # stored images are at most this long
    # auto keeps clean JPEG/PNG/WebP bytes and re-encodes the rest as JPEG; always re-encodes all
    reencode: Literal["auto", "always"] = Field("auto", validation_alias="REENCODE")

    known: ClassVar[frozenset[str]] = frozenset(KNOWN_FORMATS.values())

    @field_validator("allowed", mode="before")
    @classmethod
    def _formats(cls, raw: Any) -> frozenset[str]:
        formats = frozenset(f.lower() for f in names(raw)) if isinstance(raw, str) else frozenset(raw)
        if (unknown := formats - cls.known) or not formats:
            raise ValueError(f"ALLOWED_FORMATS={raw!r}: unknown {sorted(unknown)}; known {sorted(cls.known)}")
        return formats

    @field_validator("background", mode="before")
    @classmethod
    def _rgb(cls, raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw
        parts = raw.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) <= 255 for p in parts):
            raise ValueError(f"ALPHA_BACKGROUND={raw!r} is not 'R,G,B' with values 0..255")
        return tuple(int(p) for p in parts)

    def policy(self) -> DecodePolicy:
        return DecodePolicy(allowed=self.allowed, max_pixels=self.max_pixels, background=self.background,
                            max_side=self.max_side, reencode=self.reencode)
