"""A sample's `aspect_bucket`: the named aspect ratio nearest its width / height ("16:9"), which
ingest records and the trainer reads back as that ratio (trainer/data/shards.py)."""

from __future__ import annotations

import math

# Aspect-ratio buckets (width / height), named as people name them; nearest in log space.
ASPECT_BUCKETS: dict[str, float] = {
    "1:4": 1 / 4, "1:3": 1 / 3, "1:2": 1 / 2, "9:16": 9 / 16, "2:3": 2 / 3, "3:4": 3 / 4, "4:5": 4 / 5,
    "1:1": 1.0, "5:4": 5 / 4, "4:3": 4 / 3, "3:2": 3 / 2, "16:9": 16 / 9, "2:1": 2.0, "3:1": 3.0, "4:1": 4.0,
}


def aspect_bucket(width: int, height: int) -> str:
    ratio = math.log(width / height)
    return min(ASPECT_BUCKETS, key=lambda name: abs(math.log(ASPECT_BUCKETS[name]) - ratio))


def bucket_ratio(name: object) -> float | None:
    """The width / height a bucket's name stands for; None for anything that is not one of them."""
    return ASPECT_BUCKETS.get(name) if isinstance(name, str) else None
