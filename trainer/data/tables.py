"""Shards read by offset: a shard's sample table found, read and checked, and one sample's range read
and checked against it (contracts.shard_index says what a table holds; docs/trainer.md, "Start-up").

At start a process reads each of its shards' tables whole, in one read, instead of walking the tar:
over FastFile every read is a ranged GET, and walking a 25 GB shard of 10^5 samples is 4 x 10^5 of
them. A sample is then one read of its range (its members' headers, data and padding), from its
table row; or, for a shard without a table, from the offsets the scan found (trainer/data/scan.py).

Nothing wrong is read silently. A table must name the shard beside it and its exact size, and its
rows must lie inside it, in order, or the job stops at start (`ShardIndexError`): a table is written
with its shard, so one that disagrees means the data is not what was sealed. When a sample is read,
its members' headers must name its key and fill its range exactly (else `ShardIndexError` too), and
its bytes must hash to the row's digest: a sample whose bytes alone differ is a `CorruptSample`,
reported and replaced like any other unreadable sample.
"""

import hashlib
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from wids.wids import splitname

from contracts.s3_layout import INDEX_TABLE
from contracts.shard_members import EMPTY_CAPTION_KEY
from contracts.shard_index import BLOCK, TableHeader, columns, member_line, padded, sample_digest

NO_DIGEST = bytes(32)  # the digest column of a shard without a table
FILE_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE)  # the members wids reads; a pax header is skipped, as wids skips it
END_OF_ARCHIVE = 2 * BLOCK


class CorruptSample(ValueError):
    """A sample whose members cannot be read or decoded."""


class ShardIndexError(ValueError):
    """A sample table that does not describe the shard beside it: the job stops rather than read wrong samples."""


@dataclass
class ShardRows:
    """One shard's samples to train on, in numpy columns, and what was left out."""

    key: np.ndarray  # str
    aspect: np.ndarray  # float64: width / height
    offset: np.ndarray  # int64: of the sample's first member header
    size: np.ndarray  # int64: its members' headers, data and padding
    digest: np.ndarray  # V32: sha256 of its member lines (contracts.shard_index); NO_DIGEST where the shard has no table
    problems: list[str] = field(default_factory=list)
    excluded: int = 0
    encodings: set = field(default_factory=set)  # (identity, resolution) of latent samples; None for image samples


class RangeFile:
    """A shard or a table read by ranges: each `read` is one pread (one ranged GET over FastFile), at
    no shared file position, so forked loader workers can share one."""

    def __init__(self, path: str | Path):
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, offset: int, size: int) -> bytes:
        """`size` bytes from `offset` (fewer where the file ends)."""
        parts, left = [], size
        while left:
            part = os.pread(self.fd, left, offset + size - left)
            if not part:
                break
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "RangeFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_file(path: str | Path) -> RangeFile:
    """How shards and tables are opened (tests and bench/startup_read.py count the reads here)."""
    return RangeFile(path)


def find_table(shard_id: str, index_dir: Path) -> Path | None:
    """`<index_dir>/<shard_id>.table`, if there is one."""
    path = index_dir / f"{shard_id}{INDEX_TABLE}"
    return path if path.is_file() else None


def table_rows(table: Path, shard: str, shard_id: str, exclude: frozenset[str]) -> ShardRows:
    """The rows of a shard's table, less `exclude` (never read); ShardIndexError if it does not describe the shard."""
    with open_file(table) as file:
        data = file.read(0, table.stat().st_size)
    try:
        end = data.index(b"\n")
        header = TableHeader.parse(data[:end])
        rows = np.frombuffer(data, dtype=np.dtype([(name, kind) for name, kind, _ in columns(header.key_bytes)]),
                             offset=end + 1)  # the rows in place: no copy of them
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise ShardIndexError(f"{table} is not a readable sample table ({type(error).__name__}: {error}); "
                              "remove it to index the shard by walking its tar") from None
    problem = _disagreement(header, rows, shard_id, os.path.getsize(shard))
    if problem:
        raise ShardIndexError(f"{table} does not describe {shard}: {problem}")
    keys, excluded = _keys(rows["key"]), 0
    if len(keys) and keys[0] == EMPTY_CAPTION_KEY:  # a family latent shard's empty caption: no sample to train on
        keys, rows = keys[1:], rows[1:]
    if exclude:
        kept = ~np.isin(keys, list(exclude))
        keys, rows, excluded = keys[kept], rows[kept], int(len(kept) - kept.sum())
    return ShardRows(keys, rows["aspect"].astype(np.float64), rows["offset"].astype(np.int64),
                     rows["size"].astype(np.int64), rows["digest"], excluded=excluded, encodings={header.encoding})


def _disagreement(header: TableHeader, rows: np.ndarray, shard_id: str, shard_bytes: int) -> str:
    """What makes the table not the one of this shard, or ""."""
    if header.shard_id != shard_id:
        return f"it is the table of {header.shard_id}"
    if header.shard_bytes != shard_bytes:
        return f"it is the table of a {header.shard_bytes}-byte shard; this one has {shard_bytes} bytes"
    if len(rows) != header.samples:
        return f"it holds {len(rows)} rows; its header says {header.samples}"
    if not len(rows):
        return ""
    starts, ends = rows["offset"].astype(np.int64), (rows["offset"] + rows["size"]).astype(np.int64)
    if np.any(rows["size"] < BLOCK) or np.any(starts % BLOCK) or np.any(rows["size"] % BLOCK) \
            or np.any(starts[1:] < ends[:-1]) or ends[-1] > shard_bytes - END_OF_ARCHIVE:
        return "its rows are not ranges of whole blocks, in order, inside the shard"
    if not np.all(np.isfinite(rows["aspect"]) & (rows["aspect"] > 0)):
        return "an aspect ratio is not a positive number"
    return ""


def _keys(raw: np.ndarray) -> np.ndarray:
    try:
        return raw.astype(str)  # ASCII: every pipeline key
    except UnicodeDecodeError:
        return np.char.decode(raw, "utf-8")


def span_members(span: bytes, offset: int, key: str, digest: bytes) -> dict[str, bytes]:
    """The members of the sample whose range `span` (read from `offset`) is: lower-case extension -> bytes.

    With a digest (the shard's table row) every byte is checked; without one (NO_DIGEST: a scanned shard)
    the headers still have to name the sample."""
    digest = b"" if digest == NO_DIGEST else digest
    members, lines, at = {}, [], 0
    while at < len(span):
        header = span[at:at + BLOCK]
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as error:
            raise _wrong(digest, f"{key}: no tar header at {offset + at} ({error})") from None
        data = span[at + BLOCK:at + BLOCK + info.size]
        if len(data) < info.size:
            raise _wrong(digest, f"{key}: a member at {offset + at} runs past the sample's range")
        if digest:
            lines.append(member_line(offset + at, hashlib.sha256(header).hexdigest(), info.size,
                                     hashlib.sha256(data).hexdigest()))
        name = header[:100].split(b"\0", 1)[0].decode("utf-8", "replace")  # the name field, as wids reads it
        if info.type in FILE_TYPES and "." in name and name != "././@PaxHeader":
            member_key, extension = splitname(name)
            if member_key != key:
                raise _wrong(digest, f"{key}: the member at {offset + at} is {name}, of another sample")
            members[extension[1:].lower()] = data
        at += BLOCK + padded(info.size)
    if digest and sample_digest(lines) != digest:
        raise CorruptSample(f"{key}: its bytes differ from the shard's sample table")
    return members


def _wrong(digest: bytes, message: str) -> ValueError:
    """A table's range that is not the sample stops the job; a scanned shard's is one corrupt sample."""
    return ShardIndexError(f"the sample table disagrees with the shard: {message}") if digest else CorruptSample(message)
