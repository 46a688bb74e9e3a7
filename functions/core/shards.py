"""The WebDataset shard layout: the only place in functions/ that knows it."""

from __future__ import annotations

import hashlib
import io
import tarfile
from typing import Iterable

from core.models import Sample

SHARD_PREFIX = "shards/"


def member_files(sample: Sample, image: bytes) -> list[tuple[str, bytes]]:
    """The three members of one sample, sharing the dot-free key `<sha256>`."""
    key = sample.sha256
    return [
        (f"{key}.{sample.extension}", image),
        (f"{key}.json", sample.model_dump_json().encode()),
        (f"{key}.txt", sample.caption.encode()),
    ]


def shard_id_for(sample_keys: Iterable[str]) -> str:
    """Same samples -> same id, so a redelivered batch rewrites the same object."""
    digest = hashlib.sha256("\n".join(sorted(sample_keys)).encode()).hexdigest()
    return f"shard-{digest[:32]}"


def shard_key(shard_id: str) -> str:
    return f"{SHARD_PREFIX}{shard_id}.tar"


def build_shard(samples: Iterable[tuple[Sample, bytes]]) -> bytes:
    """A POSIX tar with fixed metadata and key order: the same input gives the same bytes."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for sample, image in sorted(samples, key=lambda pair: pair[0].sha256):
            for name, data in member_files(sample, image):
                tar.addfile(_tarinfo(name, len(data)), io.BytesIO(data))
    return buffer.getvalue()


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info
