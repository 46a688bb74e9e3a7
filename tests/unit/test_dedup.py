"""core.ingest.dedup: the near-duplicate band index over perceptual hashes, in the pipeline table, and the
colour signatures that tell a recolouring from a copy."""

from __future__ import annotations

import io
import itertools
from collections.abc import Iterator

import pytest
from botocore.exceptions import ClientError
from moto.dynamodb.exceptions import ItemSizeTooLarge
from moto.dynamodb.parsing.executors import UpdateExpressionExecutor
from PIL import Image

from atelier.catalog import make_catalog
from atelier.local.provision import Provisioned
from contracts import pipeline_table
from core import aws
from core.ingest import dedup, images
from core.ingest.dedup import Near, band_keys, index_keys

pytestmark = pytest.mark.slow(seconds=25)
BASE = "0123456789abcdef"
FIRST, SECOND, THIRD = "a" * 64, "b" * 64, "c" * 64  # sample sha256s
GREY = "80" * 32  # the colour signature of any grey picture: every cell's Cb and Cr at 128
RED_TOP = "80" * 4 + "6a" * 4 + "80" * 24  # Cb 106 in the top row of cells: 22 levels from GREY
# template.yaml's defaults
MAX_DISTANCE, MAX_COLOUR_DISTANCE = 3, 16


def remember(table: str, sha256: str, phash: str, colour: str = GREY) -> None:
    """The luminance tests' samples are all one colour."""
    dedup.remember(table, sha256, phash, colour)


def nearest(table: str, phash: str, max_distance: int, exclude: str, colour: str = GREY) -> tuple[str, int] | None:
    """(sha256, bits) of the nearest sample of the same colour, as the luminance tests compare it."""
    found = dedup.nearest(table, phash, colour, max_distance, MAX_COLOUR_DISTANCE, exclude)
    return (found.sha256, found.distance) if found else None


def flip(phash: str, *bits: int) -> str:
    """`phash` with the given bits inverted; bit 63 is the first hex digit (band 0), bit 0 the last."""
    value = int(phash, 16)
    for bit in bits:
        value ^= 1 << bit
    return f"{value:016x}"


DYNAMODB_ITEM_LIMIT = 400 * 1024  # bytes of attribute names and values, the key included


@pytest.fixture
def table(stack: Provisioned) -> str:
    return stack.outputs["PipelineTableName"]


@pytest.fixture
def item_size_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DynamoDB's 400 KB item limit on every update. moto 5.2 checks it only when an attribute is
    assigned: an ADD to an existing set grows the set in place, past any size, without a word."""
    execute = UpdateExpressionExecutor.execute

    def checked(self: UpdateExpressionExecutor, node: object = None) -> None:
        execute(self, node)
        if node is None and self.item.size() > DYNAMODB_ITEM_LIMIT:
            raise ItemSizeTooLarge  # moto's update_item answers it as DynamoDB does, a ValidationException

    monkeypatch.setattr(UpdateExpressionExecutor, "execute", checked)
    yield


def sha(n: int) -> str:
    return f"{n:064x}"


def full_counters(table: str) -> dict[str, int]:
    return {i["pk"]: int(i["full_keys"]) for i in aws.scan_prefix(table, pipeline_table.PHASH_FULL_PREFIX)}


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
    remember(table, SECOND, flip(BASE, 0))  # the last hex digit: band 3's keys and each sub-band 3 differ

    entries = {key: (aws.get_item(table, key) or {}).get("entries") for key in index_keys(BASE)}

    both = {dedup.entry(FIRST, BASE, GREY), dedup.entry(SECOND, flip(BASE, 0), GREY)}
    first = {dedup.entry(FIRST, BASE, GREY)}
    assert entries == {key: first if key.startswith("PHASH#3#") or key.split("#")[3] == "3" else both
                       for key in index_keys(BASE)}


def test_index_keys_pair_each_band_with_each_12_bit_sub_band_of_the_rest() -> None:
    assert index_keys(BASE) == [
        "PHASH#0#0123#0#456", "PHASH#0#0123#1#789", "PHASH#0#0123#2#abc", "PHASH#0#0123#3#def",
        "PHASH#1#4567#0#012", "PHASH#1#4567#1#389", "PHASH#1#4567#2#abc", "PHASH#1#4567#3#def",
        "PHASH#2#89ab#0#012", "PHASH#2#89ab#1#345", "PHASH#2#89ab#2#67c", "PHASH#2#89ab#3#def",
        "PHASH#3#cdef#0#012", "PHASH#3#cdef#1#345", "PHASH#3#cdef#2#678", "PHASH#3#cdef#3#9ab"]


def test_every_hash_within_three_bits_shares_an_index_key() -> None:
    # every one of the 43,744 ways to flip up to 3 of the 64 bits
    keys = set(index_keys(BASE))
    missed = [bits for n in (1, 2, 3) for bits in itertools.combinations(range(64), n)
              if not keys & set(index_keys(flip(BASE, *bits)))]

    assert missed == []


def test_the_item_size_check_refuses_a_set_grown_past_400_kb(table: str, item_size_limit: None) -> None:
    # GIVEN an item whose set holds 4,000 entries of 81 bytes (324 KB)
    for start in range(0, 4000, 1000):
        aws.update_item(table, "SIZE#probe", "ADD entries :e", {":e": {f"{sha(n)}:{BASE}" for n in range(start, start + 1000)}})

    # WHEN 1,100 more would take it to 413 KB THEN DynamoDB's answer comes back
    with pytest.raises(ClientError, match="exceeded the maximum allowed size"):
        aws.update_item(table, "SIZE#probe", "ADD entries :e", {":e": {f"{sha(n)}:{BASE}" for n in range(4000, 5100)}})


FLAT = "0000000000000000"  # the dHash of a flat image: every band value shared by all of them


def test_a_band_value_shared_past_the_old_item_limit_never_fails(table: str, item_size_limit: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN keys that fill at 100 members, so that 5,100 samples take seconds (the next test shows
    # an item at the real cap fits)
    monkeypatch.setattr(dedup, "MAX_MEMBERS", 100)
    remember(table, FIRST, BASE)

    # WHEN 5,100 flat images come: past the ~5,050 entries of 81 bytes that one 400 KB item of the
    # old design (PHASH#<band>#<value> holding every sample of the band value) could take
    for n in range(5100):
        remember(table, sha(n), FLAT)

    # THEN each of their 16 keys took 100, refused the next, and is full, counted once
    items = aws.batch_get_items(table, index_keys(FLAT))
    assert {key: ("full_at" in item, "entries" in item) for key, item in items.items()} == {
        key: (True, False) for key in index_keys(FLAT)}
    assert full_counters(table) == {f"PHASHFULL#{band}#{sub}": 1 for band in range(4) for sub in range(4)}
    # AND a full key is no longer read: another flat image finds nothing to compare with,
    assert nearest(table, FLAT, 3, exclude=sha(9999)) is None
    # while an ordinary sample is found as before
    assert nearest(table, flip(BASE, 1), 3, exclude=SECOND) == (FIRST, 1)


def test_a_key_at_the_real_cap_fits_in_an_item_and_the_next_sample_fills_it(table: str,
                                                                            item_size_limit: None) -> None:
    # GIVEN the 16 keys of FLAT at MAX_MEMBERS entries, of the length every entry has (written in one
    # ADD per key: through remember, 16,000 writes)
    for key in index_keys(FLAT):
        aws.update_item(table, key, "ADD entries :e", {":e": {dedup.entry(sha(n), FLAT, GREY)
                                                               for n in range(dedup.MAX_MEMBERS)}})

    # WHEN one more flat image comes
    remember(table, FIRST, FLAT)

    # THEN nothing failed and each key is full, FIRST in none
    items = aws.batch_get_items(table, index_keys(FLAT))
    assert {key: sorted(item) for key, item in items.items()} == {key: ["full_at", "pk"] for key in index_keys(FLAT)}
    assert len(full_counters(table)) == 16


@pytest.fixture
def small_cap(monkeypatch: pytest.MonkeyPatch) -> int:
    """Keys fill at 3 members, so the rules of a full key are seen without writing thousands."""
    monkeypatch.setattr(dedup, "MAX_MEMBERS", 3)
    return 3


def test_a_key_takes_max_members_and_fills_at_the_next(table: str, small_cap: int) -> None:
    # GIVEN 3 samples that differ from BASE in the first hex digit only: they share with it the keys
    # of bands 1..3 whose sub-band leaves that digit out, PHASH#1#4567#1#389 among them
    hashes = [flip(BASE, 63 - n) for n in range(small_cap)]
    for n, phash in enumerate(hashes):
        remember(table, sha(n), phash)
    shared = [f"PHASH#{band}#{value}#{sub}#{rest}" for band, value, subs in (
        (1, "4567", ("389", "abc", "def")), (2, "89ab", ("345", "67c", "def")), (3, "cdef", ("345", "678", "9ab")))
        for sub, rest in zip((1, 2, 3), subs)]
    assert aws.get_item(table, shared[0])["entries"] == {dedup.entry(sha(n), h, GREY) for n, h in enumerate(hashes)}

    # WHEN BASE comes, one more than the cap on those 9 keys
    remember(table, FIRST, BASE)

    # THEN they are full, their members dropped, each counted once; BASE's other keys hold it
    items = aws.batch_get_items(table, index_keys(BASE))
    assert sorted(key for key, item in items.items() if "full_at" in item and "entries" not in item) == sorted(shared)
    assert all(items[key]["entries"] == {dedup.entry(FIRST, BASE, GREY)} for key in set(index_keys(BASE)) - set(shared))
    assert full_counters(table) == {f"PHASHFULL#{band}#{sub}": 1 for band in (1, 2, 3) for sub in (1, 2, 3)}


def test_a_redelivered_member_of_a_key_at_its_cap_does_not_fill_it(table: str, small_cap: int) -> None:
    for n in range(small_cap):
        remember(table, sha(n), BASE)

    remember(table, sha(0), BASE)
    remember(table, sha(small_cap - 1), BASE)

    assert all(item.get("entries") == {dedup.entry(sha(n), BASE, GREY) for n in range(small_cap)}
               for item in aws.batch_get_items(table, index_keys(BASE)).values())
    assert full_counters(table) == {}


def test_a_full_key_is_counted_once_however_often_it_is_overflowed(table: str, small_cap: int) -> None:
    for n in range(small_cap + 5):
        remember(table, sha(n), BASE)
    remember(table, sha(small_cap), BASE)  # the one that filled them, redelivered

    assert full_counters(table) == {f"PHASHFULL#{band}#{sub}": 1 for band in range(4) for sub in range(4)}
    assert nearest(table, BASE, 3, exclude=FIRST) is None


def test_a_full_key_no_longer_finds_what_only_it_would(table: str, small_cap: int) -> None:
    # GIVEN band 0's key PHASH#0#0123#0#456 full (the first seven hex digits of BASE, shared by 4 samples)
    for n in range(small_cap + 1):
        remember(table, sha(n), f"0123456{n:x}ffffffff")
    # AND FIRST, filed under BASE's 15 other keys
    remember(table, FIRST, BASE)
    assert "full_at" in aws.get_item(table, "PHASH#0#0123#0#456")

    # THEN a hash 3 bits away that shares another key with BASE finds FIRST; one whose bits (in
    # hex digits 7, 10 and 13) leave it only the full key does not: the loss a full key accepts
    assert nearest(table, flip(BASE, 0, 1, 2), 3, exclude=SECOND) == (FIRST, 3)
    only_the_full_key = flip(BASE, 32, 20, 8)
    assert set(index_keys(only_the_full_key)) & set(index_keys(BASE)) == {"PHASH#0#0123#0#456"}
    assert nearest(table, only_the_full_key, 3, exclude=SECOND) is None


def test_nearest_prefers_the_smaller_sha256_of_equally_close_samples(table: str) -> None:
    remember(table, SECOND, flip(BASE, 7))
    remember(table, FIRST, flip(BASE, 9))

    assert nearest(table, BASE, 3, exclude=THIRD) == (FIRST, 1)


# --- colour ----------------------------------------------------------------------------------------

def test_a_sample_of_other_colours_is_not_a_near_duplicate(table: str) -> None:
    remember(table, FIRST, BASE, GREY)

    assert dedup.nearest(table, BASE, RED_TOP, MAX_DISTANCE, MAX_COLOUR_DISTANCE, exclude=SECOND) is None
    assert dedup.nearest(table, flip(BASE, 9), GREY, MAX_DISTANCE, MAX_COLOUR_DISTANCE, exclude=SECOND) == \
        Near(FIRST, 1, 0)


@pytest.mark.parametrize(("max_colour_distance", "found"), [(21, None), (22, Near(FIRST, 0, 22)),
                                                            (255, Near(FIRST, 0, 22))])
def test_the_colour_distance_is_a_parameter(table: str, max_colour_distance: int, found: Near | None) -> None:
    remember(table, FIRST, BASE, RED_TOP)

    assert dedup.nearest(table, BASE, GREY, MAX_DISTANCE, max_colour_distance, exclude=SECOND) == found


def test_an_entry_filed_before_colour_signatures_is_judged_by_its_hash_alone(table: str) -> None:
    # GIVEN FIRST filed as remember wrote entries before colour signatures: sha256:phash
    for key in index_keys(BASE):
        aws.update_item(table, key, "ADD entries :e", {":e": {f"{FIRST}:{BASE}"}})

    # THEN a sample of any colour within the distance in bits is its near duplicate, colour not compared
    assert dedup.nearest(table, flip(BASE, 5), RED_TOP, MAX_DISTANCE, MAX_COLOUR_DISTANCE, exclude=SECOND) == \
        Near(FIRST, 1, None)
    # AND a sample without a signature (a record made before them) is compared by its hash alone too
    remember(table, SECOND, flip(BASE, 60), RED_TOP)
    assert dedup.nearest(table, flip(BASE, 60), "", MAX_DISTANCE, MAX_COLOUR_DISTANCE, exclude=THIRD) == \
        Near(SECOND, 0, None)
    # AND a sample remembered without one is filed in the old form, which the next lookup reads the same way
    dedup.remember(table, THIRD, BASE, "")
    assert f"{THIRD}:{BASE}" in aws.get_item(table, index_keys(BASE)[0])["entries"]


def test_catalog_pictures_of_other_colours_are_never_near_duplicates() -> None:
    # GIVEN the shapes catalog: three shapes in six colours on six grounds, pictures that differ
    # mostly in colour (a colour-blind check would leave out most of such a set)
    pictures = []
    for item in make_catalog(96):
        rgb = Image.open(io.BytesIO(item.image)).convert("RGB")
        _, colour, shape, _, _, ground, _ = item.sidecar["caption"].split()
        pictures.append(((colour, shape, ground), images.dhash(rgb), images.colour_signature(rgb)))

    # WHEN every pair of pictures that differ in a colour is compared
    pairs = [(dedup.distances(h1, c1, h2, c2), (a, b)) for (a, h1, c1), (b, h2, c2) in itertools.combinations(pictures, 2)
             if (a[0], a[2]) != (b[0], b[2])]

    # THEN dHash alone calls many of them near duplicates (86 with Pillow 13), with colours compared none
    assert sum(bits <= MAX_DISTANCE for (bits, _), _ in pairs) >= 80
    assert [names for (bits, colour), names in pairs if dedup.is_near(bits, colour, MAX_DISTANCE, MAX_COLOUR_DISTANCE)] \
        == []


def test_a_samples_index_writes_are_sent_at_once_not_one_after_another(table: str, monkeypatch) -> None:
    """16 keys, 16 independent writes: one round trip's latency, not sixteen (on Lambda, the
    difference is most of an upload's ingest time)."""
    import threading
    keys = index_keys(BASE)
    barrier = threading.Barrier(len(keys), timeout=10)  # passes only once all 16 are in flight together
    written = []
    real = aws.update_item

    def update_item(table_name: str, key: str, *args, **kwargs) -> bool:
        barrier.wait()
        written.append(key)
        return real(table_name, key, *args, **kwargs)

    monkeypatch.setattr(aws, "update_item", update_item)
    remember(table, FIRST, BASE)
    assert sorted(written) == sorted(keys)
    assert nearest(table, flip(BASE, 1), MAX_DISTANCE, exclude=SECOND) == (FIRST, 1)


def test_remember_with_the_items_nearest_read_reads_nothing_more(table: str, monkeypatch) -> None:
    remember(table, FIRST, BASE)
    items = dedup.index_items(table, BASE)
    monkeypatch.setattr(aws, "batch_get_items", lambda *a, **k: pytest.fail("read again"))
    assert dedup.nearest(table, flip(BASE, 2), GREY, MAX_DISTANCE, MAX_COLOUR_DISTANCE, SECOND, items=items).sha256 == FIRST
    dedup.remember(table, FIRST, BASE, GREY, items=items)  # a redelivery: every key holds it, nothing written
