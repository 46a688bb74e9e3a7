"""The shards of a channel directory, indexed and read: the only code that knows the shard layout.

A shard is a POSIX tar of samples; a sample is the consecutive members sharing a key (webdataset's
rule: the name up to the first dot of its basename). Atelier's packer writes `<sha256>.<jpg|png|webp>`
(the stored image), `<sha256>.json` (the ingest metadata record: width, height, format, partner,
license, and maybe `aspect_bucket`) and `<sha256>.txt` (the caption); img2dataset writes
`000000012.jpg`, `.txt` and `.json` (url, caption, width, height) with `.parquet` and `_stats.json`
files beside the tars. Both read as they are. See "Shards" in docs/architecture.md.

Index: each process indexes its shards once. A shard with a sample table (contracts.shard_index: the
pack stage writes one beside every shard it seals, the encode job one beside every latent shard) is
indexed from it alone, one read, with no header walk: the tables come in as the job's `indexes`
channel (`--index-dir`, default $SM_CHANNEL_INDEXES, else `<train-dir>/indexes/`), one
`<shard id>.table` per shard (trainer/data/tables.py checks it against its shard). A shard without one
(sealed before tables, or a foreign tar) is indexed by walking its tar with wids (trainer/data/scan.py).
Either way each sample is then read with one read of its range, by offset (`ShardReader`).
SageMaker's ShardedByS3Key has already given each host its own shards; the processes of a host
split them by local rank (or, with fewer shards than processes, split the samples). Which samples
make each batch: trainer/data/plan.py; loading them: trainer/data/loader.py.

Exclusions and draws (docs/provenance.md): the job's manifest (`--manifest`, the `manifest` channel)
may list per shard the samples to leave out (revoked, or no longer licensed for this use). They are
dropped while indexing, before anything of theirs is read, so no batch and no replacement can hold
them; the shards themselves stay as packed (immutable, their digests valid). Each batch names the
(partner, license) of its samples, from their JSON records, for the trainer's draw counts.
"""

import json
import tarfile
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contracts.s3_layout import INDEXES
from trainer.data import tables
from trainer.data.scan import scan_rows
from trainer.data.tables import ShardRows, find_table, span_members, table_rows

# what reading a sample raises; its callers catch them from here
from trainer.data.tables import CorruptSample, ShardIndexError  # noqa: F401

UNKNOWN = "unknown"  # the partner or license of a sample whose record names none (img2dataset's)


class NoShardsError(ValueError):
    """The channel directory holds no shard (or no readable sample) this process can read."""


# ---------------------------------------------------------------- index


@dataclass
class ShardIndex:
    """Which samples of this process's shards it trains on, one row per sample, in numpy columns."""

    shards: list[str]
    shard: np.ndarray  # int32: position in `shards`
    key: np.ndarray  # str
    aspect: np.ndarray  # float64: width / height
    offset: np.ndarray  # int64: where the sample's first member header starts in its shard
    size: np.ndarray  # int64: the bytes of its members (headers and padding included): one read
    digest: np.ndarray  # V32: what its bytes hash to (contracts.shard_index); zeros for a shard without a table
    problems: list[str] = field(default_factory=list)  # samples left out, and why
    excluded: int = 0  # samples the manifest's exclusion list left out (never read)
    encodings: frozenset = frozenset()  # latent shards: the (encoder identity, resolution) pairs they hold
    scanned: int = 0  # shards indexed by walking their tar (no sample table)

    def __len__(self) -> int:
        return len(self.key)

    @property
    def latent(self) -> bool:
        """Whether these are latent shards (trainer/jobs/encode.py) rather than image shards."""
        return bool(self.encodings)


def find_shards(channel_dir: str | Path) -> list[str]:
    """Every `*.tar` under the channel, at any depth, in a stable order. Dot names are skipped, as the job's
    S3 manifest skips them: `.tmp-<name>.tar` is a shard an encode job was still writing when it stopped."""
    root = Path(channel_dir)
    shards = sorted(str(path) for path in root.rglob("*.tar")
                    if path.is_file() and not any(part.startswith(".") for part in path.relative_to(root).parts))
    if not shards:
        raise NoShardsError(f"no shards (*.tar) under the training channel {root}")
    return shards


def load_exclusions(manifest: str | Path | None) -> dict[str, frozenset[str]]:
    """The manifest's `exclude` (shard id -> sample keys) from its JSON file, or from the one `*.json`
    in a channel directory; empty without a manifest (or in a manifest from before exclusions)."""
    if not manifest:
        return {}
    path = Path(manifest)
    files = sorted(path.rglob("*.json")) if path.is_dir() else [path]
    if len(files) != 1:
        raise ValueError(f"expected one manifest JSON in {path}, found {len(files)}")
    exclude = json.loads(files[0].read_text()).get("exclude") or {}
    return {str(shard): frozenset(keys) for shard, keys in exclude.items()}


def shard_id_of(path: str) -> str:
    """The shard id a manifest names a shard by: its file name without `.tar` (`shards/<id>.tar`)."""
    return Path(path).name.removesuffix(".tar")


def index_shards(channel_dir: str | Path, local_rank: int = 0, local_world_size: int = 1,
                 exclude: Mapping[str, Collection[str]] | None = None, index_dir: str | Path | None = None) -> ShardIndex:
    """The samples this process trains on: its share of the host's shards, indexed from their sample
    tables in `index_dir` (default `<channel_dir>/indexes`) or else by walking them, less `exclude`."""
    shards = find_shards(channel_dir)
    split_shards = len(shards) >= local_world_size
    mine = shards[local_rank::local_world_size] if split_shards else shards
    tables_dir = Path(index_dir) if index_dir else Path(channel_dir) / INDEXES
    named = Counter(shard_id_of(path) for path in shards)  # a name two shards share picks no table: both are walked
    parts: list[ShardRows] = []
    scanned = 0
    for path in mine:
        shard_id = shard_id_of(path)
        skip = frozenset((exclude or {}).get(shard_id, ()))
        table = find_table(shard_id, tables_dir) if named[shard_id] == 1 else None
        parts.append(table_rows(table, path, shard_id, skip) if table else scan_rows(path, skip))
        scanned += table is None
    shard = np.concatenate([np.full(len(part.key), number, dtype=np.int32) for number, part in enumerate(parts)])
    columns = {name: np.concatenate([getattr(part, name) for part in parts]) if len(parts) > 1
               else getattr(parts[0], name) for name in ("key", "aspect", "offset", "size", "digest")}
    if not split_shards:
        shard, columns = shard[local_rank::local_world_size], {k: v[local_rank::local_world_size] for k, v in columns.items()}
    problems = [problem for part in parts for problem in part.problems]
    encodings = set().union(*(part.encodings for part in parts if len(part.key)))
    if not len(shard):
        raise NoShardsError(f"no readable samples in {len(mine)} shard(s) under {channel_dir} for local rank {local_rank}"
                            + (f"; problems: {problems[:5]}" if problems else ""))
    if None in encodings and len(encodings) > 1:
        raise NoShardsError(f"{channel_dir} mixes image shards and latent shards; a channel holds one kind")
    return ShardIndex(shards=mine, shard=shard, **columns, problems=problems, excluded=sum(p.excluded for p in parts),
                      encodings=frozenset(encodings - {None}), scanned=scanned)


# ---------------------------------------------------------------- read


class ShardReader:
    """The members of an index's samples, each read with one read of its range; each process opens the
    shards it touches itself."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self._files: dict[int, tables.RangeFile] = {}  # shard number -> the open shard, per process

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}  # open files do not cross into spawned workers

    def read(self, row: int) -> dict[str, bytes]:
        """The members of a row's sample: lower-case extension -> bytes, checked against its table row."""
        number = int(self.index.shard[row])
        if number not in self._files:
            self._files[number] = tables.open_file(self.index.shards[number])
        offset = int(self.index.offset[row])
        span = self._files[number].read(offset, int(self.index.size[row]))
        return span_members(span, offset, str(self.index.key[row]), bytes(self.index.digest[row]))

    def read_head(self, number: int) -> tuple[str, bytes]:
        """(name, data) of shard `number`'s first member: two reads (a family latent shard's empty caption)."""
        if number not in self._files:
            self._files[number] = tables.open_file(self.index.shards[number])
        info = tarfile.TarInfo.frombuf(self._files[number].read(0, tarfile.BLOCKSIZE), "utf-8", "strict")
        return info.name, self._files[number].read(tarfile.BLOCKSIZE, info.size)


def sample_source(record: bytes | None) -> tuple[str, str]:
    """(partner, license) from a sample's JSON record (docs/metadata.md); `unknown` where it has none."""
    try:
        fields = json.loads(record) if record else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        fields = {}
    fields = fields if isinstance(fields, dict) else {}
    return (str(fields.get("partner") or UNKNOWN), str(fields.get("license") or UNKNOWN))
