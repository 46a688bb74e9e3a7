"""core.metadata: decode uploads safely and describe them."""

from __future__ import annotations

import hashlib
import io
import random
from collections.abc import Iterator

import pytest
from PIL import Image

from core.errors import RejectedUpload
from core.metadata import decode, describe
from core.models import Sidecar, UploadRef

LIMIT = 178956970  # template.yaml's MaxImagePixels default
UPLOAD = UploadRef(bucket="atelier-uploads", key="partner-a/cat.jpg", size=0, event_time="2026-11-29T12:00:00Z")


@pytest.fixture(autouse=True)
def restore_pillow_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """decode() sets Pillow's process-wide limit; put it back for the other tests."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    yield


def encode(pil_format: str, size: tuple[int, int] = (40, 30), noise: bool = False, **save: object) -> bytes:
    """An RGB image in `pil_format`; with noise, so compressed data dwarfs the headers."""
    if noise:
        rng = random.Random(0)
        image = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    else:
        image = Image.new("RGB", size, (200, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **save)
    return buffer.getvalue()


def reason_for(data: bytes, max_pixels: int = LIMIT) -> str:
    with pytest.raises(RejectedUpload) as raised:
        decode(data, max_pixels)
    return raised.value.reason


# --- decode: accepted formats ------------------------------------------------------------------

@pytest.mark.parametrize(("pil_format", "size", "expected"), [
    ("JPEG", (40, 30), "jpeg"),
    ("PNG", (17, 61), "png"),
    ("WEBP", (64, 32), "webp"),
])
def test_decode_returns_width_height_and_format(pil_format: str, size: tuple[int, int], expected: str) -> None:
    assert decode(encode(pil_format, size), LIMIT) == (size[0], size[1], expected)


def test_decode_sniffs_the_format_from_the_bytes_not_the_name() -> None:
    # GIVEN a PNG that describe() is told lives under a .jpg key
    png = encode("PNG", (8, 8))

    sample = describe(png, UPLOAD, "partner-a", Sidecar(), LIMIT)

    assert (sample.format, sample.extension) == ("png", "png")


def test_decode_accepts_a_multi_picture_jpeg_as_jpeg() -> None:
    # GIVEN a camera-style MPO: a baseline JPEG first frame plus a second picture (Pillow opens
    # it through its JPEG plugin, as the trainer does, and reports format "MPO")
    mpo = io.BytesIO()
    Image.new("RGB", (40, 30), "red").save(mpo, "MPO", save_all=True, append_images=[Image.new("RGB", (40, 30), "blue")])
    assert mpo.getvalue()[:2] == b"\xff\xd8"  # a JPEG stream

    assert decode(mpo.getvalue(), LIMIT) == (40, 30, "jpeg")


# --- decode: rejections ---------------------------------------------------------------------------

@pytest.mark.parametrize("pil_format", ["JPEG", "PNG", "WEBP"])
def test_truncated_image_is_undecodable(pil_format: str) -> None:
    data = encode(pil_format, (64, 64), noise=True)

    assert reason_for(data[: len(data) // 2]) == "undecodable"


def test_html_named_jpg_is_an_unsupported_format() -> None:
    html = b"<!doctype html><html><body>not an image</body></html>"

    with pytest.raises(RejectedUpload) as raised:
        describe(html, UPLOAD, "partner-a", Sidecar(), LIMIT)

    assert raised.value.reason == "unsupported-format"


@pytest.mark.parametrize("pil_format", ["GIF", "BMP", "TIFF"])
def test_valid_image_of_another_format_is_an_unsupported_format(pil_format: str) -> None:
    data = encode(pil_format, (8, 8))
    assert Image.open(io.BytesIO(data)).format == pil_format  # a valid image of that format

    assert reason_for(data) == "unsupported-format"


def test_empty_upload_is_an_unsupported_format() -> None:
    assert reason_for(b"") == "unsupported-format"


def test_image_at_the_pixel_limit_is_accepted() -> None:
    assert decode(encode("PNG", (100, 100)), max_pixels=10_000) == (100, 100, "png")


@pytest.mark.parametrize("max_pixels", [
    pytest.param(9_999, id="one-over-the-limit"),  # Pillow warns: made an error
    pytest.param(4_999, id="over-twice-the-limit"),  # Pillow raises DecompressionBombError
    pytest.param(1_000, id="ten-times-the-limit"),
])
def test_image_over_the_pixel_limit_is_rejected(max_pixels: int) -> None:
    assert reason_for(encode("PNG", (100, 100)), max_pixels) == "too-many-pixels"


def test_pixel_limit_does_not_stick_to_later_calls() -> None:
    # GIVEN a rejection at a tiny limit
    png = encode("PNG", (100, 100))
    assert reason_for(png, 1_000) == "too-many-pixels"

    # WHEN the same image is decoded with a generous limit THEN it is accepted
    assert decode(png, LIMIT) == (100, 100, "png")


# --- describe ---------------------------------------------------------------------------------

def test_describe_records_the_sha256_of_the_exact_bytes() -> None:
    data = encode("JPEG", (40, 30))

    sample = describe(data, UPLOAD, "partner-a", Sidecar(), LIMIT)

    assert (sample.sha256, sample.size) == (hashlib.sha256(data).hexdigest(), len(data))


def test_describe_builds_the_whole_record() -> None:
    data = encode("WEBP", (64, 32))
    sidecar = Sidecar(caption="  a red square \n", license="\tCC-BY-4.0 ", source=" catalog 2026 ")

    sample = describe(data, UPLOAD, "partner-a", sidecar, LIMIT)

    assert sample.model_dump() == {
        "schema_version": 1, "sha256": hashlib.sha256(data).hexdigest(), "partner": "partner-a",
        "bucket": "atelier-uploads", "key": "partner-a/cat.jpg", "format": "webp", "width": 64, "height": 32,
        "size": len(data), "caption": "a red square", "license": "CC-BY-4.0", "source": "catalog 2026",
        "uploaded_at": "2026-11-29T12:00:00Z",
    }


def test_describe_without_a_sidecar_has_empty_caption_and_license() -> None:
    sample = describe(encode("PNG"), UPLOAD, "partner-a", Sidecar.model_validate({}), LIMIT)

    assert (sample.caption, sample.license, sample.source) == ("", "", "")


def test_describe_rejects_before_building_a_record() -> None:
    with pytest.raises(RejectedUpload) as raised:
        describe(b"GIF89a" + b"\0" * 20, UPLOAD, "partner-a", Sidecar(caption="x"), LIMIT)

    assert raised.value.reason == "unsupported-format"
