"""Catalogue pictures as shards in the packer's own layout (core.pack.shards.build_shard), for benchmarks
that run the trainer's entry points without the stack."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "functions") not in sys.path:
    sys.path.insert(0, str(REPO / "functions"))

from contracts.messages import Sample  # noqa: E402
from core.pack.shards import build_shard  # noqa: E402


def catalog_sample(item, size: int) -> Sample:
    """The metadata record the ingest function would write for a catalogue PNG of `size` px."""
    sha = hashlib.sha256(item.image).hexdigest()
    return Sample(sha256=sha, partner="bench", bucket="bench", key=item.name, format="png", width=size, height=size,
                  size=len(item.image), caption=item.sidecar["caption"], license=item.sidecar["license"],
                  source=item.sidecar["source"], uploaded_at="2026-01-01T00:00:00Z", aspect_bucket="1:1",
                  content_bucket="bench", content_key=item.name, content_sha256=sha)


def write_shards(items: list, folder: Path, per_shard: int, size: int) -> list[Path]:
    """`items` in shards of `per_shard` samples, named 00000.tar, 00001.tar, ...; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, len(items), per_shard):
        path = folder / f"{start // per_shard:05d}.tar"
        path.write_bytes(build_shard((catalog_sample(item, size), item.image) for item in items[start:start + per_shard]))
        paths.append(path)
    return paths
