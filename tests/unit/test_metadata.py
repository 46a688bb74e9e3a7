"""core.ingest.metadata: the acceptance policy and the sample record (schema 2) of an upload."""

from __future__ import annotations

import hashlib
import io
import struct
from collections.abc import Iterator

import pytest
from PIL import Image

from contracts.aspect_buckets import aspect_bucket
from contracts.messages import Sidecar, UploadRef
from core.errors import RejectedUpload
from core.ingest import images
from core.ingest.metadata import caption_of, describe
from core.ingest.settings import IngestSettings

ENV = {
    "PIPELINE_TABLE": "atelier-PipelineTable", "PACK_QUEUE_URL": "https://sqs/pack", "DATA_BUCKET": "atelier-data",
    "MAX_UPLOAD_BYTES": "209715200", "MAX_SIDECAR_BYTES": "65536", "MAX_SIDECAR_DEPTH": "4", "MAX_CAPTION_CHARS": "2000", "MAX_IMAGE_PIXELS": "178956970", "ALLOWED_FORMATS": "jpeg,png,webp,tiff",
    "MIN_SHORT_SIDE": "32", "MAX_ASPECT_RATIO": "4", "STORE_MAX_SIDE": "1024", "STORE_JPEG_QUALITY": "95",
    "REENCODE": "auto", "ALPHA_BACKGROUND": "255,255,255", "NEAR_DUPLICATE_DISTANCE": "3",
    "NEAR_DUPLICATE_COLOUR_DISTANCE": "16", "PACK_LANES": "1", "SIDECAR_ORPHAN_GRACE_S": "3600",
}
SETTINGS = IngestSettings.from_env(ENV)
UPLOAD = UploadRef(bucket="atelier-uploads", key="partner-a/summer catalog/Ölgemälde 1.jpg", size=0,
                   event_time="2026-11-29T12:00:00Z", etag="e1", version_id="v1")
LICENSE = "CC-BY-4.0"


@pytest.fixture(autouse=True)
def restore_pillow_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """decode() sets Pillow's process-wide limit; put it back for the other tests."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    yield


def settings(**env: str) -> IngestSettings:
    return IngestSettings.from_env({**ENV, **env})


def save(image: Image.Image, pil_format: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=pil_format, **params)
    return buffer.getvalue()


def picture(size: tuple[int, int] = (64, 48), pil_format: str = "JPEG", **params: object) -> bytes:
    return save(Image.new("RGB", size, (200, 30, 30)), pil_format, **params)


def run(data: bytes, sidecar: Sidecar | None = None, with_settings: IngestSettings = SETTINGS):
    return describe(data, UPLOAD, "partner-a", sidecar or Sidecar(), LICENSE, with_settings)


def rejection(data: bytes, with_settings: IngestSettings = SETTINGS) -> str:
    with pytest.raises(RejectedUpload) as raised:
        run(data, with_settings=with_settings)
    return raised.value.reason


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- aspect buckets -------------------------------------------------------------------------------

@pytest.mark.parametrize(("width", "height", "bucket"), [
    (1000, 1000, "1:1"),
    (1920, 1080, "16:9"),
    (1080, 1920, "9:16"),
    (4000, 1000, "4:1"),
    (1000, 4000, "1:4"),
    (4032, 3024, "4:3"),  # a phone photo
    (6000, 4000, "3:2"),  # a DSLR photo
    (1024, 683, "3:2"),  # ... downscaled
    (2480, 3508, "2:3"),  # an A4 scan at 300 dpi (1:1.414 is nearer 2:3 than 3:4 in log space)
    (1080, 1350, "4:5"),  # a portrait post
    (2560, 1080, "2:1"),  # an ultrawide "21:9" (2.37) is nearer 2:1 than 3:1
])
def test_aspect_bucket_is_the_nearest_named_ratio(width: int, height: int, bucket: str) -> None:
    assert aspect_bucket(width, height) == bucket


# --- caption precedence ---------------------------------------------------------------------------

ALL_EMBEDDED = {"iptc": "from iptc", "xmp": "from xmp", "exif": "from exif"}


@pytest.mark.parametrize(("sidecar", "embedded", "expected"), [
    pytest.param(" from the sidecar\n", ALL_EMBEDDED, ("from the sidecar", "sidecar"), id="sidecar-wins"),
    pytest.param(" \t\n", ALL_EMBEDDED, ("from iptc", "iptc"), id="blank-sidecar-then-iptc"),
    pytest.param("", {"xmp": "from xmp", "exif": "from exif"}, ("from xmp", "xmp"), id="xmp-before-exif"),
    pytest.param("", {"exif": "from exif"}, ("from exif", "exif"), id="exif-last"),
    pytest.param("", {}, ("", "missing"), id="missing"),
])
def test_caption_comes_from_the_first_source_that_has_one(sidecar: str, embedded: dict[str, str],
                                                          expected: tuple[str, str]) -> None:
    assert caption_of(Sidecar(caption=sidecar), embedded) == expected


def with_iptc_caption(jpeg: bytes, caption: str) -> bytes:
    """The JPEG with a Photoshop APP13 segment holding an IPTC Caption/Abstract (UTF-8)."""
    iptc = b"".join(bytes([0x1C, record, tag]) + struct.pack(">H", len(value)) + value
                    for record, tag, value in [(1, 90, b"\x1b%G"), (2, 120, caption.encode())])
    resource = b"8BIM" + struct.pack(">H", 0x0404) + b"\0\0" + struct.pack(">I", len(iptc)) + iptc + bytes(len(iptc) % 2)
    payload = b"Photoshop 3.0\0" + resource
    return jpeg[:2] + b"\xff\xed" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


def xmp(description: str) -> bytes:
    return ('<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            '<rdf:Description rdf:about="" xmlns:dc="http://purl.org/dc/elements/1.1/"><dc:description><rdf:Alt>'
            f'<rdf:li xml:lang="x-default">{description}</rdf:li></rdf:Alt></dc:description></rdf:Description>'
            '</rdf:RDF></x:xmpmeta>').encode()


def exif_description(text: str) -> bytes:
    exif = Image.Exif()
    exif[0x010E] = text
    return exif.tobytes()


@pytest.fixture(scope="module")
def captioned_jpeg() -> bytes:
    """A JPEG with an IPTC caption, an XMP dc:description and an EXIF ImageDescription."""
    jpeg = picture(exif=exif_description("exif words"), xmp=xmp("xmp words"))
    return with_iptc_caption(jpeg, "iptc words")


def test_sidecar_caption_wins_over_embedded_ones(captioned_jpeg: bytes) -> None:
    sample = run(captioned_jpeg, Sidecar(caption="  the partner's caption ")).sample

    assert (sample.caption, sample.caption_source) == ("the partner's caption", "sidecar")


def test_iptc_caption_is_used_without_a_sidecar_caption(captioned_jpeg: bytes) -> None:
    sample = run(captioned_jpeg).sample

    assert (sample.caption, sample.caption_source) == ("iptc words", "iptc")


def test_xmp_description_is_used_without_iptc() -> None:
    sample = run(picture(exif=exif_description("exif words"), xmp=xmp("xmp words"))).sample

    assert (sample.caption, sample.caption_source) == ("xmp words", "xmp")


def test_exif_description_is_used_last() -> None:
    sample = run(picture(exif=exif_description("exif words"))).sample

    assert (sample.caption, sample.caption_source) == ("exif words", "exif")


def test_caption_is_marked_missing_when_no_source_has_one() -> None:
    sample = run(picture()).sample

    assert (sample.caption, sample.caption_source) == ("", "missing")


# --- the acceptance policy ------------------------------------------------------------------------

@pytest.mark.parametrize("size", [(31, 500), (500, 31), (31, 31)])
def test_short_side_under_the_minimum_is_too_small(size: tuple[int, int]) -> None:
    assert rejection(picture(size, "PNG")) == "too_small"


def test_short_side_at_the_minimum_is_accepted() -> None:
    sample = run(picture((32, 100), "PNG")).sample

    assert (sample.width, sample.height) == (32, 100)


@pytest.mark.parametrize("size", [(129, 32), (32, 129), (1000, 40)])
def test_aspect_ratio_over_the_maximum_is_bad_aspect(size: tuple[int, int]) -> None:
    assert rejection(picture(size, "PNG")) == "bad_aspect"


def test_aspect_ratio_at_the_maximum_is_accepted() -> None:
    sample = run(picture((128, 32), "PNG")).sample

    assert (sample.width, sample.height, sample.aspect_bucket) == (128, 32, "4:1")


def test_decode_rejections_pass_through_before_any_record() -> None:
    assert rejection(picture((64, 48), "GIF")) == "unsupported_format"


def test_html_named_jpg_is_not_an_image() -> None:
    assert rejection(b"<!doctype html><html><body>not an image</body></html>") == "not_an_image"


def test_pixel_limit_comes_from_the_settings() -> None:
    assert rejection(picture((100, 100), "PNG"), settings(MAX_IMAGE_PIXELS="9999")) == "too_many_pixels"


# --- what is stored -------------------------------------------------------------------------------

@pytest.mark.parametrize(("pil_format", "fmt"), [("JPEG", "jpeg"), ("PNG", "png"), ("WEBP", "webp")])
def test_clean_upload_is_stored_as_uploaded(pil_format: str, fmt: str) -> None:
    data = picture((64, 48), pil_format)

    described = run(data)

    s = described.sample
    assert described.derivative is None
    assert (s.format, s.reencoded, s.content_bucket, s.content_key, s.content_sha256, s.content_width,
            s.content_height) == (fmt, None, UPLOAD.bucket, UPLOAD.key, sha256(data), 64, 48)


def test_format_is_sniffed_from_the_bytes_not_the_name() -> None:
    # GIVEN a PNG under a .jpg key
    sample = run(picture((64, 48), "PNG")).sample

    assert (sample.format, sample.original_format, sample.extension) == ("png", "png", "png")


def test_multi_picture_jpeg_is_stored_as_a_jpeg() -> None:
    mpo = save(Image.new("RGB", (64, 48), "red"), "MPO", save_all=True, append_images=[Image.new("RGB", (64, 48), "blue")])

    described = run(mpo)

    assert (described.derivative, described.sample.format, described.sample.original_format,
            described.sample.reencoded) == (None, "jpeg", "jpeg", None)


def test_huge_tiff_is_stored_as_a_jpeg_downscaled_to_the_maximum_side() -> None:
    tiff = save(Image.new("RGB", (3000, 2000), (10, 120, 200)), "TIFF", compression="tiff_deflate")

    described = run(tiff)

    s, derivative = described.sample, described.derivative
    assert derivative is not None
    stored = Image.open(io.BytesIO(derivative))
    assert (stored.format, stored.size) == ("JPEG", (1024, 683))
    assert (s.format, s.original_format, s.original_mode, s.reencoded) == ("jpeg", "tiff", "RGB", "format tiff")
    assert (s.width, s.height, s.megapixels, s.aspect_bucket) == (3000, 2000, 6.0, "3:2")
    assert (s.content_bucket, s.content_key, s.content_width, s.content_height) \
        == ("atelier-data", f"derived/{sha256(tiff)}.jpg", 1024, 683)
    assert (s.sha256, s.size, s.content_sha256) == (sha256(tiff), len(tiff), sha256(derivative))


def test_camera_jpeg_is_stored_at_its_half_scale_decode_when_that_is_within_1_16_under_the_maximum() -> None:
    # GIVEN a 2000 x 1500 JPEG and a 1024 px maximum side: DCT scaling by 1/2 gives 1000 x 750, 2.3% under
    jpeg = save(Image.linear_gradient("L").resize((2000, 1500)).convert("RGB"), "JPEG", quality=90)

    described = run(jpeg)

    s, derivative = described.sample, described.derivative
    assert derivative is not None
    assert Image.open(io.BytesIO(derivative)).size == (1000, 750)
    assert (s.width, s.height, s.content_width, s.content_height, s.reencoded, s.content_sha256) \
        == (2000, 1500, 1000, 750, "larger than the maximum side", sha256(derivative))


def test_derivative_and_record_are_the_same_on_every_delivery() -> None:
    # SQS delivers at least once: a redelivery must write the same derived object and record.
    jpeg = save(Image.linear_gradient("L").resize((2600, 1950)).convert("RGB"), "JPEG", quality=90, progressive=True)

    first, again = run(jpeg), run(jpeg)

    assert first.derivative is not None
    assert (again.derivative, again.sample) == (first.derivative, first.sample)


def test_reencode_always_stores_a_clean_upload_as_a_jpeg() -> None:
    data = picture((64, 48), "PNG")

    described = run(data, with_settings=settings(REENCODE="always"))

    s = described.sample
    assert described.derivative is not None and Image.open(io.BytesIO(described.derivative)).format == "JPEG"
    assert (s.format, s.original_format, s.reencoded, s.content_key, s.content_sha256) \
        == ("jpeg", "png", "policy", f"derived/{sha256(data)}.jpg", sha256(described.derivative))


def test_rgba_upload_is_stored_composited_over_the_configured_background() -> None:
    image = Image.new("RGBA", (64, 48), (255, 0, 0, 0))  # fully transparent

    described = run(save(image, "PNG"), with_settings=settings(ALPHA_BACKGROUND="0,0,0"))

    assert described.derivative is not None
    stored = Image.open(io.BytesIO(described.derivative))
    assert (described.sample.reencoded, described.sample.original_mode, stored.mode) == ("mode RGBA", "RGBA", "RGB")
    assert all(v <= 2 for v in stored.getpixel((32, 24)))  # black, up to JPEG rounding


def test_rotated_upload_is_described_after_rotation_and_stored_upright() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6
    data = picture((90, 60), exif=exif.tobytes())

    described = run(data)

    s = described.sample
    assert described.derivative is not None
    assert Image.open(io.BytesIO(described.derivative)).size == (60, 90)
    assert (s.width, s.height, s.aspect_bucket, s.content_width, s.content_height, s.reencoded) \
        == (60, 90, "2:3", 60, 90, "exif orientation")


@pytest.mark.parametrize("pil_format", ["GIF", "BMP"])
def test_allowed_legacy_format_is_stored_as_a_jpeg(pil_format: str) -> None:
    allowing = settings(ALLOWED_FORMATS=f"jpeg,png,{pil_format.lower()}")

    s = run(picture((64, 48), pil_format), with_settings=allowing).sample

    assert (s.format, s.original_format, s.reencoded) == ("jpeg", pil_format.lower(), f"format {pil_format.lower()}")


def test_record_is_complete_and_exact() -> None:
    data = picture((64, 32), "WEBP")
    sidecar = Sidecar(caption="  a red square \n", license="CC-BY-4.0", source=" catalog 2026 ")

    sample = run(data, sidecar).sample

    assert sample.model_dump() == {
        "schema_version": 2, "sha256": sha256(data), "partner": "partner-a", "bucket": "atelier-uploads",
        "key": "partner-a/summer catalog/Ölgemälde 1.jpg", "version_id": "v1", "format": "webp",
        "width": 64, "height": 32, "size": len(data), "caption": "a red square", "caption_source": "sidecar",
        "license": "CC-BY-4.0", "source": "catalog 2026", "uploaded_at": "2026-11-29T12:00:00Z",
        "original_format": "webp", "original_mode": "RGB", "megapixels": 0.002, "aspect_bucket": "2:1",
        "phash": images.dhash(Image.open(io.BytesIO(data))),
        "colour": images.colour_signature(Image.open(io.BytesIO(data)).convert("RGB")), "near_duplicate_of": None,
        "near_duplicate_distance": None, "near_duplicate_colour_distance": None, "content_bucket": "atelier-uploads",
        "content_key": "partner-a/summer catalog/Ölgemälde 1.jpg", "content_sha256": sha256(data),
        "content_width": 64, "content_height": 32, "reencoded": None,
    }


def test_sha256_is_of_the_exact_uploaded_bytes() -> None:
    # Two byte-different files of the same picture are different samples.
    a, b = picture((64, 48), quality=90), picture((64, 48), quality=91)
    assert a != b

    assert (run(a).sample.sha256, run(b).sample.sha256) == (sha256(a), sha256(b))


def test_same_picture_reencoded_gets_the_same_phash() -> None:
    # a fade from white (left) to black (right), with a dark block top left: a hash of mixed bits
    picture = Image.linear_gradient("L").rotate(-90).resize((256, 192)).convert("RGB")
    picture.paste((0, 0, 0), (0, 0, 96, 96))
    png = save(picture, "PNG")
    jpeg = save(picture.resize((128, 96)), "JPEG", quality=60)

    phash = run(png).sample.phash

    assert phash not in ("0000000000000000", "ffffffffffffffff")
    assert run(jpeg).sample.phash == phash
