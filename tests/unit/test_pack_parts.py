"""core.pack.seal.plan_parts: the multipart plan that composes a shard from its segments."""

from __future__ import annotations

import random

import pytest

from core.pack.seal import Part, plan_parts

MIN, MAX = 5 << 20, 5 << 30


def covered(parts: list[Part]) -> list[tuple[int, int, int]]:
    """The byte ranges of all parts, in order, adjacent ranges of one segment merged."""
    ranges: list[tuple[int, int, int]] = []
    for piece in (p for part in parts for p in part.pieces):
        if ranges and ranges[-1][0] == piece[0] and ranges[-1][2] == piece[1]:
            ranges[-1] = (piece[0], ranges[-1][1], piece[2])
        elif piece[2] > piece[1]:
            ranges.append(piece)
    return ranges


def part_size(part: Part) -> int:
    return sum(end - start for _, start, end in part.pieces)


@pytest.mark.parametrize("seed", range(200))
def test_parts_cover_every_segment_in_order_and_respect_s3s_sizes(seed: int) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, MIN - 1), rng.randint(MIN, 3 * MIN), rng.randint(1, 600) << 10])
             for _ in range(rng.randint(1, 30))]

    parts = plan_parts(sizes, MIN, MAX)

    assert covered(parts) == [(i, 0, size) for i, size in enumerate(sizes)]
    assert all(MIN <= part_size(p) <= MAX for p in parts[:-1])
    assert parts[-1].last and not parts[-1].copy and not any(p.last for p in parts[:-1])
    assert all(len(p.pieces) == 1 for p in parts if p.copy)
    assert all(part_size(p) < 2 * MIN for p in parts if not p.copy)  # memory bound of the sealer
    assert len(parts) <= 2 * len(sizes) + 1


def test_large_segments_are_copied_whole_and_the_trailer_is_its_own_last_part() -> None:
    assert plan_parts([MIN, 2 * MIN], MIN, MAX) == [
        Part(((0, 0, MIN),), copy=True), Part(((1, 0, 2 * MIN),), copy=True), Part((), copy=False, last=True)]


def test_small_segments_are_gathered_and_a_large_one_lends_its_first_bytes() -> None:
    assert plan_parts([MIN // 2, 3 * MIN], MIN, MAX) == [
        Part(((0, 0, MIN // 2), (1, 0, MIN // 2)), copy=False),
        Part(((1, MIN // 2, 3 * MIN),), copy=True), Part((), copy=False, last=True)]


def test_a_segment_larger_than_a_part_is_copied_in_ranges() -> None:
    parts = plan_parts([11 << 30], MIN, MAX)

    assert [p.pieces for p in parts[:-1]] == [((0, 0, (11 << 30) // 3),), ((0, (11 << 30) // 3, 2 * (11 << 30) // 3),),
                                              ((0, 2 * (11 << 30) // 3, 11 << 30),)]
