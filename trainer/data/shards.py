"""The shards of a channel directory, indexed and read: the only code that knows the shard layout.

A shard is a POSIX tar of samples; a sample is the consecutive members sharing a key (webdataset's
rule: the name up to the first dot of its basename). Atelier's packer writes `<sha256>.<jpg|png|webp>`
(the stored image), `<sha256>.json` (the ingest metadata record: width, height, format, partner,
license, and maybe `aspect_bucket`) and `<sha256>.txt` (the caption); img2dataset writes
`000000012.jpg`, `.txt` and `.json` (url, caption, width, height) with `.parquet` and `_stats.json`
files beside the tars. Both read as they are. See "Shards" in docs/architecture.md.

Shards are read with wids, webdataset's indexed (random-access) reader: `IndexedTarSamples` maps a
shard, walks its tar headers into an index and groups the members into samples. Its
`ShardListDataset` is not used: for a local path it copies every shard into its cache
(`/tmp/_wids_cache`) or, told to read shards in place, writes `<shard>.lock` beside them, which a
FastFile channel (read-only) refuses; nor are its decoders (they unpickle `.pkl` and `.pth` members).

Index: each process indexes its shards once with wids and reads the JSON record of every sample
(not the image): the aspect ratio from the record (or, without one, the image header).
SageMaker's ShardedByS3Key has already given each host its own shards; the processes of a host
split them by local rank (or, with fewer shards than processes, split the samples). Which samples
make each batch: trainer/data/plan.py; loading them: trainer/data/loader.py.

Latent shards (trainer/jobs/encode.py writes them, trainer/data/latents.py says what they hold): the
same samples with `<key>.latents.safetensors` (the VAE's posterior parameters for the sample's
bucket and centred crop at one resolution, its SDXL time ids, and in the header the encoder
identity, resolution and bucket), `<key>.ids.npy` (the caption's token ids, one row per text
encoder) and `<key>.json` instead of the image and caption. A shard's kind follows from its
members' extensions; a latent sample's bucket is the one it was encoded for.

Exclusions and draws (docs/provenance.md): the job's manifest (`--manifest`, the `manifest` channel)
may list per shard the samples to leave out (revoked, or no longer licensed for this use). They are
dropped while indexing, before their records are read, so no batch and no replacement can hold
them; the shards themselves stay as packed (immutable, their digests valid). Each batch names the
(partner, license) of its samples, from their JSON records, for the trainer's draw counts.
"""

import io
import json
import struct
import tarfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from wids.wids import IndexedTarSamples, splitname
from wids.wids_mmtar import MMIndexedTar

from contracts.aspect_buckets import bucket_ratio
from contracts.shard_members import CAPTION, IDS, IMAGE_FORMATS, LATENTS, RECORD

UNKNOWN = "unknown"  # the partner or license of a sample whose record names none (img2dataset's)


class NoShardsError(ValueError):
    """The channel directory holds no shard (or no readable sample) this process can read."""


class CorruptSample(ValueError):
    """A sample whose members cannot be read or decoded."""


# ---------------------------------------------------------------- index


@dataclass
class ShardIndex:
    """Which samples of this process's shards it trains on, one row per sample, in numpy columns."""

    shards: list[str]
    shard: np.ndarray  # int32: position in `shards`
    sample: np.ndarray  # int64: the sample's number in its shard, as wids counts them
    key: np.ndarray  # str
    aspect: np.ndarray  # float64: width / height
    problems: list[str] = field(default_factory=list)  # samples left out, and why
    excluded: int = 0  # samples the manifest's exclusion list left out (never read)
    encodings: frozenset = frozenset()  # latent shards: the (encoder identity, resolution) pairs they hold

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
                 exclude: Mapping[str, Collection[str]] | None = None) -> ShardIndex:
    """The samples this process trains on: its share of the host's shards, indexed, less `exclude`."""
    shards = find_shards(channel_dir)
    split_shards = len(shards) >= local_world_size
    mine = shards[local_rank::local_world_size] if split_shards else shards
    rows, problems, excluded, encodings = [], [], 0, set()
    for number, path in enumerate(mine):
        shard_rows, shard_problems, skipped, shard_encodings = _scan(path, frozenset((exclude or {}).get(shard_id_of(path), ())))
        rows += [(number, *row) for row in shard_rows]
        problems += shard_problems
        excluded += skipped
        encodings |= shard_encodings
    if not split_shards:
        rows = rows[local_rank::local_world_size]
    if not rows:
        raise NoShardsError(f"no readable samples in {len(mine)} shard(s) under {channel_dir} for local rank {local_rank}"
                            + (f"; problems: {problems[:5]}" if problems else ""))
    if None in encodings and len(encodings) > 1:
        raise NoShardsError(f"{channel_dir} mixes image shards and latent shards; a channel holds one kind")
    columns = list(zip(*rows))
    return ShardIndex(
        shards=mine,
        shard=np.array(columns[0], dtype=np.int32),
        sample=np.array(columns[1], dtype=np.int64),
        key=np.array(columns[2], dtype=str),
        aspect=np.array(columns[3], dtype=np.float64),
        problems=problems,
        excluded=excluded,
        encodings=frozenset(encodings - {None}),
    )


def scan_shard(path: str, exclude: Collection[str] = frozenset()) -> tuple[list[tuple[int, str, float]], list[str]]:
    """(rows (sample number, key, aspect), problems) from wids' index of one shard.

    wids reads only the tar headers; then only each sample's JSON record is read (and the image
    header of a sample whose record gives no size). Samples keyed in `exclude` are not read at all.
    """
    rows, problems, _, _ = _scan(path, frozenset(exclude))
    return rows, problems


def _scan(path: str, exclude: frozenset[str]) -> tuple[list[tuple[int, str, float]], list[str], int, set]:
    """scan_shard's rows and problems, how many samples `exclude` left out, and the shard's encodings
    ((identity, resolution) of its latent samples; None for image samples)."""
    name = Path(path).name
    try:
        shard = IndexedTarSamples(path=path)
    except Exception as error:  # noqa: BLE001 - wids raises struct.error, ValueError, ... for a tar it cannot walk
        # e.g. a shard cut off inside a tar header: wids indexes all of a shard or none of it
        return [], [f"{name}: wids cannot index it ({type(error).__name__}: {error})"], 0, set()
    tar = shard.reader  # wids' MMIndexedTar: (name, header offset, size) of each member over the mapped shard
    try:
        if len(tar.by_name) != len(tar.by_index):  # wids numbers members by unique name but reads them by position
            return [], [f"{name}: repeated member names, which wids would pair with the wrong members"], 0, set()
        rows, problems, skipped, encodings = [], [], 0, set()
        for number, members in enumerate(shard.samples):
            if exclude and splitname(tar.by_index[members[0]][0])[0] in exclude:  # the key, from the header alone
                skipped += 1
                continue
            row = sample_row(tar, members)
            if isinstance(row, str):
                problems.append(f"{name}/{row}")
            else:
                key, aspect, encoding = row
                rows.append((number, key, aspect))
                encodings.add(encoding)
        return rows, problems, skipped, encodings
    finally:
        shard.close()


def sample_row(tar: MMIndexedTar, members: list[int]) -> tuple[str, float, tuple[str, int] | None] | str:
    """(key, aspect, encoding) of one sample from its members in wids' index, or what is wrong with it.

    A latent sample's aspect is its bucket's and its encoding (identity, resolution) comes from its
    safetensors header; an image sample's encoding is None."""
    spans = {}
    for member in members:
        member_name, offset, size = tar.by_index[member]
        key, extension = splitname(member_name)
        if offset + tarfile.BLOCKSIZE + size > len(tar.mmapped_file):  # wids indexes a member the shard ends inside
            return f"{member_name}: cut off (the shard ends inside it)"
        spans[extension[1:].lower()] = member
    if LATENTS in spans:
        if IDS not in spans:
            return f"{key}: needs {IDS} beside {LATENTS}; has {sorted(spans)}"
        header = latent_header(tar.get_at_index(spans[LATENTS])[1])
        if header is None:
            return f"{key}.{LATENTS}: no readable header with encoder, resolution and bucket"
        (width, height), encoding = header
        return key, width / height, encoding
    image_extension = next((extension for extension in IMAGE_FORMATS if extension in spans), None)
    if image_extension is None or CAPTION not in spans:
        return f"{key}: needs an image (jpg/png/webp) and a txt member; has {sorted(spans)}"
    record = tar.get_at_index(spans[RECORD])[1] if RECORD in spans else None
    aspect = aspect_from_metadata(record) or aspect_from_header(tar.get_at_index(spans[image_extension])[1], image_extension)
    if aspect is None:
        return f"{key}.{image_extension}: not a readable {IMAGE_FORMATS[image_extension]} image"
    return key, aspect, None


def latent_header(data: bytes) -> tuple[tuple[int, int], tuple[str, int]] | None:
    """((bucket width, height), (encoder identity, resolution)) from a latents member's safetensors header."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(bytes(data[8:8 + length]))["__metadata__"]
        width, height = (int(side) for side in metadata["bucket"].split("x"))
        return (width, height), (metadata["encoder"], int(metadata["resolution"]))
    except (struct.error, ValueError, KeyError, TypeError):
        return None


def aspect_from_metadata(record: bytes | None) -> float | None:
    """Width / height from the metadata record: its `aspect_bucket`'s ratio (contracts.aspect_buckets),
    or without one its width and height."""
    try:
        fields = json.loads(record) if record else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(fields, dict):
        return None
    ratio = bucket_ratio(fields.get("aspect_bucket"))
    if ratio is not None:
        return ratio
    width, height = fields.get("width"), fields.get("height")
    if isinstance(width, int) and isinstance(height, int) and width > 0 and height > 0:
        return width / height
    return None


def aspect_from_header(data: bytes, extension: str) -> float | None:
    """Width / height from the image's header (Pillow reads the size without decoding the pixels)."""
    try:
        with Image.open(io.BytesIO(data), formats=[IMAGE_FORMATS[extension]]) as image:
            width, height = image.size
    except Exception:  # noqa: BLE001 - whatever Pillow raises, the sample is unreadable
        return None
    return width / height if width and height else None


# ---------------------------------------------------------------- read


class ShardReader:
    """The members of an index's samples, read by wids; each process maps the shards it touches itself."""

    def __init__(self, index: ShardIndex):
        self.index = index
        self._shards: dict[int, IndexedTarSamples] = {}  # shard number -> wids' reader, opened per process

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_shards": {}}  # mapped shards do not cross into spawned workers

    def read(self, row: int) -> dict[str, bytes]:
        """The members of a row's sample: lower-case extension -> bytes."""
        number = int(self.index.shard[row])
        if number not in self._shards:
            self._shards[number] = IndexedTarSamples(path=self.index.shards[number])
        sample = self._shards[number][int(self.index.sample[row])]
        return {extension[1:].lower(): member.getvalue() for extension, member in sample.items() if extension != "__key__"}


def sample_source(record: bytes | None) -> tuple[str, str]:
    """(partner, license) from a sample's JSON record (docs/metadata.md); `unknown` where it has none."""
    try:
        fields = json.loads(record) if record else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        fields = {}
    fields = fields if isinstance(fields, dict) else {}
    return (str(fields.get("partner") or UNKNOWN), str(fields.get("license") or UNKNOWN))
