"""core.ingest.images' perceptual hash (dHash) and the colour signature, what dHash cannot see."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from PIL import Image

from core.ingest import images
from core.ingest.images import DecodePolicy
from tests.support import hue_turned
from tests.unit.images_helpers import (  # noqa: F401  (restore_pillow_limit: fixtures)
    POLICY,
    photo,
    policy,
    restore_pillow_limit,
    save,
    scene,
)


# --- the perceptual hash ---------------------------------------------------------------------------

def test_dhash_of_a_flat_image_is_all_zeros() -> None:
    assert images.dhash(Image.new("RGB", (64, 64), (9, 9, 9))) == "0000000000000000"


def test_dhash_of_a_left_to_right_fade_to_black_is_all_ones() -> None:
    fade = Image.linear_gradient("L").rotate(-90).resize((90, 80))  # white on the left, black on the right
    assert fade.getpixel((0, 40)) > fade.getpixel((89, 40))

    assert images.dhash(fade) == "ffffffffffffffff"


def dhash_of(data: bytes) -> str:
    return images.dhash(images.decode(data, POLICY).rgb)


@pytest.fixture(scope="module")
def original_hash() -> str:
    return dhash_of(save(scene((512, 384)), "PNG"))


def test_dhash_of_a_lossless_copy_is_equal(original_hash: str) -> None:
    assert dhash_of(save(scene((512, 384)), "WEBP", lossless=True)) == original_hash


@pytest.mark.parametrize("copy", [
    pytest.param(lambda: save(scene((512, 384)).resize((256, 192)), "JPEG", quality=40), id="half-size-jpeg-q40"),
    pytest.param(lambda: save(scene((512, 384)), "WEBP", quality=50), id="webp-q50"),
    pytest.param(lambda: save(scene((1024, 768)), "JPEG", quality=95), id="larger-jpeg-decoded-in-draft"),
    pytest.param(lambda: save(scene((300, 225)), "PNG"), id="smaller-png"),
])
def test_dhash_of_a_reencoded_copy_is_within_the_near_duplicate_distance(original_hash: str,
                                                                          copy: Callable[[], bytes]) -> None:
    assert images.hamming(dhash_of(copy()), original_hash) <= 3


def plain_lanczos_dhash(image: Image.Image) -> str:
    """The hash as records made before 2026-12 computed it: one Lanczos resample of every pixel."""
    pixels = image.convert("L").resize((9, 8), Image.Resampling.LANCZOS).tobytes()
    bits = "".join("1" if pixels[row * 9 + col] > pixels[row * 9 + col + 1] else "0"
                   for row in range(8) for col in range(8))
    return f"{int(bits, 2):016x}"


@pytest.fixture(scope="module")
def camera_jpegs() -> list[bytes]:
    return [save(photo((1600, 1200), seed), "JPEG", quality=90) for seed in range(12)]


@pytest.mark.parametrize(("store", "decoded_width"), [
    pytest.param(policy(max_side=800), 800, id="re-encoded-draft-1/2"),
    pytest.param(policy(max_side=2048), 200, id="kept-draft-1/8"),
])
def test_dhash_from_a_dct_scaled_decode_is_within_the_near_duplicate_distance_of_the_full_decode(
        camera_jpegs: list[bytes], store: DecodePolicy, decoded_width: int) -> None:
    # GIVEN twelve photo-like JPEGs, decoded at full scale (re-encoded at their own size) and drafted
    full = [images.decode(data, policy(max_side=1600, reencode="always")) for data in camera_jpegs]
    drafted = [images.decode(data, store) for data in camera_jpegs]
    assert {d.rgb.width for d in full} == {1600} and {d.rgb.width for d in drafted} == {decoded_width}

    distances = [images.hamming(images.dhash(f.rgb), images.dhash(d.rgb)) for f, d in zip(full, drafted, strict=True)]

    # THEN every pair is a near duplicate, and most hashes are the same
    assert max(distances) <= 3 and distances.count(0) >= 8, distances


def test_dhash_is_within_the_near_duplicate_distance_of_the_plain_lanczos_hash(camera_jpegs: list[bytes]) -> None:
    # dhash box-averages before its resample (reducing_gap); records hashed before still match new ones.
    full = [images.decode(data, policy(max_side=1600, reencode="always")).rgb for data in camera_jpegs]

    distances = [images.hamming(images.dhash(rgb), plain_lanczos_dhash(rgb)) for rgb in full]

    assert max(distances) <= 3 and distances.count(0) >= 8, distances


def test_dhash_of_a_different_picture_is_far(original_hash: str) -> None:
    assert images.hamming(dhash_of(save(scene((512, 384), variant=1), "PNG")), original_hash) >= 16


@pytest.mark.parametrize(("a", "b", "distance"), [
    ("0000000000000000", "0000000000000000", 0),
    ("0000000000000000", "0000000000000001", 1),
    ("f000000000000000", "0000000000000000", 4),
    ("0000000000000000", "ffffffffffffffff", 64),
])
def test_hamming_counts_differing_bits(a: str, b: str, distance: int) -> None:
    assert images.hamming(a, b) == distance


# --- the colour signature: what dHash cannot see ------------------------------------------------

COLOUR_DISTANCE = 16  # template.yaml's NEAR_DUPLICATE_COLOUR_DISTANCE


def colour_of(data: bytes) -> str:
    return images.colour_signature(images.decode(data, POLICY).rgb)


@pytest.fixture(scope="module")
def original_colour() -> str:
    return colour_of(save(scene((512, 384)), "PNG"))


@pytest.mark.parametrize("copy", [
    pytest.param(lambda: save(scene((512, 384)).resize((256, 192)), "JPEG", quality=40), id="half-size-jpeg-q40"),
    pytest.param(lambda: save(scene((512, 384)), "JPEG", quality=20, subsampling=2), id="jpeg-q20-4:2:0"),
    pytest.param(lambda: save(scene((512, 384)), "WEBP", quality=50), id="webp-q50"),
    pytest.param(lambda: save(scene((1024, 768)), "JPEG", quality=95), id="larger-jpeg-decoded-in-draft"),
    pytest.param(lambda: save(scene((300, 225)), "PNG"), id="smaller-png"),
])
def test_the_colour_signature_of_a_reencoded_or_rescaled_copy_is_within_the_colour_distance(
        original_colour: str, copy: Callable[[], bytes]) -> None:
    # a few levels at most: far under the threshold, which leaves room for harsher copies
    assert images.colour_distance(colour_of(copy()), original_colour) <= 2


@pytest.mark.parametrize("recolour", [
    pytest.param(lambda image: hue_turned(image, 60), id="hue-turned-60"),
    pytest.param(lambda image: hue_turned(image, 180), id="hue-turned-180"),
    pytest.param(lambda image: Image.merge("YCbCr", [image.convert("YCbCr").getchannel(c) for c in (0, 2, 1)])
                 .convert("RGB"), id="chroma-channels-swapped"),
    pytest.param(lambda image: image.convert("L").convert("RGB"), id="greyscale"),
])
def test_a_recolouring_dhash_cannot_see_is_far_in_colour(original_hash: str, original_colour: str,
                                                        recolour: Callable[[Image.Image], Image.Image]) -> None:
    data = save(recolour(scene((512, 384))), "PNG")

    assert images.hamming(dhash_of(data), original_hash) <= 3  # the same picture to the luminance hash
    assert images.colour_distance(colour_of(data), original_colour) > COLOUR_DISTANCE


def test_the_colour_signature_is_each_cell_s_mean_chroma() -> None:
    # GIVEN a grey picture whose top-left cell (of 4 x 4) is pure red
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    image.paste((255, 0, 0), (0, 0, 16, 16))

    signature = bytes.fromhex(images.colour_signature(image))

    # THEN 16 Cb then 16 Cr: red's in the first cell, grey's 128 in the others
    _, red_cb, red_cr = Image.new("RGB", (1, 1), (255, 0, 0)).convert("YCbCr").getpixel((0, 0))
    assert (len(signature), signature[0], signature[16]) == (32, red_cb, red_cr)
    assert set(signature[1:16] + signature[17:]) == {128}


@pytest.mark.parametrize(("a", "b", "distance"), [
    ("80" * 32, "80" * 32, 0),
    ("80" * 32, "80" * 31 + "90", 16),
    ("ff" + "80" * 31, "00" + "80" * 31, 255),
])
def test_colour_distance_is_the_largest_difference_of_a_cell_s_mean(a: str, b: str, distance: int) -> None:
    assert images.colour_distance(a, b) == distance
