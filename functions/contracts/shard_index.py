"""A shard's sample table: what a job reads at start instead of walking the tar's headers (docs/pack.md).

The pack stage writes one beside each sealed shard's JSON index (`indexes/<shard_id>.table`,
core.pack.seal) and the encode job one beside each latent shard (`indexes/<shard_id>.table` under
its encoding's folder, trainer/jobs/latent_writer.py); the trainer reads it through the job's
`indexes` channel (trainer/data/tables.py). Over FastFile the whole table is one read, where walking
the tar is a read per member header and per record.

Layout: one JSON header line (`TableHeader`), then one fixed-width little-endian row per sample in
shard order (`columns`): its key (NUL-padded to `key_bytes`), the offset of its first member's header,
its size (every member's header, data and padding: the one range that reads it), its aspect ratio
(width / height: its aspect bucket's, as the trainer buckets it) and its digest (`sample_digest`).

A sample's digest is the sha256 of its members' lines in the shard's tree digest (`member_line`:
header offset, sha256 of the 512-byte header, data size, sha256 of the data), so a reader that reads
the sample's range can check every byte of it, and its place in the shard, against the table.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from contracts.shard_members import member_header

TABLE_FORMAT = "atelier-sample-table"
TABLE_VERSION = 1
BLOCK = 512  # a tar block: every member's header, and the unit its data is padded to


def columns(key_bytes: int) -> list[tuple[str, str, str]]:
    """(name, numpy type, struct code) of each column of a row, in order; no padding between them."""
    return [("key", f"S{key_bytes}", f"{key_bytes}s"), ("offset", "<u8", "Q"), ("size", "<u8", "Q"),
            ("aspect", "<f8", "d"), ("digest", "V32", "32s")]  # V: raw bytes (numpy's S would drop trailing NULs)


def row_struct(key_bytes: int) -> struct.Struct:
    return struct.Struct("<" + "".join(code for _, _, code in columns(key_bytes)))


@dataclass(frozen=True)
class TableHeader:
    shard_id: str
    shard_bytes: int  # the tar's size: a table is only read beside a tar of exactly this size
    samples: int
    key_bytes: int
    encoding: tuple[str, int] | None = None  # latent shards: (encoder identity, resolution) of every sample

    def line(self) -> bytes:
        return json.dumps({"format": TABLE_FORMAT, "version": TABLE_VERSION, "shard_id": self.shard_id,
                           "shard_bytes": self.shard_bytes, "samples": self.samples, "key_bytes": self.key_bytes,
                           "encoding": list(self.encoding) if self.encoding else None}).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> TableHeader:
        """The header of a table this code can read; ValueError for anything else."""
        fields = json.loads(line)
        if not isinstance(fields, dict) or (fields.get("format"), fields.get("version")) != (TABLE_FORMAT, TABLE_VERSION):
            raise ValueError(f"not a {TABLE_FORMAT} v{TABLE_VERSION} header")
        encoding = fields.get("encoding")
        return cls(str(fields["shard_id"]), int(fields["shard_bytes"]), int(fields["samples"]), int(fields["key_bytes"]),
                   (str(encoding[0]), int(encoding[1])) if encoding else None)


def member_line(offset: int, header_sha256: str, size: int, sha256: str) -> str:
    """One member's line of the shard's tree digest (`atelier-tree-v1`, docs/pack.md)."""
    return f"{offset} {header_sha256} {size} {sha256}\n"


def sample_digest(lines: Iterable[str]) -> bytes:
    """The 32-byte sha256 of a sample's member lines, in shard order."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode())
    return digest.digest()


def row(packer: struct.Struct, key: str, offset: int, size: int, aspect: float | None, digest: bytes) -> bytes:
    """One sample's row; an aspect that is unknown is written as NaN, which no reader accepts."""
    encoded = key.encode()
    if len(encoded) > packer.size - 56:  # 56: the fixed columns after the key
        raise ValueError(f"key {key!r} is longer than the table's keys")
    return packer.pack(encoded, offset, size, math.nan if aspect is None else aspect, digest)


def sample_key(name: str) -> str:
    """The key of a member's sample: its name up to the first dot of its basename (webdataset's rule)."""
    folder, slash, base = name.rpartition("/")
    return folder + slash + base.split(".", 1)[0]


def padded(size: int) -> int:
    return size + -size % BLOCK


def table_of_members(shard_id: str, members: list[tuple[str, bytes]], aspects: Mapping[str, float],
                     encoding: tuple[str, int] | None = None) -> bytes:
    """The table of a tar holding exactly these (name, bytes) members in this order, written with
    contracts.shard_members' fixed headers; `aspects` gives each sample key's width / height."""
    spans: list[tuple[str, int, int, list[str]]] = []  # key, offset, size, member lines
    offset = 0
    for name, data in members:
        key = sample_key(name)
        header = member_header(name, len(data))
        if not spans or spans[-1][0] != key:
            spans.append((key, offset, 0, []))
        spans[-1][3].append(member_line(offset, hashlib.sha256(header).hexdigest(), len(data),
                                        hashlib.sha256(data).hexdigest()))
        offset += BLOCK + padded(len(data))
        spans[-1] = (key, spans[-1][1], offset - spans[-1][1], spans[-1][3])
    shard_bytes = offset + 2 * BLOCK
    shard_bytes += -shard_bytes % (20 * BLOCK)  # the end-of-archive blocks, padded to a record as tarfile pads
    key_bytes = max((len(key.encode()) for key, *_ in spans), default=1)
    packer = row_struct(key_bytes)
    rows = [row(packer, key, start, size, aspects.get(key), sample_digest(lines)) for key, start, size, lines in spans]
    return TableHeader(shard_id, shard_bytes, len(rows), key_bytes, encoding).line() + b"".join(rows)
