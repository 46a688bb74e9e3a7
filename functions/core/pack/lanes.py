"""Pack lanes: N open shards, each with its own head, so that packers append side by side.

A sample's lane is a hash of its sha256, chosen once by ingest and kept in the sample's record, so
every delivery of one sample (redeliveries, duplicates, either side of a change of PackLanes) meets
the same head, and the single-head protocol's exactly-once holds per lane (docs/pack.md). An
invocation visits the lanes of its batch starting at a random one, so that concurrent invocations
are mostly at different heads: with 2 packers per lane, about 2 contend for a head whatever N is.
"""

from __future__ import annotations

import random
from typing import TypeVar

MAX_LANES = 64  # template.yaml's largest PackLanes; the seal timer looks at this many heads

T = TypeVar("T")


def lane_of(sha256: str, lanes: int) -> int:
    """The lane of a sample: the first 32 bits of its sha256, modulo the lane count."""
    if not 1 <= lanes <= MAX_LANES:
        raise ValueError(f"{lanes} pack lanes: must be 1..{MAX_LANES}")
    return int(sha256[:8], 16) % lanes


def visiting_order(lanes: list[T], rng: random.Random | None = None) -> list[T]:
    """The lanes in order, rotated to start at a random one."""
    if not lanes:
        return []
    start = (rng or random).randrange(len(lanes))
    return lanes[start:] + lanes[:start]
