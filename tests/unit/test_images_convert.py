"""core.ingest.images' conversions: what is kept as uploaded or re-encoded, EXIF orientation, colour modes to RGB."""

from __future__ import annotations

import io
import struct

import pytest
from PIL import Image, ImageCms

from core.ingest import images
from tests.unit.images_helpers import (  # noqa: F401  (restore_pillow_limit: fixtures)
    BLACK,
    POLICY,
    WHITE,
    close,
    policy,
    rejection,
    restore_pillow_limit,
    save,
    scene,
)


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
