"""Typed messages and records that cross a stage boundary (see docs/architecture.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
SHA256_PATTERN = r"^[0-9a-f]{64}$"
ImageFormat = Literal["jpeg", "png", "webp"]
EXTENSIONS: dict[str, str] = {"jpeg": "jpg", "png": "png", "webp": "webp"}


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UploadRef(Frozen):
    """One uploaded object, as named by an S3 notification (key already URL-decoded)."""

    bucket: str
    key: str
    size: int = 0
    event_time: str = ""


class Sidecar(BaseModel):
    """The optional `<name>.json` a partner uploads next to an image."""

    model_config = ConfigDict(extra="ignore")
    caption: str = ""
    license: str = ""
    source: str = ""


class Sample(Frozen):
    """The metadata record of one accepted image; the ingest -> pack message body."""

    schema_version: int = SCHEMA_VERSION
    sha256: str = Field(pattern=SHA256_PATTERN)
    partner: str
    bucket: str
    key: str
    format: ImageFormat
    width: int = Field(gt=0)
    height: int = Field(gt=0)
    size: int = Field(gt=0)
    caption: str
    license: str
    source: str = ""
    uploaded_at: str

    @property
    def extension(self) -> str:
        return EXTENSIONS[self.format]


class ShardSealed(Frozen):
    """Detail of the `Shard Sealed` event the pack stage puts on EventBridge."""

    shard_id: str
    bucket: str
    key: str
    sha256: str = Field(pattern=SHA256_PATTERN)
    size: int
    samples: int
    partners: list[str]
    sealed_at: str


class ShardRef(Frozen):
    """One shard as a manifest lists it."""

    shard_id: str
    key: str
    sha256: str
    samples: int


class Manifest(Frozen):
    """Exactly the shards one training job reads; its hash names the job."""

    bucket: str
    prefix: str
    shards: tuple[ShardRef, ...]

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)
