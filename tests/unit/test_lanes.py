"""core.pack.lanes: a sample's lane is stable and lanes fill evenly; invocations start at different lanes."""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import pytest

from core.pack.lanes import MAX_LANES, lane_of, visiting_order


def sha(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def test_a_sample_always_has_the_same_lane() -> None:
    assert [lane_of(sha(n), 4) for n in range(50)] == [lane_of(sha(n), 4) for n in range(50)]
    assert {lane_of(sha(n), 1) for n in range(50)} == {0}


@pytest.mark.parametrize("lanes", [2, 4, 64])
def test_samples_spread_evenly_over_the_lanes(lanes: int) -> None:
    counts = Counter(lane_of(sha(n), lanes) for n in range(20_000))
    expected = 20_000 / lanes
    assert set(counts) == set(range(lanes))
    assert max(abs(c - expected) for c in counts.values()) < 5 * expected ** 0.5  # five sigma


@pytest.mark.parametrize("lanes", [0, MAX_LANES + 1])
def test_a_lane_count_outside_the_template_range_is_refused(lanes: int) -> None:
    with pytest.raises(ValueError, match="must be 1..64"):
        lane_of(sha(0), lanes)


def test_invocations_visit_every_lane_once_from_different_starts() -> None:
    rng = random.Random(0)
    orders = [visiting_order([0, 1, 2, 3], rng) for _ in range(40)]
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    assert all(order == [order[0], *[(order[0] + k) % 4 for k in (1, 2, 3)]] for order in orders)  # a rotation
    assert {order[0] for order in orders} == {0, 1, 2, 3}
    assert visiting_order([]) == []
