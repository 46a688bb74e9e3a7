"""core.dedup: the near-duplicate band index over perceptual hashes, in the pipeline table."""

from __future__ import annotations

import pytest

from atelier.local.provision import Provisioned
from core import aws
from core.dedup import band_keys, nearest, remember

BASE = "0123456789abcdef"
FIRST, SECOND, THIRD = "a" * 64, "b" * 64, "c" * 64  # sample sha256s


def flip(phash: str, *bits: int) -> str:
    """`phash` with the given bits inverted; bit 63 is the first hex digit (band 0), bit 0 the last."""
    value = int(phash, 16)
    for bit in bits:
        value ^= 1 << bit
    return f"{value:016x}"


@pytest.fixture
def table(stack: Provisioned) -> str:
    return stack.outputs["PipelineTableName"]


def test_band_keys_split_the_hash_into_four_16_bit_bands() -> None:
    assert band_keys(BASE) == ["PHASH#0#0123", "PHASH#1#4567", "PHASH#2#89ab", "PHASH#3#cdef"]


@pytest.mark.parametrize("bits", [(63,), (63, 40), (63, 40, 20), (5, 6, 7), (48, 32, 16)])
def test_hashes_within_three_bits_share_a_band_key(bits: tuple[int, ...]) -> None:
    assert set(band_keys(BASE)) & set(band_keys(flip(BASE, *bits)))


def test_nearest_finds_every_sample_within_the_distance_and_none_beyond(table: str) -> None:
    # GIVEN one indexed sample
    remember(table, FIRST, BASE)
    queries = {
        "same hash": (flip(BASE), (FIRST, 0)),
        "1 bit": (flip(BASE, 63), (FIRST, 1)),
        "2 bits, two bands": (flip(BASE, 63, 40), (FIRST, 2)),
        "3 bits, three bands": (flip(BASE, 63, 40, 20), (FIRST, 3)),
        "3 bits, one band": (flip(BASE, 0, 1, 2), (FIRST, 3)),
        "4 bits, one band (looked up, too far)": (flip(BASE, 0, 1, 2, 3), None),
        "4 bits, one per band": (flip(BASE, 63, 40, 20, 5), None),
        "every bit": (flip(BASE, *range(64)), None),
    }

    # WHEN each is looked up with the widest distance the index supports
    found = {name: nearest(table, phash, 3, exclude=SECOND) for name, (phash, _) in queries.items()}

    assert found == {name: expected for name, (_, expected) in queries.items()}


def test_nearest_honours_a_smaller_distance(table: str) -> None:
    remember(table, FIRST, BASE)

    found = [nearest(table, flip(BASE, *range(bits)), max_distance=1, exclude=SECOND) for bits in (0, 1, 2)]

    assert found == [(FIRST, 0), (FIRST, 1), None]


def test_nearest_excludes_the_sample_itself(table: str) -> None:
    remember(table, FIRST, BASE)
    assert nearest(table, BASE, 3, exclude=FIRST) is None

    remember(table, SECOND, flip(BASE, 10))

    assert nearest(table, BASE, 3, exclude=FIRST) == (SECOND, 1)


def test_nearest_returns_the_closest_sample(table: str) -> None:
    remember(table, FIRST, flip(BASE, 63, 40, 20))
    remember(table, SECOND, flip(BASE, 7))
    remember(table, THIRD, flip(BASE, 60, 61))

    assert nearest(table, BASE, 3, exclude="d" * 64) == (SECOND, 1)


def test_remembering_twice_indexes_once(table: str) -> None:
    remember(table, FIRST, BASE)
    remember(table, FIRST, BASE)
    remember(table, SECOND, flip(BASE, 0))  # shares bands 0..2, not band 3

    entries = {key: (aws.get_item(table, key) or {}).get("entries") for key in band_keys(BASE)}

    both = {f"{FIRST}:{BASE}", f"{SECOND}:{flip(BASE, 0)}"}
    assert entries == {"PHASH#0#0123": both, "PHASH#1#4567": both, "PHASH#2#89ab": both,
                       "PHASH#3#cdef": {f"{FIRST}:{BASE}"}}
