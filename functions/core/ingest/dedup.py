"""Near-duplicate search over perceptual hashes, indexed in the pipeline table.

Two 64-bit hashes within 3 bits share at least one of the four 16-bit bands exactly (pigeonhole),
and, within the 48 bits left once that band is set aside, one of four 12-bit sub-bands (pigeonhole
again). So every hash is filed under 16 keys of 28 bits, `PHASH#<band>#<hex4>#<sub>#<hex3>`, and
the 16 items of a query's keys hold every sample within 3 bits of it (Manku, Jain and Das Sarma,
"Detecting near-duplicates for web crawling", WWW 2007). 28 bits rather than 16, because at 10^9
samples a 16-bit band value is shared by about 15,000 samples on average (a 400 KB item holds about
5,000), while a 28-bit key is shared by about 4.

An item holds at most MAX_MEMBERS samples. The one that would be the next is refused and the key
becomes *full*: its members are dropped, it is never read or written again, and the key's counter
item (`PHASHFULL#<band>#<sub>`) counts it, in the same transaction. A key that common comes from
flat, dark or blank images, not from chance, and tells them apart no better than no key at all.
docs/metadata.md has the design and its numbers. Exact duplicates are the sample record's own
conditional write (records.sample_pk).

The keys find candidates by luminance (dHash); a candidate is a near duplicate only if its colour
signature (images.colour_signature, kept in the entry beside the hash) is close too, since a
recolouring is another picture to a text-to-image model. An entry filed before colour signatures
(`sha256:phash`) is judged by its hash alone, the rule it was filed under (docs/metadata.md).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from aws_lambda_powertools import Logger

from contracts import pipeline_table
from contracts.messages import Sample
from core import aws, telemetry
from core.ingest.images import colour_distance, hamming

logger = Logger(child=True)

BANDS = 4
BAND_HEX = 16 // BANDS  # a hash is 16 hex digits
SUB_BANDS = 4
SUB_HEX = (16 - BAND_HEX) // SUB_BANDS  # the other three bands' 12 hex digits, in four
# 1,000 entries of 146 bytes ("sha256:phash:colour") make an item of about 146 KB: under two
# fifths of DynamoDB's 400 KB, so a full key's last write cannot fail, and 250 times the 4 samples
# a key holds on average at 10^9 samples.
MAX_MEMBERS = 1000


@dataclass(frozen=True)
class Near:
    """The earlier sample a new one is a near duplicate of."""

    sha256: str
    distance: int  # dHash bits
    colour_distance: int | None  # levels; None: one of the two has no colour signature


def distances(phash: str, colour: str, other_phash: str, other_colour: str) -> tuple[int, int | None]:
    """(dHash bits, colour levels) between two samples; the colour None if either lacks a signature."""
    return hamming(phash, other_phash), colour_distance(colour, other_colour) if colour and other_colour else None


def is_near(distance: int, colour: int | None, max_distance: int, max_colour_distance: int) -> bool:
    """Near duplicates are within `max_distance` bits and, where both have a colour signature,
    within `max_colour_distance` levels."""
    return distance <= max_distance and (colour is None or colour <= max_colour_distance)


def flagged(sample: Sample, near: Near) -> Sample:
    """`sample` marked as a near duplicate of `near` (accepted all the same)."""
    return sample.model_copy(update={"near_duplicate_of": near.sha256, "near_duplicate_distance": near.distance,
                                     "near_duplicate_colour_distance": near.colour_distance})


def entry(sha256: str, phash: str, colour: str) -> str:
    """A sample as its index keys hold it; without a signature, in the form entries had before them."""
    return f"{sha256}:{phash}:{colour}" if colour else f"{sha256}:{phash}"


def band_keys(phash: str) -> list[str]:
    """The four 16-bit bands: the first half of each index key."""
    return [pipeline_table.phash_band(i, phash[i * BAND_HEX:(i + 1) * BAND_HEX]) for i in range(BANDS)]


def index_keys(phash: str) -> list[str]:
    """The 16 keys a hash is filed under: each band, with each sub-band of the rest of the hash."""
    keys = []
    for band in range(BANDS):
        rest = phash[:band * BAND_HEX] + phash[(band + 1) * BAND_HEX:]
        keys += [pipeline_table.phash_pk(band, phash[band * BAND_HEX:(band + 1) * BAND_HEX], sub,
                                         rest[sub * SUB_HEX:(sub + 1) * SUB_HEX]) for sub in range(SUB_BANDS)]
    return keys


def index_items(table: str, phash: str) -> dict[str, dict]:
    """The items of a hash's 16 keys (absent ones left out): what `nearest` searches and `remember`
    adds to, read once for both."""
    return aws.batch_get_items(table, index_keys(phash))


def nearest(table: str, phash: str, colour: str, max_distance: int, max_colour_distance: int,
            exclude: str, items: dict[str, dict] | None = None) -> Near | None:
    """The closest other sample that is a near duplicate (`is_near`); of equally close ones (in
    bits), the smallest sha256, so the answer does not depend on the order of a set. `items`: the
    hash's `index_items`, if already read."""
    best: tuple[int, str, int | None] | None = None
    for item in (index_items(table, phash) if items is None else items).values():
        for found in item.get("entries", set()):  # a full key has none
            sha256, other, *other_colour = found.split(":")
            distance, colour_apart = distances(phash, colour, other, other_colour[0] if other_colour else "")
            if sha256 != exclude and is_near(distance, colour_apart, max_distance, max_colour_distance) \
                    and (best is None or (distance, sha256) < best[:2]):
                best = (distance, sha256, colour_apart)
    return Near(best[1], best[0], best[2]) if best else None


def remember(table: str, sha256: str, phash: str, colour: str, items: dict[str, dict] | None = None) -> None:
    """Add a sample to the index under each of its keys that is not full; repeating it adds nothing.
    `items`: the hash's `index_items`, if already read (a key filled since is caught by the condition)."""
    member = entry(sha256, phash, colour)
    found = index_items(table, phash) if items is None else items
    keys = [key for key in index_keys(phash) if _takes(found.get(key, {}), member)]

    def add(key: str) -> bool:
        # The condition admits the entry while the set has room (or holds it already, since ADD
        # then changes nothing); failing it, the set holds MAX_MEMBERS others, or the key is full.
        return aws.update_item(
            table, key, "ADD entries :e", {":e": {member}, ":m": member, ":k": MAX_MEMBERS},
            condition="attribute_not_exists(full_at) AND (attribute_not_exists(entries) "
                      "OR size(entries) < :k OR contains(entries, :m))")

    # The 16 writes are independent: sent at once, they cost one round trip instead of sixteen.
    for key, added in zip(keys, _writers().map(add, keys)):
        if not added:
            _fill(table, key)


def _takes(item: dict, member: str) -> bool:
    """Whether a key's item still needs `member`: a redelivery writes nothing, a full key takes no one."""
    return "full_at" not in item and member not in item.get("entries", set())


@functools.cache
def _writers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=BANDS * SUB_BANDS, thread_name_prefix="dedup")


def _fill(table: str, key: str) -> None:
    """Mark `key` full and count it, once: of two invocations that overflow it, one transaction wins."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    won = aws.transact_updates(table, [
        (key, "SET full_at = :now REMOVE entries", "attribute_not_exists(full_at)", {":now": now}),
        (pipeline_table.phash_full_pk(key), "ADD full_keys :one", "attribute_exists(pk) OR attribute_not_exists(pk)",
         {":one": 1}),
    ], [])
    if won:
        telemetry.count(telemetry.NEAR_DUPLICATE_KEYS_FULL)
        logger.warning("near-duplicate key full: no longer read or written", extra={"key": key,
                                                                                    "members": MAX_MEMBERS})
