"""Safe decoding and normalisation of uploaded images, with Pillow alone.

Rules (docs/metadata.md): the format is sniffed, never taken from the name; the decompression
bomb guard stays on at an explicit limit; every byte of the image is decoded (JPEG in draft mode,
DCT-scaled to the smallest size that serves, which still reads the whole entropy-coded stream, so
truncation is caught); EXIF orientation is applied; every colour mode becomes RGB by a stated rule
(alpha over `background`). A JPEG cut short and closed with an end marker is caught too, though
libjpeg decodes it without an error (`_scan_cut_short`).
"""

from __future__ import annotations

import io
import random
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageChops, ImageCms, ImageOps, UnidentifiedImageError

from core.errors import RejectedUpload

# Pillow's format id -> ours. MPO is the multi-picture JPEG phones write; Pillow reports it so.
KNOWN_FORMATS: dict[str, str] = {"JPEG": "jpeg", "MPO": "jpeg", "PNG": "png", "WEBP": "webp", "TIFF": "tiff",
                                 "BMP": "bmp", "GIF": "gif"}
# Formats we recognise by their first bytes: named when unsupported, and how image bytes under a
# sidecar's name are told from JSON.
MAGIC: tuple[tuple[re.Pattern[bytes], str], ...] = (
    (re.compile(rb"^(\xef\xbb\xbf)?\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*(<!DOCTYPE svg[^>]*>\s*)?<svg", re.S | re.I),
     "svg"),
    (re.compile(rb"^%PDF-"), "pdf"),
    (re.compile(rb"^....ftyp(heic|heix|hevc|heim|heis|mif1|msf1)"), "heic"),
    (re.compile(rb"^....ftypavi[fs]"), "avif"),
    (re.compile(rb"^8BPS"), "psd"),
    (re.compile(rb"^\x00\x00\x01\x00"), "ico"),
    (re.compile(rb"^GIF8[79]a"), "gif"),
    (re.compile(rb"^BM"), "bmp"),
    (re.compile(rb"^(II\*\x00|MM\x00\*)"), "tiff"),
    # Reached only when these formats are left out of ALLOWED_FORMATS:
    (re.compile(rb"^\xff\xd8\xff"), "jpeg"),
    (re.compile(rb"^\x89PNG\r\n\x1a\n"), "png"),
    (re.compile(rb"^RIFF....WEBP", re.S), "webp"),
)
PILLOW_NAMES = {ours: name for name, ours in KNOWN_FORMATS.items() if name != "MPO"}
SRGB = ImageCms.createProfile("sRGB")
EOI = b"\xff\xd9"
# Bytes put before a JPEG's end marker to see whether its scan still wanted data (`_scan_cut_short`):
# fixed, varied, and never 0xFF (which would start a marker).
SCAN_PROBE = bytes(b % 255 for b in random.Random(0).randbytes(64))
MID_GREY = 128  # in every channel: what libjpeg fills the blocks of a scan that ended early with
SHARD_FORMATS = frozenset({"jpeg", "png", "webp"})  # what a shard may carry unchanged
HASH_SIDE = 64  # enough pixels for the perceptual hash when the original bytes are kept
COLOUR_GRID = 4  # cells a side of the colour signature: 16 cells x (Cb, Cr) = 32 bytes
# A JPEG to re-encode is DCT-scaled (1/2, 1/4, 1/8) to a long side down to 1/16 under the maximum
# side and stored at that size: the resize over that last 1/16 (a 12 MP camera photo, 4000 or 4032
# long, to 2048 instead of its half-scale 2000 or 2016) costs twice the rest of its ingest and more
# (docs/metadata.md, "What bounds ingest").
STORE_SLACK = 16
# A progressive JPEG is decoded at 1/2 scale at most: at 1/8 libjpeg uses DC coefficients alone, so a
# file cut in an AC scan decodes to the same pixels with or without the truncation probe (tests).
PROGRESSIVE_SCALE = 2


@dataclass(frozen=True)
class DecodePolicy:
    allowed: frozenset[str]  # our format names
    max_pixels: int
    background: tuple[int, int, int]
    max_side: int  # stored images are at most this long
    reencode: str  # "auto": only what is not clean; "always"


@dataclass(frozen=True)
class DecodedImage:
    """An upload decoded to RGB, with what was learned on the way."""

    format: str  # ours: jpeg, png, webp, tiff, ...
    mode: str  # Pillow's mode before conversion
    width: int  # after EXIF orientation, at full resolution
    height: int
    rgb: Image.Image  # RGB, oriented; a JPEG may be decoded at a reduced (DCT) scale: see jpeg_scale
    reencode: str | None  # why the stored bytes must be re-encoded; None keeps the original
    text: dict[str, str]  # embedded descriptions: exif, iptc, xmp


def sniff_format(data: bytes) -> str | None:
    """The name of the image format these bytes start with, if we know it (decodable or not)."""
    head = data[:512]
    return next((name for pattern, name in MAGIC if pattern.match(head)), None)


def decode(data: bytes, policy: DecodePolicy) -> DecodedImage:
    """Decode every byte of `data` into an oriented RGB image, or raise RejectedUpload."""
    if not data:
        raise RejectedUpload("empty", "the object has no bytes")
    Image.MAX_IMAGE_PIXELS = policy.max_pixels  # the decompression-bomb guard stays on, at our limit
    Image.WARN_POSSIBLE_FORMATS = True  # a plugin's reason for refusing bytes of its format, as a warning
    opening: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as opening:
            warnings.simplefilter("always")
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return _decode(data, policy)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise RejectedUpload("too_many_pixels", str(exc)) from exc
    except UnidentifiedImageError as exc:
        raise _unidentified(data, policy, [str(w.message) for w in opening]) from exc
    except RejectedUpload:
        raise
    except OSError as exc:
        reason = "truncated" if "truncated" in str(exc).lower() else "corrupt"
        raise RejectedUpload(reason, str(exc)) from exc
    except (SyntaxError, ValueError, EOFError) as exc:
        raise RejectedUpload("corrupt", str(exc)) from exc
    except ImageCms.PyCMSError as exc:  # an ICC profile that does not fit the pixels
        raise RejectedUpload("corrupt", f"ICC profile: {exc}") from exc


def _unidentified(data: bytes, policy: DecodePolicy, opening: list[str]) -> RejectedUpload:
    """Why no allowed plugin opened `data`: an allowed format whose plugin refused it is corrupt (with
    the plugin's words); a known format not allowed is named with the allowed list; else not an image."""
    sniffed = sniff_format(data)
    if sniffed is None:
        return RejectedUpload("not_an_image", "no supported image format matches these bytes")
    if sniffed not in policy.allowed:
        return RejectedUpload("unsupported_format", f"{sniffed} (allowed: {', '.join(sorted(policy.allowed))})")
    prefix = f"{PILLOW_NAMES.get(sniffed, sniffed.upper())} opening failed. "
    said = next((message.removeprefix(prefix) for message in opening if message.startswith(prefix)), "")
    return RejectedUpload("corrupt", f"{sniffed}: {said or 'its header cannot be read'}")


def _decode(data: bytes, policy: DecodePolicy) -> DecodedImage:
    pillow_formats = [name for name, ours in KNOWN_FORMATS.items() if ours in policy.allowed and name != "MPO"]
    with Image.open(io.BytesIO(data), formats=pillow_formats) as image:
        fmt = KNOWN_FORMATS[image.format or ""]
        orientation = image.getexif().get(0x0112, 1) or 1
        full_size, mode, text = image.size, image.mode, embedded_text(image)
        reason = reencode_reason(fmt, mode, orientation, "transparency" in image.info, full_size, policy)
        draft = full_size
        if fmt == "jpeg":
            # Decode at the smallest DCT scale that still serves: the whole stream is still read.
            scale = jpeg_scale(full_size, policy.max_side) if reason else _hash_scale(full_size)
            if image.info.get("progressive"):
                scale = min(scale, PROGRESSIVE_SCALE)
            draft = _draft_box(full_size, scale)
            image.draft("RGB", draft)
        image.load()
        if fmt == "jpeg" and _scan_cut_short(data, image, draft):
            raise RejectedUpload("truncated", "the JPEG's scan ends before its last block: the file was cut "
                                              "short and closed with an end marker")
        ImageOps.exif_transpose(image, in_place=True)  # in place: otherwise an upright image is copied whole
        width, height = (full_size[1], full_size[0]) if orientation in (5, 6, 7, 8) else full_size
        return DecodedImage(fmt, mode, width, height, to_rgb(image, policy.background), reason, text)


def jpeg_scale(size: tuple[int, int], max_side: int) -> int:
    """The DCT scale divisor (1, 2, 4, 8) to decode a JPEG at for a derivative at most `max_side` long:
    the largest whose long side stays no more than 1/STORE_SLACK under `max_side`."""
    least = max_side - max_side // STORE_SLACK
    return next((scale for scale in (8, 4, 2) if -(-max(size) // scale) >= least), 1)


def _hash_scale(size: tuple[int, int]) -> int:
    """The DCT scale divisor for a kept JPEG, decoded only to be hashed: both sides >= HASH_SIDE."""
    return next((scale for scale in (8, 4, 2) if min(size) // scale >= HASH_SIDE), 1)


def _draft_box(size: tuple[int, int], scale: int) -> tuple[int, int]:
    """The size to ask Image.draft for so that it picks `scale`: it takes the largest scale both
    sides divide into (a ceiling-divided size would make it pick the next scale down)."""
    return max(1, size[0] // scale), max(1, size[1] // scale)


def _scan_cut_short(data: bytes, decoded: Image.Image, draft: tuple[int, int]) -> bool:
    """Whether the scan ran out of data before the end of the image, though an end marker follows.

    libjpeg fills the blocks it has no data for with mid-grey and only warns, which Pillow does not
    pass on. So the bytes are decoded again with SCAN_PROBE just before the last end marker: a
    complete scan never reads them (they are skipped before the marker), a scan cut short decodes
    them as blocks, and the pixels differ. The second decode is paid only when the last pixel is
    libjpeg's grey (a baseline scan cut anywhere but in its last block) or the file is progressive
    (later scans refine pixels already there), and at the same DCT scale as the first (`draft`, the
    same request: asking for the decoded size would pick a larger scale when a side is not a multiple
    of the scale). A progressive file cut exactly between two scans has every pixel at a lower
    quality, which libjpeg deems complete: it passes.
    """
    last = decoded.getpixel((decoded.width - 1, decoded.height - 1))
    grey = set(last if isinstance(last, tuple) else (last,)) == {MID_GREY}
    end = data.rfind(EOI)
    if end < 0 or not (grey or decoded.info.get("progressive")):
        return False
    with Image.open(io.BytesIO(data[:end] + SCAN_PROBE + data[end:]), formats=["JPEG"]) as probe:
        probe.draft("RGB", draft)
        try:
            probe.load()
        except OSError:
            return True  # the probe's bytes were read as scan data and did not decode
        # compared in C, without copying both pictures out (a third of the cost at 3 MP)
        return probe.size != decoded.size or ImageChops.difference(probe, decoded).getbbox(alpha_only=False) is not None


def reencode_reason(fmt: str, mode: str, orientation: int, transparency: bool, size: tuple[int, int],
                    policy: DecodePolicy) -> str | None:
    """Why the stored image cannot be the uploaded bytes (None: keep them)."""
    if policy.reencode == "always":
        return "policy"
    if fmt not in SHARD_FORMATS:
        return f"format {fmt}"
    if mode not in ("RGB", "L") or transparency:
        return f"mode {mode}{' with transparency' if transparency else ''}"
    if orientation != 1:
        return "exif orientation"
    if max(size) > policy.max_side:
        return "larger than the maximum side"
    return None


def encode_jpeg(rgb: Image.Image, max_side: int, quality: int) -> tuple[bytes, tuple[int, int]]:
    """The stored derivative, at most `max_side` long, high-quality 4:4:4 JPEG; and its size."""
    if max(rgb.size) > max_side:
        scale = max_side / max(rgb.size)
        rgb = rgb.resize((max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale))),
                         Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=quality, subsampling=0)
    return buffer.getvalue(), rgb.size


def to_rgb(image: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    """Every mode to RGB, deliberately: alpha composited over `background`, 16-bit scaled to 8,
    CMYK through its ICC profile when it has one."""
    if image.mode == "RGB" and "transparency" not in image.info:
        return image
    if image.mode == "CMYK":
        profile = image.info.get("icc_profile")
        if profile:
            source = ImageCms.ImageCmsProfile(io.BytesIO(profile))
            return ImageCms.profileToProfile(image, source, SRGB, outputMode="RGB")
        return image.convert("RGB")
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit (or 32-bit integer) grey: keep the top 8 bits of the 16-bit range.
        return image.point(lambda value: value / 256).convert("L").convert("RGB")
    if image.mode == "F":
        return image.point(lambda value: value * 255).convert("L").convert("RGB")
    if image.mode in ("P", "PA", "LA", "La", "RGBa", "RGBA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, background)
        canvas.paste(rgba, mask=rgba.getchannel("A"))
        return canvas
    return image.convert("RGB")  # 1, L, YCbCr, LAB, HSV


def embedded_text(image: Image.Image) -> dict[str, str]:
    """Descriptions embedded in the file: EXIF ImageDescription, IPTC caption, XMP dc:description."""
    from PIL import IptcImagePlugin

    text: dict[str, str] = {}
    exif = image.getexif().get(0x010E)
    if isinstance(exif, bytes):
        exif = exif.decode("utf-8", "replace")
    elif isinstance(exif, str):
        exif = _utf8_read_as_latin1(exif)
    if isinstance(exif, str) and exif.strip():
        text["exif"] = exif.strip()
    iptc = IptcImagePlugin.getiptcinfo(image) or {}
    caption = iptc.get((2, 120))
    if isinstance(caption, list):
        caption = caption[0] if caption else None
    if isinstance(caption, bytes) and caption.strip():
        text["iptc"] = caption.decode("utf-8", "replace").strip()
    xmp = image.info.get("xmp") or image.info.get("XML:com.adobe.xmp")
    if xmp:
        description = _xmp_description(xmp if isinstance(xmp, bytes) else str(xmp).encode())
        if description:
            text["xmp"] = description
    return text


def _utf8_read_as_latin1(text: str) -> str:
    """EXIF ASCII tags hold UTF-8 in practice (phones, exiftool); Pillow reads them as Latin-1."""
    try:
        return text.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text


def _xmp_description(xmp: bytes) -> str | None:
    """dc:description's first rdf:li, without an XML parser (XMP is a small, regular packet)."""
    match = re.search(rb"<dc:description>.*?<rdf:li[^>]*>(.*?)</rdf:li>", xmp, re.S)
    if not match:
        return None
    value = match.group(1).decode("utf-8", "replace").strip()
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&apos;", "'"), ("&amp;", "&")):
        value = value.replace(entity, char)
    return value or None


def dhash(image: Image.Image) -> str:
    """A 64-bit difference hash: 16 hex digits; near-identical pictures differ in few bits."""
    # reducing_gap box-averages first, to at least 8 pixels a cell: the cells differ from a plain
    # Lanczos resample's by rounding, so only near-ties flip (tests: within the near-duplicate
    # distance, equal for most photos), at a third of its cost on a 3 MP image.
    pixels = image.convert("L").resize((9, 8), Image.Resampling.LANCZOS, reducing_gap=8.0).tobytes()
    bits = 0
    for row in range(8):
        for col in range(8):
            bits = (bits << 1) | (pixels[row * 9 + col] > pixels[row * 9 + col + 1])
    return f"{bits:016x}"


def hamming(a: str, b: str) -> int:
    return (int(a, 16) ^ int(b, 16)).bit_count()


def colour_signature(rgb: Image.Image) -> str:
    """The mean chroma (Cb, Cr) of each cell of a COLOUR_GRID x COLOUR_GRID grid: 64 hex digits.

    dHash sees luminance alone, so a recolouring (channels swapped, hue turned, an object painted
    another colour) hashes like the original; these means tell it apart, while a re-encode or a
    rescale moves them by a few levels (tests). Chroma, not RGB: a brighter or darker copy is still
    the picture dHash says it is. A grid, not one mean: a recoloured sixteenth of the picture moves
    its cell's mean sixteen times as far as the whole picture's.
    """
    cells = rgb.resize((COLOUR_GRID, COLOUR_GRID), Image.Resampling.BOX).convert("YCbCr").tobytes()
    return (cells[1::3] + cells[2::3]).hex()  # every Cb, then every Cr (Y is dHash's business)


def colour_distance(a: str, b: str) -> int:
    """The largest difference, in 8-bit levels, between two signatures' cell means."""
    return max(abs(x - y) for x, y in zip(bytes.fromhex(a), bytes.fromhex(b), strict=True))
