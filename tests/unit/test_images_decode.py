"""core.ingest.images' safe decoding: not an image, truncated and corrupt files, the decompression-bomb guard."""

from __future__ import annotations

import io
import struct
from collections.abc import Callable

import pytest
from PIL import Image, ImageDraw

from core.ingest import images
from core.ingest.images import DecodePolicy
from tests.unit.images_helpers import (  # noqa: F401  (restore_pillow_limit, large_noisy_jpeg: fixtures)
    POLICY,
    large_noisy_jpeg,
    noise,
    photo,
    policy,
    rejection,
    restore_pillow_limit,
    save,
    scene,
)


# --- nothing, or not an image -------------------------------------------------------------------

def test_empty_upload_is_empty() -> None:
    assert rejection(b"")[0] == "empty"


@pytest.mark.parametrize("data", [
    pytest.param(b"<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head><body>gone</body></html>\n",
                 id="html-saved-as-jpg"),
    pytest.param(b"\xef\xbb\xbf<html><body><img src='cat.jpg'></body></html>", id="html-with-bom"),
    pytest.param(b"AccessDenied: the signed URL expired\n", id="error-text"),
    pytest.param(bytes(4096), id="zeros"),
    pytest.param(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03" + bytes(32), id="gzip"),
    pytest.param(b"PK\x03\x04" + bytes(40), id="zip"),
])
def test_bytes_of_no_image_format_are_not_an_image(data: bytes) -> None:
    assert rejection(data) == ("not_an_image", "no supported image format matches these bytes")


def heif_like(brand: bytes) -> bytes:
    """An ISO-BMFF file start: an `ftyp` box with a major and compatible brands."""
    body = brand + b"\x00\x00\x00\x00" + b"mif1" + brand + b"miaf"
    return struct.pack(">I", len(body) + 8) + b"ftyp" + body + b"\x00\x00\x00\x2cmeta" + bytes(40)


@pytest.mark.parametrize(("data", "name"), [
    pytest.param(b'<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg" width="640" '
                 b'height="480"><rect width="10" height="10"/></svg>', "svg", id="svg"),
    pytest.param(b'<?xml version="1.0" encoding="utf-8"?>\n<!-- Generator: Adobe Illustrator 27.0 -->\n'
                 b'<!DOCTYPE svg PUBLIC "-//W3C//DTD SVG 1.1//EN" "http://www.w3.org/Graphics/SVG/1.1/DTD/svg11.dtd">'
                 b'\n<svg version="1.1" xmlns="http://www.w3.org/2000/svg"></svg>', "svg", id="svg-illustrator"),
    pytest.param(b'\n  <SVG xmlns="http://www.w3.org/2000/svg"/>', "svg", id="svg-bare-upper-case"),
    pytest.param(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n", "pdf", id="pdf"),
    pytest.param(heif_like(b"heic"), "heic", id="heic-iphone"),
    pytest.param(heif_like(b"mif1"), "heic", id="heif-mif1"),
    pytest.param(heif_like(b"avif"), "avif", id="avif"),
    pytest.param(heif_like(b"avis"), "avif", id="avif-sequence"),
    pytest.param(b"8BPS\x00\x01\x00\x00\x00\x00\x00\x00\x00\x03\x00\x00\x01\xe0\x00\x00\x02\x80\x00\x08\x00\x03"
                 + bytes(64), "psd", id="psd"),
    pytest.param(save(Image.new("RGBA", (32, 32), (0, 0, 255, 255)), "ICO"), "ico", id="ico"),
])
def test_known_unsupported_formats_are_named(data: bytes, name: str) -> None:
    assert rejection(data) == ("unsupported_format", f"{name} (allowed: jpeg, png, tiff, webp)")


def test_svg_with_a_utf8_byte_order_mark_is_named() -> None:
    # Editors on Windows save SVG with a BOM; it is still an SVG, not "not an image".
    svg = b'\xef\xbb\xbf<?xml version="1.0" encoding="UTF-8"?>\n<svg xmlns="http://www.w3.org/2000/svg"/>'

    assert rejection(svg) == ("unsupported_format", "svg (allowed: jpeg, png, tiff, webp)")


@pytest.mark.parametrize(("pil_format", "name"), [("GIF", "gif"), ("BMP", "bmp"), ("TIFF", "tiff")])
def test_valid_image_of_a_format_not_allowed_is_unsupported(pil_format: str, name: str) -> None:
    data = save(Image.new("RGB", (64, 64), (10, 200, 30)), pil_format)
    assert Image.open(io.BytesIO(data)).format == pil_format  # a valid image of that format

    assert rejection(data, policy(allowed=frozenset({"jpeg", "png", "webp"}))) == (
        "unsupported_format", f"{name} (allowed: jpeg, png, webp)")


@pytest.mark.parametrize(("pil_format", "name"), [("GIF", "gif"), ("BMP", "bmp")])
def test_format_accepted_when_allowed_is_decoded_and_reencoded(pil_format: str, name: str) -> None:
    data = save(Image.new("RGB", (64, 48), (10, 200, 30)), pil_format)

    decoded = images.decode(data, policy(allowed=frozenset({"jpeg", "png", name})))

    assert (decoded.format, decoded.width, decoded.height, decoded.reencode) == (name, 64, 48, f"format {name}")
    assert decoded.rgb.mode == "RGB" and decoded.rgb.getpixel((5, 5)) == (10, 200, 30)


# --- truncated and corrupt -------------------------------------------------------------------------

@pytest.mark.parametrize("kept", [0.5, 0.9, 0.999])
def test_truncated_jpeg_is_truncated_even_in_draft_mode(large_noisy_jpeg: bytes, kept: float) -> None:
    # GIVEN the whole file decodes in draft mode at 1/8 scale (so draft mode is what is tested)
    whole = images.decode(large_noisy_jpeg, POLICY)
    assert (whole.reencode, whole.rgb.size, (whole.width, whole.height)) == (None, (128, 128), (1024, 1024))

    cut = large_noisy_jpeg[: int(len(large_noisy_jpeg) * kept)]

    assert rejection(cut)[0] == "truncated"


def test_jpeg_missing_only_its_end_marker_is_truncated(large_noisy_jpeg: bytes) -> None:
    assert rejection(large_noisy_jpeg[:-2])[0] == "truncated"


@pytest.mark.parametrize("kept", [0.3, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("store", [pytest.param(POLICY, id="draft-1/8"), pytest.param(policy(max_side=512), id="re-encoded")])
def test_truncated_jpeg_closed_with_an_end_marker_is_truncated(large_noisy_jpeg: bytes, kept: float,
                                                                store: DecodePolicy) -> None:
    # A partial download "repaired" by appending FFD9: libjpeg pads the missing part with grey and
    # only warns (premature end of data segment), a warning Pillow does not pass on.
    cut = large_noisy_jpeg[: int(len(large_noisy_jpeg) * kept)] + b"\xff\xd9"

    assert rejection(cut, store) == ("truncated", "the JPEG's scan ends before its last block: the file was cut "
                                                  "short and closed with an end marker")


@pytest.mark.parametrize("picture", [
    pytest.param(lambda: Image.new("RGB", (200, 120), (128, 128, 128)), id="all-mid-grey"),
    pytest.param(lambda: Image.new("L", (200, 120), 128), id="grey-mode-mid-grey"),
    pytest.param(lambda: scene((300, 200)), id="scene"),
])
def test_a_complete_jpeg_ending_in_mid_grey_is_not_truncated(picture: Callable[[], Image.Image]) -> None:
    # libjpeg's padding is mid-grey: a picture that really ends in it is decoded again, and passes.
    image = picture()
    ImageDraw.Draw(image).rectangle((0, 100, image.width, image.height), fill=128)
    data = save(image, "JPEG", quality=90)

    decoded = images.decode(data, POLICY)

    assert (decoded.width, decoded.height) == image.size


def test_a_complete_progressive_jpeg_is_not_truncated(large_noisy_jpeg: bytes) -> None:
    data = save(noise((512, 512)), "JPEG", quality=80, progressive=True)

    assert images.decode(data, POLICY).width == 512


def test_a_progressive_jpeg_cut_in_a_scan_and_closed_with_an_end_marker_is_truncated() -> None:
    data = save(noise((512, 512)), "JPEG", quality=80, progressive=True)
    cut = data[: int(len(data) * 0.6)] + b"\xff\xd9"

    assert rejection(cut)[0] == "truncated"


KEPT_OR_REENCODED = [pytest.param(POLICY, id="kept"), pytest.param(policy(max_side=512), id="re-encoded")]


def scan_starts(jpeg: bytes) -> list[int]:
    """Where each scan's start-of-scan marker is (FF DA: entropy-coded data stuffs every FF with 00)."""
    return [index for index in range(len(jpeg) - 1) if jpeg[index:index + 2] == b"\xff\xda"]


@pytest.fixture(scope="module")
def progressive_photo() -> bytes:
    return save(photo((800, 600), seed=1), "JPEG", quality=90, progressive=True)


@pytest.mark.parametrize("scan", range(1, 10))
@pytest.mark.parametrize("store", KEPT_OR_REENCODED)
def test_a_progressive_jpeg_cut_in_any_scan_and_closed_with_an_end_marker_is_truncated(
        progressive_photo: bytes, scan: int, store: DecodePolicy) -> None:
    # GIVEN libjpeg's ten-scan progression: the DC scan first, then AC bands and refinements
    starts = scan_starts(progressive_photo)
    assert len(starts) == 10
    end = starts[scan + 1] if scan + 1 < len(starts) else len(progressive_photo) - 2
    # WHEN the file is cut in the middle of that scan and "repaired" with an end marker
    cut = progressive_photo[: (starts[scan] + end) // 2] + b"\xff\xd9"

    # THEN it is truncated: until 2026-12 a kept file, decoded at 1/8 (DC alone), passed with an AC scan cut
    assert rejection(cut, store)[0] == "truncated"


@pytest.mark.parametrize("size", [(1001, 1001), (999, 777), (2003, 1501)])
@pytest.mark.parametrize("store", KEPT_OR_REENCODED)
def test_a_complete_progressive_jpeg_with_sides_not_a_multiple_of_the_scale_is_not_truncated(
        size: tuple[int, int], store: DecodePolicy) -> None:
    # The probe decode must run at the first decode's DCT scale: asked for the (rounded-up) decoded
    # size, Pillow picked the next scale down, the pixels differed, and a whole file was "truncated".
    data = save(noise(size), "JPEG", quality=80, progressive=True)

    assert (images.decode(data, store).width, images.decode(data, store).height) == size


@pytest.mark.parametrize("store", KEPT_OR_REENCODED)
def test_a_progressive_jpeg_with_odd_sides_cut_and_closed_with_an_end_marker_is_truncated(store: DecodePolicy) -> None:
    data = save(noise((1001, 777)), "JPEG", quality=80, progressive=True)
    cut = data[: int(len(data) * 0.6)] + b"\xff\xd9"

    assert rejection(cut, store)[0] == "truncated"


def test_png_with_a_damaged_chunk_header_is_corrupt_with_the_decoder_s_message() -> None:
    # PNG is allowed: a PNG that Pillow's plugin refuses is broken, not of an unsupported format.
    png = save(Image.new("RGB", (64, 64), (10, 200, 30)), "PNG")
    damaged = png[:12] + b"IHDx" + png[16:]  # the first chunk's type, so its CRC no longer matches

    assert rejection(damaged) == ("corrupt", "png: broken PNG file (bad header checksum in b'IHDx')")


def test_png_not_allowed_is_unsupported_and_names_the_allowed_formats() -> None:
    png = save(Image.new("RGB", (64, 64), (10, 200, 30)), "PNG")

    assert rejection(png, policy(allowed=frozenset({"jpeg", "webp"}))) == (
        "unsupported_format", "png (allowed: jpeg, webp)")


@pytest.mark.parametrize("kept", [0.5, 0.9, 0.999])
def test_truncated_png_is_truncated(kept: float) -> None:
    data = save(noise((512, 512)), "PNG")

    assert rejection(data[: int(len(data) * kept)])[0] == "truncated"


@pytest.mark.parametrize("kept", [0.5, 0.9, 0.999])
def test_truncated_webp_is_corrupt(kept: float) -> None:
    # libwebp refuses an incomplete RIFF outright, before any pixel: Pillow says so as a decoder error.
    data = save(noise((256, 256)), "WEBP", quality=80)

    assert rejection(data[: int(len(data) * kept)])[0] == "corrupt"


def test_jpeg_with_corrupt_bytes_in_the_middle_is_corrupt(large_noisy_jpeg: bytes) -> None:
    middle = len(large_noisy_jpeg) // 2
    damaged = large_noisy_jpeg[:middle] + b"\xff" * 64 + large_noisy_jpeg[middle + 64:]

    assert rejection(damaged)[0] == "corrupt"


def test_jpeg_with_a_second_start_marker_in_the_middle_is_corrupt(large_noisy_jpeg: bytes) -> None:
    # Two files concatenated mid-stream (a resumed download that restarted from the beginning).
    middle = len(large_noisy_jpeg) // 2
    damaged = large_noisy_jpeg[:middle] + large_noisy_jpeg[:4] + large_noisy_jpeg[middle + 4:]

    assert rejection(damaged)[0] == "corrupt"


# --- the decompression-bomb guard ------------------------------------------------------------------

def test_image_at_the_pixel_limit_is_accepted() -> None:
    decoded = images.decode(save(Image.new("RGB", (100, 100)), "PNG"), policy(max_pixels=10_000))

    assert (decoded.width, decoded.height) == (100, 100)


@pytest.mark.parametrize("pil_format", ["PNG", "JPEG", "TIFF"])
@pytest.mark.parametrize("max_pixels", [
    pytest.param(9_999, id="just-over-the-limit"),  # Pillow only warns: made an error
    pytest.param(4_999, id="over-twice-the-limit"),  # Pillow raises DecompressionBombError
])
def test_image_over_the_pixel_limit_is_too_many_pixels(pil_format: str, max_pixels: int) -> None:
    data = save(Image.new("RGB", (100, 100)), pil_format)

    assert rejection(data, policy(max_pixels=max_pixels))[0] == "too_many_pixels"


def test_pixel_limit_does_not_stick_to_later_calls() -> None:
    png = save(Image.new("RGB", (100, 100)), "PNG")
    assert rejection(png, policy(max_pixels=1_000))[0] == "too_many_pixels"

    assert images.decode(png, POLICY).width == 100
