"""A shard without a sample table, indexed by walking its tar: shards sealed before tables existed,
img2dataset's and other foreign tars (trainer/data/tables.py reads the ones with a table).

wids' `IndexedTarSamples` maps the shard, walks its tar headers into an index and groups the members
into samples (webdataset's rule: the consecutive members sharing the name up to the first dot of
their basename); then each sample's JSON record is read for its aspect ratio (or, without one, the
image header), or a latent sample's safetensors header for its bucket and encoding. Over FastFile
every header and record is a ranged GET: the start-up cost a table removes. Samples keyed in
`exclude` are left out from their headers alone, never read.
"""

import io
import json
import struct
import tarfile
from collections.abc import Collection
from pathlib import Path

import numpy as np
from PIL import Image
from wids.wids import IndexedTarSamples, splitname
from wids.wids_mmtar import MMIndexedTar

from contracts.aspect_buckets import bucket_ratio
from contracts.shard_index import padded
from contracts.shard_members import CAPTION, EMPTY_CAPTION_KEY, IDS, IMAGE_FORMATS, LATENTS, RECORD, TEXT
from trainer.data.tables import ShardRows


def scan_shard(path: str, exclude: Collection[str] = frozenset()) -> tuple[list[tuple[int, str, float]], list[str]]:
    """(rows (sample number as wids counts them, key, aspect), problems) of one shard."""
    rows, problems = _walk(path, frozenset(exclude))[:2]
    return [(number, key, aspect) for number, key, aspect, *_ in rows], problems


def scan_rows(path: str, exclude: frozenset[str]) -> ShardRows:
    """The shard's samples, with the range each one spans, from wids' index of its tar."""
    rows, problems, skipped, encodings = _walk(path, exclude)
    columns = list(zip(*rows)) or [()] * 5
    return ShardRows(np.array(columns[1], dtype=str), np.array(columns[2], dtype=np.float64),
                     np.array(columns[3], dtype=np.int64), np.array(columns[4], dtype=np.int64),
                     np.zeros(len(rows), dtype="V32"), problems, skipped, encodings)


def _walk(path: str, exclude: frozenset[str]) -> tuple[list[tuple[int, str, float, int, int]], list[str], int, set]:
    """(rows (number, key, aspect, offset, size), problems, how many samples `exclude` left out, the
    shard's encodings ((identity, resolution) of its latent samples; None for image samples))."""
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
            key = splitname(tar.by_index[members[0]][0])[0]  # from the header alone
            if key == EMPTY_CAPTION_KEY:  # a family latent shard's empty caption: no sample to train on
                continue
            if exclude and key in exclude:
                skipped += 1
                continue
            row = sample_row(tar, members)
            if isinstance(row, str):
                problems.append(f"{name}/{row}")
                continue
            key, aspect, encoding = row
            start = tar.by_index[members[0]][1]
            _, last, last_size = tar.by_index[members[-1]]
            rows.append((number, key, aspect, start, last + tarfile.BLOCKSIZE + padded(last_size) - start))
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
        if IDS not in spans and TEXT not in spans:
            return f"{key}: needs {IDS} or {TEXT} beside {LATENTS}; has {sorted(spans)}"
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
