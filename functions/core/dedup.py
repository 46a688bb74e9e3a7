"""Near-duplicate search over perceptual hashes, indexed in the pipeline table.

Each 64-bit hash is split into four 16-bit bands; an item per (band, value) holds the samples
with that band value. Two hashes within 3 bits share at least one band exactly (pigeonhole), so
looking up four items finds every near duplicate within that distance. Exact duplicates are the
sample record's own conditional write (records.sample_pk).
"""

from __future__ import annotations

from core import aws
from core.images import hamming

BANDS = 4
BAND_HEX = 16 // BANDS  # a hash is 16 hex digits


def band_keys(phash: str) -> list[str]:
    return [f"PHASH#{i}#{phash[i * BAND_HEX:(i + 1) * BAND_HEX]}" for i in range(BANDS)]


def nearest(table: str, phash: str, max_distance: int, exclude: str) -> tuple[str, int] | None:
    """The closest other sample within `max_distance` bits, as (sha256, distance)."""
    best: tuple[str, int] | None = None
    for key in band_keys(phash):
        for entry in (aws.get_item(table, key) or {}).get("entries", set()):
            sha256, other = entry.split(":")
            distance = hamming(phash, other)
            if sha256 != exclude and distance <= max_distance and (best is None or distance < best[1]):
                best = (sha256, distance)
    return best


def remember(table: str, sha256: str, phash: str) -> None:
    """Add a sample to the index (a set: repeating it is harmless)."""
    for key in band_keys(phash):
        aws.update_item(table, key, "ADD entries :e", {":e": {f"{sha256}:{phash}"}})
