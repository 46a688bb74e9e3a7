"""Typed messages and records that cross a stage boundary (see docs/architecture.md)."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 2
SHA256_PATTERN = r"^[0-9a-f]{64}$"
ImageFormat = Literal["jpeg", "png", "webp"]
EXTENSIONS: dict[str, str] = {"jpeg": "jpg", "png": "png", "webp": "webp"}
# What an import does with a sample near an earlier one (docs/import.md): accept it without looking,
# accept it marked `near_duplicate_of`, or leave it out (quarantined `near_duplicate`).
NearDuplicates = Literal["keep", "flag", "drop"]
DEFAULT_NEAR_DUPLICATES: NearDuplicates = "drop"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class UploadRef(Frozen):
    """One uploaded object, as named by an S3 notification (key already URL-decoded)."""

    bucket: str
    key: str
    size: int = 0
    event_time: str = ""
    etag: str = ""  # with version_id, what makes a redelivered notification recognisable
    version_id: str = ""


class Sidecar(BaseModel):
    """The optional `<name>.json` a partner uploads next to an image."""

    model_config = ConfigDict(extra="ignore")
    caption: str = ""
    license: str = ""
    source: str = ""


class Sample(Frozen):
    """The metadata record of one accepted image; the ingest -> pack message body.

    Schema 2 (docs/metadata.md). `bucket`/`key` name the upload; `content_bucket`/`content_key`
    the bytes a shard stores (the upload itself, or its re-encoded derivative), `content_sha256` their hash.
    """

    schema_version: int = SCHEMA_VERSION
    sha256: str = Field(pattern=SHA256_PATTERN)  # of the uploaded bytes
    partner: str
    bucket: str
    key: str
    version_id: str = ""
    format: ImageFormat  # of the stored content
    width: int = Field(gt=0)  # of the upload, after EXIF orientation
    height: int = Field(gt=0)
    size: int = Field(gt=0)  # bytes of the upload
    caption: str
    caption_source: Literal["sidecar", "iptc", "xmp", "exif", "missing"] = "sidecar"
    license: str
    source: str = ""
    uploaded_at: str
    original_format: str = ""
    original_mode: str = ""
    megapixels: float = 0.0
    aspect_bucket: str = Field(min_length=1)  # contracts.aspect_buckets, e.g. "16:9"
    phash: str = ""  # 64-bit difference hash, 16 hex digits
    colour: str = ""  # mean chroma of a 4 x 4 grid, 64 hex digits (images.colour_signature); "" before it existed
    near_duplicate_of: str | None = None
    near_duplicate_distance: int | None = None  # dHash bits
    near_duplicate_colour_distance: int | None = None  # colour levels; None: not compared (one had no signature)
    content_bucket: str = Field(min_length=1)
    content_key: str = Field(min_length=1)
    content_sha256: str = Field(pattern=SHA256_PATTERN)
    content_width: int = 0
    content_height: int = 0
    reencoded: str | None = None  # why the stored bytes are not the upload's
    # The source dataset's own fields, verbatim (img2dataset's url, key, original_width, ...:
    # core.import_shard.source_tar.SOURCE_FIELDS); the shard's .json carries them at its top level (core.pack.shards).
    # Left out of the JSON when empty: an upload's record (and the shard bytes made from it) is unchanged.
    source_fields: dict[str, str | int | float | bool | None] = Field(default={}, exclude_if=lambda fields: not fields)

    @property
    def extension(self) -> str:
        return EXTENSIONS[self.format]

    @property
    def content_location(self) -> tuple[str, str]:
        """Where the bytes to pack are."""
        return (self.content_bucket, self.content_key)


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
    # Since the streaming packer (docs/pack.md); defaults keep older events readable.
    uri: str = ""  # s3://bucket/key
    index_key: str = ""
    index_uri: str = ""  # the sidecar index: samples, offsets, sizes, member sha256s, counts
    digest_algorithm: str = "sha256"  # what `sha256` is: of the bytes, or "atelier-tree-v1"
    table_key: str = ""  # its sample table (contracts.shard_index), what jobs read at start; "" for shards sealed before


class ShardRef(Frozen):
    """One shard as a manifest lists it."""

    shard_id: str
    key: str
    sha256: str
    samples: int
    partners: tuple[str, ...] = ()
    role: Literal["new", "replay"] = "new"  # replay: trained before, mixed in so old skills stay
    weight: float = 1.0  # relative sampling weight of the shard's samples
    table_key: str = ""  # ShardSealed.table_key: the job's `indexes` channel lists it


class LeftOut(Frozen):
    """A shard (`sha256` empty) or one sample of it that a manifest leaves out, and why (docs/provenance.md)."""

    shard_id: str
    sha256: str = ""  # the sample key; "" for the whole shard
    partner: str = ""
    license: str = ""
    reason: str


class Manifest(Frozen):
    """Exactly the shards one training job reads; its hash names the job.

    `exclude` lists, per shard, the samples the trainer skips (revoked or no longer licensed for
    this use): shards stay immutable and their digests valid. `left_out` says why, for those
    samples and for whole shards left out. Both are absent from manifests made before them.
    """

    bucket: str
    prefix: str
    shards: tuple[ShardRef, ...]
    lineage: str = ""
    sequence: int = 0  # the lineage's n-th manifest: the same shards again (after a failure) name a new job
    exclude: dict[str, tuple[str, ...]] = {}  # shard_id -> sample keys the trainer never reads
    left_out: tuple[LeftOut, ...] = ()

    @property
    def digest(self) -> str:
        fields = self.model_dump(mode="json")
        for name in ("exclude", "left_out"):  # empty: the digest a manifest had before these fields
            if not fields[name]:
                del fields[name]
        for shard in fields["shards"]:
            if not shard["table_key"]:
                del shard["table_key"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def excluded(self) -> int:
        return sum(len(keys) for keys in self.exclude.values())

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def new_shards(self) -> tuple[ShardRef, ...]:
        return tuple(s for s in self.shards if s.role == "new")


IMPORT_BATCH_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # an import batch's id: also a key prefix and a table key part


class ImportShard(Frozen):
    """The ImportQueue message: one source tar of one import batch."""

    batch_id: str = Field(pattern=IMPORT_BATCH_PATTERN)
    bucket: str
    key: str
    partner: str
    license: str
    # absent from messages queued before the option existed: they did what the default does
    near_duplicates: NearDuplicates = DEFAULT_NEAR_DUPLICATES

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"
