"""How the pack stage writes the WebDataset shard layout (contracts.shard_members; docs/pack.md).

A shard is a POSIX (ustar) tar. One sample = three contiguous members sharing a dot-free key:
`<key>.<jpg|png|webp>` (the stored image bytes), `<key>.json` (the metadata record: license,
provenance) and `<key>.txt` (the caption). Headers are fixed (mtime 0, uid/gid 0, mode 0644, no
user names), so the same members in the same order give the same bytes.

A shard is written as segments, each a run of complete samples' members sorted by key with no
end-of-archive marker; the shard is its segments in order followed by `trailer(...)`, exactly
the bytes `tarfile` writes for the same members (see `render_shard`).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from dataclasses import dataclass
from typing import BinaryIO, Iterable

from contracts import shard_members
from contracts.messages import Sample
from contracts.shard_index import member_line

# the pack stage's callers read a shard's keys and headers from here; contracts holds them
from contracts.s3_layout import index_key, shard_key, table_key  # noqa: F401
from contracts.shard_members import member_header  # noqa: F401

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # tarfile (and GNU tar) pad the archive to 20 blocks
END_OF_ARCHIVE = 2 * BLOCK
TRAILER_MAX = END_OF_ARCHIVE + RECORD - BLOCK
DIGEST_ALGORITHM = "atelier-tree-v1"
_UNSAFE_KEY = re.compile(r"[^A-Za-z0-9_-]")
_UNSAFE_EXTENSION = re.compile(r"[^a-z0-9]")


# --- names --------------------------------------------------------------------------------------

def safe_key(key: str) -> str:
    """A member key: only [A-Za-z0-9_-], so no dots, slashes, `..` or control characters."""
    return (_UNSAFE_KEY.sub("_", key) or "_")[:90]


def member_name(key: str, extension: str) -> str:
    """`<key>.<extension>`, sanitised whatever either part holds (the upload key never appears)."""
    return shard_members.member_name(safe_key(key), _UNSAFE_EXTENSION.sub("", extension.lower())[:8] or "bin")


def shard_id_for(sample_keys: Iterable[str]) -> str:
    """A shard is named by the samples of its first segment: unique, since a sample is packed once."""
    digest = hashlib.sha256("\n".join(sorted(sample_keys)).encode()).hexdigest()
    return f"shard-{digest[:32]}"


# --- members ------------------------------------------------------------------------------------

def record_json(sample: Sample) -> bytes:
    """The `.json` member: the metadata record and, at its top level, the source dataset's own fields
    (img2dataset's `url`, `key`, `status`, ...) so tools built for that dataset read it unchanged.
    A source field named like one of ours wins there (`key`: img2dataset's sample key), and ours
    moves to `upload_<name>` (`upload_key`: the `<tar>#<member>` provenance pointer)."""
    if not sample.source_fields:
        return sample.model_dump_json().encode()
    record = sample.model_dump(mode="json", exclude={"source_fields"})
    for name, value in sample.source_fields.items():
        if name in record:
            record[f"upload_{name}"] = record[name]
        record[name] = value
    return json.dumps(record, separators=(",", ":")).encode()


def small_members(sample: Sample) -> list[tuple[str, bytes]]:
    """The record and the caption, in member order after the image."""
    return [(member_name(sample.sha256, shard_members.RECORD), record_json(sample)),
            (member_name(sample.sha256, shard_members.CAPTION), sample.caption.encode())]


def image_name(sample: Sample) -> str:
    return member_name(sample.sha256, sample.extension)


def padding(size: int) -> int:
    return -size % BLOCK


def member_span(size: int) -> int:
    return BLOCK + size + padding(size)


def sample_span(sample: Sample, image_size: int) -> int:
    """The exact bytes one sample's three members take in a shard."""
    return member_span(image_size) + sum(member_span(len(data)) for _, data in small_members(sample))


def trailer(payload: int) -> bytes:
    """End-of-archive blocks, padded as tarfile pads, after `payload` bytes of members."""
    total = payload + END_OF_ARCHIVE
    return bytes(END_OF_ARCHIVE + (-total % RECORD))


# --- the in-memory reference --------------------------------------------------------------------

def render_shard(samples: Iterable[tuple[Sample, bytes]]) -> bytes:
    """A whole shard in memory, samples in the given order (the reference the packer must match)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=shard_members.TAR_FORMAT) as tar:
        for sample, image in samples:
            for name, data in [(image_name(sample), image), *small_members(sample)]:
                tar.addfile(shard_members.tarinfo(name, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def build_shard(samples: Iterable[tuple[Sample, bytes]]) -> bytes:
    """The shard of one segment: samples sorted by key, so any order gives the same bytes."""
    return render_shard(sorted(samples, key=lambda pair: pair[0].sha256))


# --- the shard digest ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MemberDigest:
    offset: int  # of the header block
    header_sha256: str
    size: int
    sha256: str

    def line(self) -> str:
        return member_line(self.offset, self.header_sha256, self.size, self.sha256)


def tree_digest(members: Iterable[MemberDigest], total: int) -> str:
    """`atelier-tree-v1`: sha256 over one line per member, then the shard's size (docs/pack.md)."""
    digest = hashlib.sha256(f"{DIGEST_ALGORITHM}\n".encode())
    for member in members:
        digest.update(member.line().encode())
    digest.update(f"{total}\n".encode())
    return digest.hexdigest()


class CorruptShard(ValueError):
    """A shard's bytes are not what its digest or layout says."""


def digest_of_tar(stream: BinaryIO) -> tuple[str, int]:
    """Recompute (tree digest, size) from a shard's bytes, checking that padding and trailer are zero."""
    members: list[MemberDigest] = []
    offset = 0
    while True:
        header = stream.read(BLOCK)
        if len(header) < BLOCK:
            raise CorruptShard(f"truncated at {offset}")
        if header == bytes(BLOCK):
            rest = header + stream.read()
            if rest.count(0) != len(rest) or (offset + len(rest)) % RECORD or len(rest) < END_OF_ARCHIVE:
                raise CorruptShard(f"bad end of archive at {offset}")
            total = offset + len(rest)
            return tree_digest(members, total), total
        info = tarfile.TarInfo.frombuf(header, "utf-8", "strict")
        data = stream.read(info.size)
        pad = stream.read(padding(info.size))
        if len(data) < info.size or pad.count(0) != len(pad):
            raise CorruptShard(f"bad member {info.name} at {offset}")
        members.append(MemberDigest(offset, hashlib.sha256(header).hexdigest(), info.size,
                                    hashlib.sha256(data).hexdigest()))
        offset += member_span(info.size)
