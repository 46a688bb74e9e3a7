"""What the core.ingest.images tests share: the decode policy, and pictures made here.

Every input is generated here, shaped like what partners really send (no binary fixtures).
"""

from __future__ import annotations

import dataclasses
import io
import random
from collections.abc import Iterator

import pytest
from PIL import Image, ImageDraw, ImageFilter

from core.errors import RejectedUpload
from core.ingest import images
from core.ingest.images import DecodePolicy

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
