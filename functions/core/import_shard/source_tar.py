"""A source tar read as samples: streamed member by member (never whole in memory), each sample what
the tar says of it (caption, URL, img2dataset's fields and sha256) and ingest's own decision on its image
(core.ingest.metadata)."""

from __future__ import annotations

import json
import re
import tarfile
from dataclasses import dataclass, field, replace
from typing import IO, Any, Iterator

from contracts import shard_members
from contracts.messages import ImportShard, Sample, Sidecar, UploadRef
from core import aws
from core.errors import RejectedUpload
from core.ingest import metadata
from core.pack import shards
from core.import_shard.settings import ImportSettings

# img2dataset's per-sample fields its tools read back (its docs, "Output format"), kept verbatim
SOURCE_FIELDS = ("url", "key", "status", "original_width", "original_height", "exif")
SOURCE_FIELDS_MAX_BYTES = 16 << 10
# webdataset's rule: the key is the name up to the first dot of its last path component.
_NAME = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class NotATar(ValueError):
    """The object does not even start as a tar archive."""


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


def describe(source: SourceSample, upload: UploadRef, message: ImportShard,
              settings: ImportSettings) -> tuple[metadata.Described, str | None, tuple[int, int] | None]:
    """Ingest's decision for one sample, fed with what the tar already says (caption, URL, sha256);
    img2dataset's original sha256 and its width/height, for the checks against the decoded image."""
    if source.problem is not None:
        raise source.problem
    extension = image_extension(source)
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


def same_size(claimed: tuple[int, int] | None, sample: Sample) -> bool:
    """No claim, or the decoded size either way round: img2dataset measures before EXIF orientation
    (OpenCV's IMREAD_UNCHANGED), the safe decode after it."""
    return claimed is None or claimed in {(sample.width, sample.height), (sample.height, sample.width)}


def ends_cleanly(message: ImportShard, size: int, version: str) -> bool:
    """A whole tar is 512-byte blocks ending in two zero blocks (one ranged GET of its last 1 KiB)."""
    end = 2 * shards.BLOCK
    if size < end or size % shards.BLOCK:
        return False
    return aws.read_range(message.bucket, message.key, size - end, size, version) == bytes(end)


def image_extension(source: SourceSample) -> str | None:
    return next((e for e in shard_members.SOURCE_IMAGES if e in source.members), None)


def _json(data: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(data) if data else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def stats_key(key: str) -> str:
    """img2dataset writes `<n>.tar` with `<n>_stats.json` and `<n>.parquet` beside it."""
    return key.removesuffix(".tar") + "_stats.json"
