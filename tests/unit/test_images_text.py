"""core.ingest.images' embedded descriptions (EXIF, IPTC, XMP) and the stored derivative."""

from __future__ import annotations

import io
import struct

import pytest
from PIL import Image, JpegImagePlugin, PngImagePlugin

from core.ingest import images
from tests.unit.images_helpers import (  # noqa: F401  (restore_pillow_limit: fixtures)
    POLICY,
    restore_pillow_limit,
    save,
    scene,
)


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
