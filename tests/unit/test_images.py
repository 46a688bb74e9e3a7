"""core.ingest.images: sniffing, safe decoding, orientation, colour modes, derivatives and the dHash.

Every input is generated here, shaped like what partners really send (no binary fixtures).
"""

from __future__ import annotations

import dataclasses
import io
import random
import struct
from collections.abc import Callable, Iterator

import pytest
from PIL import Image, ImageCms, ImageDraw, ImageFilter, JpegImagePlugin, PngImagePlugin

from core.errors import RejectedUpload
from core.ingest import images
from core.ingest.images import DecodePolicy
from tests.support import hue_turned

LIMIT = 178_956_970  # core.settings.DEFAULTS' MAX_IMAGE_PIXELS
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
POLICY = DecodePolicy(allowed=frozenset({"jpeg", "png", "webp", "tiff"}), max_pixels=LIMIT, background=WHITE,
                      max_side=1024, reencode="auto")


@pytest.fixture(autouse=True)
def restore_pillow_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """decode() sets Pillow's process-wide limit; put it back for the other tests."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    yield


def policy(**changes: object) -> DecodePolicy:
    return dataclasses.replace(POLICY, **changes)  # type: ignore[arg-type]


def save(image: Image.Image, pil_format: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **params)
    return buffer.getvalue()


def noise(size: tuple[int, int]) -> Image.Image:
    """Incompressible pixels, so the entropy-coded data dwarfs the headers."""
    return Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))


def scene(size: tuple[int, int], variant: int = 0) -> Image.Image:
    """A smooth picture with large shapes: what a perceptual hash is made for."""
    image = Image.linear_gradient("L").resize(size).convert("RGB")
    draw = ImageDraw.Draw(image)
    w, h = size
    if variant == 0:
        draw.ellipse((w * 0.1, h * 0.2, w * 0.5, h * 0.8), fill=(220, 40, 40))
        draw.rectangle((w * 0.6, h * 0.1, w * 0.9, h * 0.5), fill=(30, 60, 200))
    else:
        draw.rectangle((w * 0.05, h * 0.55, w * 0.45, h * 0.95), fill=(30, 200, 60))
        draw.ellipse((w * 0.5, h * 0.05, w * 0.95, h * 0.6), fill=(250, 220, 10))
    return image


def rejection(data: bytes, with_policy: DecodePolicy = POLICY) -> tuple[str, str]:
    with pytest.raises(RejectedUpload) as raised:
        images.decode(data, with_policy)
    return raised.value.reason, raised.value.detail


def close(actual: tuple[int, ...], expected: tuple[int, ...], tolerance: int) -> bool:
    return all(abs(a - e) <= tolerance for a, e in zip(actual, expected, strict=True))


@pytest.fixture(scope="module")
def large_noisy_jpeg() -> bytes:
    """1024 x 1024 of noise, about 600 KB: a clean JPEG, so decoded in draft mode at 1/8 scale."""
    return save(noise((1024, 1024)), "JPEG", quality=75)


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


# --- what is kept as uploaded, and what must be re-encoded -----------------------------------------

@pytest.mark.parametrize(("data", "fmt"), [
    pytest.param(save(Image.new("RGB", (64, 48), (200, 30, 30)), "JPEG"), "jpeg", id="jpeg"),
    pytest.param(save(Image.new("RGB", (64, 48), (200, 30, 30)), "PNG"), "png", id="png"),
    pytest.param(save(Image.new("RGB", (64, 48), (200, 30, 30)), "WEBP"), "webp", id="webp"),
    pytest.param(save(Image.new("L", (64, 48), 77), "PNG"), "png", id="grey-png"),
    pytest.param(save(Image.new("L", (64, 48), 77), "JPEG"), "jpeg", id="grey-jpeg"),
])
def test_clean_images_keep_their_bytes(data: bytes, fmt: str) -> None:
    decoded = images.decode(data, POLICY)

    assert (decoded.format, decoded.width, decoded.height, decoded.reencode) == (fmt, 64, 48, None)


def test_multi_picture_jpeg_is_a_jpeg() -> None:
    # A phone's MPO: a baseline JPEG first frame plus a second picture; Pillow reports "MPO".
    mpo = save(Image.new("RGB", (40, 30), "red"), "MPO", save_all=True, append_images=[Image.new("RGB", (40, 30), "blue")])
    assert mpo[:2] == b"\xff\xd8" and Image.open(io.BytesIO(mpo)).format == "MPO"

    decoded = images.decode(mpo, POLICY)

    assert (decoded.format, decoded.width, decoded.height, decoded.reencode) == ("jpeg", 40, 30, None)


def test_huge_tiff_is_decoded_and_must_be_reencoded() -> None:
    tiff = save(Image.new("RGB", (3000, 2000), (10, 120, 200)), "TIFF", compression="tiff_deflate")

    decoded = images.decode(tiff, POLICY)

    assert (decoded.format, decoded.mode, decoded.width, decoded.height, decoded.reencode) \
        == ("tiff", "RGB", 3000, 2000, "format tiff")


def test_jpeg_longer_than_the_maximum_side_is_drafted_no_smaller_than_needed() -> None:
    # 2400 x 1600 with a 600 px maximum: DCT scaling by 1/4 leaves the long side at 600, all the
    # derivative needs (until 2026-12 both sides had to stay >= 600: 1/2, four times the pixels).
    jpeg = save(scene((2400, 1600)), "JPEG", quality=90)

    decoded = images.decode(jpeg, policy(max_side=600))

    assert (decoded.width, decoded.height, decoded.rgb.size, decoded.reencode) \
        == (2400, 1600, (600, 400), "larger than the maximum side")


@pytest.mark.parametrize(("size", "scale"), [
    pytest.param((1024, 768), 1, id="at-the-maximum"),
    pytest.param((1900, 1425), 1, id="half-would-be-over-1/16-under"),
    pytest.param((1920, 1440), 2, id="half-is-exactly-1/16-under"),
    pytest.param((2000, 1500), 2, id="half-is-within-1/16-under"),
    pytest.param((2600, 1950), 2, id="half-is-over-the-maximum"),
    pytest.param((3000, 4000), 4, id="portrait-quarter-is-within"),
    pytest.param((8192, 2048), 8, id="eighth-is-the-maximum"),
    pytest.param((100_000, 100), 8, id="never-beyond-an-eighth"),
])
def test_jpeg_scale_is_the_smallest_decode_at_most_1_16_under_the_maximum(size: tuple[int, int], scale: int) -> None:
    assert images.jpeg_scale(size, 1024) == scale


@pytest.mark.parametrize(("size", "decoded_size", "stored_size"), [
    pytest.param((2000, 1500), (1000, 750), (1000, 750), id="half-scale-stored-as-decoded"),
    pytest.param((2001, 1501), (1001, 751), (1001, 751), id="odd-sides-round-up-as-libjpeg-does"),
    pytest.param((2600, 1950), (1300, 975), (1024, 768), id="half-scale-then-resized"),
    pytest.param((1900, 1425), (1900, 1425), (1024, 768), id="full-scale-then-resized"),
])
def test_jpeg_derivative_is_decoded_at_its_scale_and_never_over_the_maximum(
        size: tuple[int, int], decoded_size: tuple[int, int], stored_size: tuple[int, int]) -> None:
    decoded = images.decode(save(scene(size), "JPEG", quality=90), POLICY)

    data, stored = images.encode_jpeg(decoded.rgb, POLICY.max_side, 95)

    assert ((decoded.width, decoded.height), decoded.rgb.size, stored, Image.open(io.BytesIO(data)).size) \
        == (size, decoded_size, stored_size, stored_size)


def test_reencode_always_reencodes_a_clean_image() -> None:
    decoded = images.decode(save(Image.new("RGB", (64, 48)), "PNG"), policy(reencode="always"))

    assert decoded.reencode == "policy"


# --- EXIF orientation ------------------------------------------------------------------------------

def marked_jpeg(orientation: int) -> bytes:
    """60 x 40, white with a red block in the stored top-left corner, EXIF Orientation set."""
    image = Image.new("RGB", (60, 40), WHITE)
    image.paste((255, 0, 0), (0, 0, 15, 10))
    exif = Image.Exif()
    exif[0x0112] = orientation
    return save(image, "JPEG", quality=95, exif=exif.tobytes())


def red_corners(rgb: Image.Image) -> set[str]:
    w, h = rgb.size
    corners = {"top-left": (3, 3), "top-right": (w - 4, 3), "bottom-left": (3, h - 4), "bottom-right": (w - 4, h - 4)}
    return {name for name, xy in corners.items() if close(rgb.getpixel(xy), (255, 0, 0), 40)}


@pytest.mark.parametrize(("orientation", "size", "corner"), [
    (1, (60, 40), "top-left"),
    (2, (60, 40), "top-right"),  # mirrored
    (3, (60, 40), "bottom-right"),  # rotated 180
    (4, (60, 40), "bottom-left"),  # flipped
    (5, (40, 60), "top-left"),  # transposed
    (6, (40, 60), "top-right"),  # the phone held upright: rotate 90 clockwise
    (7, (40, 60), "bottom-right"),  # transversed
    (8, (40, 60), "bottom-left"),  # rotate 90 counter-clockwise
])
def test_exif_orientation_is_applied(orientation: int, size: tuple[int, int], corner: str) -> None:
    decoded = images.decode(marked_jpeg(orientation), POLICY)

    assert ((decoded.width, decoded.height), decoded.rgb.size, red_corners(decoded.rgb)) == (size, size, {corner})
    assert decoded.reencode == (None if orientation == 1 else "exif orientation")


@pytest.mark.parametrize("pil_format", ["PNG", "WEBP"])
def test_exif_orientation_of_png_and_webp_is_applied(pil_format: str) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    data = save(Image.new("RGB", (60, 40)), pil_format, exif=exif.tobytes())

    decoded = images.decode(data, POLICY)

    assert (decoded.width, decoded.height, decoded.rgb.size, decoded.reencode) == (40, 60, (40, 60), "exif orientation")


# --- colour modes to RGB ---------------------------------------------------------------------------

INKS = {"cyan": (0, 174, 239), "magenta": (236, 0, 140), "yellow": (255, 242, 0), "black": (35, 31, 32)}


def cmyk_profile() -> bytes:
    """A minimal ICC v2 CMYK output profile: A2B0 is a lut8 with one grid point per ink on/off,
    each corner the sRGB colour of those inks printed over white (cyan alone: 0,174,239)."""
    corners = []
    for c in (0, 1):
        for m in (0, 1):
            for y in (0, 1):
                for k in (0, 1):
                    rgb = (255, 255, 255)
                    for on, ink in zip((c, m, y, k), INKS.values()):
                        if on:
                            rgb = tuple(round(a * b / 255) for a, b in zip(rgb, ink))
                    corners.append(rgb)
    strip = Image.frombytes("RGB", (16, 1), bytes(v for rgb in corners for v in rgb))
    to_lab = ImageCms.buildTransform(ImageCms.createProfile("sRGB"), ImageCms.createProfile("LAB"), "RGB", "LAB")
    lab = ImageCms.applyTransform(strip, to_lab).tobytes()
    # Pillow keeps a* and b* as signed bytes; a lut8 encodes them offset by 128
    clut = bytes(v if i % 3 == 0 else v ^ 0x80 for i, v in enumerate(lab))

    def xyz(x: float, y: float, z: float) -> bytes:
        return b"".join(struct.pack(">i", round(v * 65536)) for v in (x, y, z))

    identity_curve, one, zero = bytes(range(256)), struct.pack(">i", 65536), struct.pack(">i", 0)
    tags = [
        (b"desc", b"desc" + bytes(4) + struct.pack(">I", 10) + b"test CMYK\0" + bytes(4 + 4 + 2 + 1 + 67)),
        (b"wtpt", b"XYZ " + bytes(4) + xyz(0.9642, 1.0, 0.8249)),
        (b"A2B0", b"mft1" + bytes(4) + bytes([4, 3, 2, 0]) + (one + zero * 3) * 2 + one
         + identity_curve * 4 + clut + identity_curve * 3),
    ]
    offset, table, body = 128 + 4 + 12 * len(tags), b"", b""
    for signature, data in tags:
        data += bytes(-len(data) % 4)
        table += signature + struct.pack(">II", offset + len(body), len(data))
        body += data
    header = (struct.pack(">I", offset + len(body)) + bytes(4) + struct.pack(">I", 0x02100000) + b"prtrCMYKLab "
              + bytes(12) + b"acsp" + bytes(28) + xyz(0.9642, 1.0, 0.8249) + bytes(48))
    return header + struct.pack(">I", len(tags)) + table + body


CYAN_INK = (255, 0, 0, 0)


@pytest.mark.parametrize(("pil_format", "reason"), [("JPEG", "mode CMYK"), ("TIFF", "format tiff")])
def test_cmyk_without_a_profile_is_converted_naively(pil_format: str, reason: str) -> None:
    data = save(Image.new("CMYK", (32, 32), CYAN_INK), pil_format)

    decoded = images.decode(data, POLICY)

    assert (decoded.mode, decoded.rgb.mode, decoded.reencode) == ("CMYK", "RGB", reason)
    assert close(decoded.rgb.getpixel((16, 16)), (0, 255, 255), 2)


@pytest.mark.parametrize("pil_format", ["JPEG", "TIFF"])
def test_cmyk_with_a_profile_is_converted_through_it(pil_format: str) -> None:
    data = save(Image.new("CMYK", (32, 32), CYAN_INK), pil_format, icc_profile=cmyk_profile())

    decoded = images.decode(data, POLICY)

    # printed cyan is (0,174,239) in sRGB; the naive conversion would say (0,255,255)
    assert (decoded.mode, decoded.rgb.mode) == ("CMYK", "RGB")
    assert close(decoded.rgb.getpixel((16, 16)), INKS["cyan"], 4)


def test_cmyk_with_an_rgb_profile_is_corrupt_not_a_crash() -> None:
    # A CMYK JPEG still carrying the RGB profile of its source: lcms cannot build the transform.
    # An unreadable profile is already "corrupt"; this one must not escape as an unexpected error
    # (that would fail the SQS record five times and end in the DLQ).
    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    data = save(Image.new("CMYK", (32, 32), CYAN_INK), "JPEG", icc_profile=srgb)

    assert rejection(data)[0] == "corrupt"


def test_cmyk_with_an_unreadable_profile_is_corrupt() -> None:
    data = save(Image.new("CMYK", (32, 32), CYAN_INK), "JPEG", icc_profile=b"not an ICC profile" * 8)

    assert rejection(data)[0] == "corrupt"


def half_transparent_rgba() -> Image.Image:
    """Left half fully transparent, right half opaque blue, bottom-left red at half alpha."""
    image = Image.new("RGBA", (32, 32), (255, 0, 0, 0))
    image.paste((0, 0, 255, 255), (16, 0, 32, 32))
    image.paste((255, 0, 0, 128), (0, 16, 16, 32))
    return image


@pytest.mark.parametrize(("background", "half_red"), [
    (WHITE, (255, 127, 127)),
    (BLACK, (128, 0, 0)),
    ((10, 200, 30), (133, 100, 15)),
])
@pytest.mark.parametrize("pil_format", ["PNG", "WEBP"])
def test_rgba_is_composited_over_the_background(pil_format: str, background: tuple[int, int, int],
                                                half_red: tuple[int, int, int]) -> None:
    data = save(half_transparent_rgba(), pil_format, **({"lossless": True} if pil_format == "WEBP" else {}))

    decoded = images.decode(data, policy(background=background))

    assert (decoded.mode, decoded.reencode) == ("RGBA", "mode RGBA")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (background, (0, 0, 255))
    assert close(decoded.rgb.getpixel((4, 20)), half_red, 1)


@pytest.mark.parametrize("background", [WHITE, BLACK])
def test_grey_with_alpha_is_composited_over_the_background(background: tuple[int, int, int]) -> None:
    image = Image.new("LA", (32, 32), (200, 0))
    image.paste((50, 255), (16, 0, 32, 32))

    decoded = images.decode(save(image, "PNG"), policy(background=background))

    assert (decoded.mode, decoded.reencode) == ("LA", "mode LA")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (background, (50, 50, 50))


def palette_image() -> Image.Image:
    image = Image.new("P", (32, 32), 0)
    image.putpalette([255, 0, 0, 0, 255, 0])
    image.paste(1, (16, 0, 32, 32))
    return image


@pytest.mark.parametrize("background", [WHITE, BLACK])
def test_palette_with_a_transparent_index_is_composited_over_the_background(background: tuple[int, int, int]) -> None:
    decoded = images.decode(save(palette_image(), "PNG", transparency=0), policy(background=background))

    assert (decoded.mode, decoded.reencode) == ("P", "mode P with transparency")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (background, (0, 255, 0))


def test_palette_without_transparency_keeps_its_colours() -> None:
    decoded = images.decode(save(palette_image(), "PNG"), POLICY)

    assert (decoded.mode, decoded.reencode) == ("P", "mode P")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == ((255, 0, 0), (0, 255, 0))


def test_grey_with_a_transparent_value_is_composited_over_the_background() -> None:
    image = Image.new("L", (32, 32), 7)
    image.paste(99, (16, 0, 32, 32))

    decoded = images.decode(save(image, "PNG", transparency=7), policy(background=BLACK))

    assert (decoded.mode, decoded.reencode) == ("L", "mode L with transparency")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (BLACK, (99, 99, 99))


def test_rgb_with_a_transparent_colour_is_composited_over_the_background() -> None:
    # An RGB PNG with a tRNS chunk: pixels of exactly that colour are transparent.
    image = Image.new("RGB", (32, 32), (1, 2, 3))
    image.paste((9, 9, 9), (16, 0, 32, 32))

    decoded = images.decode(save(image, "PNG", transparency=(1, 2, 3)), POLICY)

    assert (decoded.mode, decoded.reencode) == ("RGB", "mode RGB with transparency")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (WHITE, (9, 9, 9))


@pytest.mark.parametrize("pil_format", ["PNG", "TIFF"])
def test_16_bit_grey_keeps_its_top_8_bits(pil_format: str) -> None:
    # columns of 0, 40000 and 65535: 40000 / 256 = 156.25
    row = [0] * 8 + [40000] * 8 + [65535] * 8
    image = Image.frombytes("I;16", (24, 4), struct.pack(f"<{24 * 4}H", *(row * 4)))

    decoded = images.decode(save(image, pil_format), POLICY)

    assert (decoded.mode, decoded.rgb.mode) == ("I;16", "RGB")
    assert [decoded.rgb.getpixel((x, 2)) for x in (4, 12, 20)] == [(0, 0, 0), (156, 156, 156), (255, 255, 255)]


def test_one_bit_becomes_black_and_white() -> None:
    image = Image.new("1", (32, 32), 0)
    image.paste(1, (16, 0, 32, 32))

    decoded = images.decode(save(image, "PNG"), POLICY)

    assert (decoded.mode, decoded.reencode) == ("1", "mode 1")
    assert (decoded.rgb.getpixel((4, 4)), decoded.rgb.getpixel((20, 4))) == (BLACK, WHITE)


def test_grey_becomes_grey_rgb() -> None:
    decoded = images.decode(save(Image.new("L", (32, 32), 77), "PNG"), POLICY)

    assert (decoded.mode, decoded.rgb.mode, decoded.rgb.getpixel((4, 4))) == ("L", "RGB", (77, 77, 77))


# --- embedded descriptions -------------------------------------------------------------------------

def exif_with(tag: int, value: str | bytes) -> bytes:
    exif = Image.Exif()
    exif[tag] = value
    return exif.tobytes()


def xmp_packet(description: str) -> str:
    return ('<?xpacket begin="\ufeff" id="W5M0MpCehiHzreSzNTczkc9d"?>'
            '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            '<rdf:Description rdf:about="" xmlns:dc="http://purl.org/dc/elements/1.1/">'
            '<dc:title><rdf:Alt><rdf:li xml:lang="x-default">a title, not the description</rdf:li></rdf:Alt></dc:title>'
            f'<dc:description><rdf:Alt><rdf:li xml:lang="x-default">{description}</rdf:li></rdf:Alt></dc:description>'
            '</rdf:Description></rdf:RDF></x:xmpmeta><?xpacket end="w"?>')


def iptc_dataset(record: int, tag: int, value: bytes) -> bytes:
    return bytes([0x1C, record, tag]) + struct.pack(">H", len(value)) + value


def iptc_caption(caption: str) -> bytes:
    """IPTC-IIM: coded character set UTF-8 (1:90 = ESC % G), then Caption/Abstract (2:120)."""
    return iptc_dataset(1, 90, b"\x1b%G") + iptc_dataset(2, 120, caption.encode())


def with_app13(jpeg: bytes, iptc: bytes) -> bytes:
    """The JPEG with a Photoshop APP13 segment holding `iptc` as resource 0x0404, after SOI."""
    resource = b"8BIM" + struct.pack(">H", 0x0404) + b"\0\0" + struct.pack(">I", len(iptc)) + iptc + bytes(len(iptc) % 2)
    payload = b"Photoshop 3.0\0" + resource
    return jpeg[:2] + b"\xff\xed" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def plain(size: tuple[int, int] = (32, 32)) -> Image.Image:
    return Image.new("RGB", size, (90, 90, 90))


def test_exif_image_description_is_read() -> None:
    data = save(plain(), "JPEG", exif=exif_with(0x010E, "  A red bus in the rain \n"))

    assert images.decode(data, POLICY).text == {"exif": "A red bus in the rain"}


def test_exif_image_description_in_utf8_is_read_as_utf8() -> None:
    # Cameras, phones and exiftool write UTF-8 into the ASCII-typed tag.
    data = save(plain(), "JPEG", exif=exif_with(0x010E, "Ölgemälde am Meer".encode()))

    assert images.decode(data, POLICY).text == {"exif": "Ölgemälde am Meer"}


def test_iptc_caption_is_read_from_a_photoshop_app13_segment() -> None:
    data = with_app13(save(plain(), "JPEG"), iptc_caption("Ölgemälde, Öl auf Leinwand"))

    assert images.decode(data, POLICY).text == {"iptc": "Ölgemälde, Öl auf Leinwand"}


def test_iptc_caption_is_read_from_a_tiff() -> None:
    data = save(plain(), "TIFF", tiffinfo={33723: iptc_caption("archive scan 1931")})

    assert images.decode(data, POLICY).text == {"iptc": "archive scan 1931"}


@pytest.mark.parametrize("pil_format", ["JPEG", "WEBP", "PNG", "TIFF"])
def test_xmp_dc_description_is_read(pil_format: str) -> None:
    packet = xmp_packet("Fish &amp; chips &lt;3 — Ölgemälde")
    if pil_format == "PNG":  # PNG keeps XMP in an iTXt chunk; Pillow's PNG writer takes no xmp=
        info = PngImagePlugin.PngInfo()
        info.add_itxt("XML:com.adobe.xmp", packet)
        params: dict[str, object] = {"pnginfo": info}
    elif pil_format == "TIFF":  # TIFF tag 700
        params = {"tiffinfo": {700: packet.encode()}}
    else:
        params = {"xmp": packet.encode()}

    assert images.decode(save(plain(), pil_format, **params), POLICY).text == {"xmp": "Fish & chips <3 — Ölgemälde"}


def test_every_embedded_description_is_read() -> None:
    jpeg = save(plain(), "JPEG", exif=exif_with(0x010E, "from exif"), xmp=xmp_packet("from xmp").encode())

    text = images.decode(with_app13(jpeg, iptc_caption("from iptc")), POLICY).text

    assert text == {"exif": "from exif", "iptc": "from iptc", "xmp": "from xmp"}


def test_image_without_descriptions_has_no_text() -> None:
    assert images.decode(save(plain(), "JPEG"), POLICY).text == {}


def test_blank_descriptions_are_no_text() -> None:
    jpeg = save(plain(), "JPEG", exif=exif_with(0x010E, "   "), xmp=xmp_packet(" ").encode())

    assert images.decode(with_app13(jpeg, iptc_caption("  ")), POLICY).text == {}


# --- the stored derivative -------------------------------------------------------------------------

def test_derivative_is_downscaled_to_the_maximum_side() -> None:
    data, size = images.encode_jpeg(scene((3000, 2000)), max_side=1024, quality=95)

    stored = Image.open(io.BytesIO(data))
    assert (stored.format, stored.size, size) == ("JPEG", (1024, 683), (1024, 683))


def test_derivative_is_full_chroma() -> None:
    data, _ = images.encode_jpeg(scene((300, 200)), max_side=1024, quality=95)

    assert JpegImagePlugin.get_sampling(Image.open(io.BytesIO(data))) == 0  # 4:4:4


def test_derivative_is_never_upscaled() -> None:
    data, size = images.encode_jpeg(scene((300, 200)), max_side=1024, quality=95)

    assert (Image.open(io.BytesIO(data)).size, size) == ((300, 200), (300, 200))


def test_derivative_of_a_tall_image_limits_its_height() -> None:
    _, size = images.encode_jpeg(scene((500, 4000)), max_side=1000, quality=80)

    assert size == (125, 1000)


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


def photo(size: tuple[int, int], seed: int) -> Image.Image:
    """Photo-like: a gradient, blurred shapes and grain (the grain from a seeded generator)."""
    rng = random.Random(seed)
    small = Image.linear_gradient("L").rotate(rng.choice((0, 90, 180, 270)))
    small = small.resize((size[0] // 8, size[1] // 8)).convert("RGB")
    draw = ImageDraw.Draw(small)
    for _ in range(12):
        x, y, r = rng.randrange(small.width), rng.randrange(small.height), rng.randrange(4, small.width // 4)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
    image = small.resize(size, Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2))
    return Image.blend(image, Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3)), 0.08)


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

COLOUR_DISTANCE = 16  # template.yaml's NearDuplicateColourDistance


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
