"""A small licensed "partner catalog" made locally: simple pictures with captions and licenses.

The demo and the tests need real images with real captions and no download; coloured shapes on
coloured grounds give a text-to-image model something it can learn in a few CPU minutes.

`procedural_catalog` is the demo's: every shape x colour x background, with captions built from the
attributes ("a red circle on a blue background"), except the combinations in `UNSEEN`, which only
the demo's prompts name, so the prompt match rate (atelier/prompt_match.py) measures composition,
not recall.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "white": (245, 245, 245), "black": (20, 20, 20)}
SHAPES = ("circle", "square", "triangle")
FORMATS = {"png": "PNG", "jpg": "JPEG", "webp": "WEBP"}
LICENSE = "CC-BY-4.0"


@dataclass(frozen=True)
class CatalogItem:
    name: str  # path inside the catalog, e.g. "shapes/0003-red-circle.png"
    image: bytes
    sidecar: dict[str, str]

    @property
    def sidecar_name(self) -> str:
        return self.name.rsplit(".", 1)[0] + ".json"


def picture(shape: str, colour: str, ground: str, size: int = 96, jitter: random.Random | None = None) -> Image.Image:
    rng = jitter or random.Random(0)
    image = Image.new("RGB", (size, size), COLOURS[ground])
    draw = ImageDraw.Draw(image)
    margin = rng.randint(size // 8, size // 4)
    box = (margin, margin, size - margin, size - margin)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(size // 2, margin), (size - margin, size - margin), (margin, size - margin)], fill=COLOURS[colour])
    return image


def encode(image: Image.Image, extension: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=FORMATS[extension], **({"quality": 90} if extension != "png" else {}))
    return buffer.getvalue()


def make_catalog(count: int, seed: int = 0) -> list[CatalogItem]:
    """`count` distinct pictures, cycling through formats, each with a caption and a license."""
    rng = random.Random(seed)
    items: list[CatalogItem] = []
    combinations = [(c, g) for c in sorted(COLOURS) for g in sorted(COLOURS) if c != g]
    rng.shuffle(combinations)  # distinct (colour, ground) pairs: no accidental duplicates
    for index in range(count):
        shape = SHAPES[index % len(SHAPES)]
        colour, ground = combinations[index % len(combinations)]
        extension = list(FORMATS)[index % len(FORMATS)]
        caption = f"a {colour} {shape} on a {ground} background"
        data = encode(picture(shape, colour, ground, jitter=rng), extension)
        items.append(CatalogItem(
            name=f"shapes/{index:04d} {colour} {shape}.{extension}",  # spaces on purpose: real names have them
            image=data, sidecar={"caption": caption, "license": LICENSE, "source": "atelier synthetic catalog"},
        ))
    return items


def write_catalog(items: list[CatalogItem], folder: Path) -> None:
    for item in items:
        path = folder / item.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(item.image)
        (folder / item.sidecar_name).write_text(json.dumps(item.sidecar))


DEMO_IMAGES = 252  # the demo's training pictures: three of every combination the catalogue shows
EVAL_IMAGES = 12  # held-out pictures the autoencoder's PSNR and the deploy gate's loss are measured on

# (shape, colour, background) never uploaded for training: the demo asks for them all the same.
UNSEEN = (("square", "red", "blue"), ("circle", "green", "black"), ("triangle", "yellow", "blue"),
          ("circle", "white", "red"), ("square", "blue", "yellow"), ("triangle", "black", "white"))


def caption_of(shape: str, colour: str, ground: str) -> str:
    return f"a {colour} {shape} on a {ground} background"


def training_combinations() -> list[tuple[str, str, str]]:
    """Every (shape, colour, background) a training picture shows: all but UNSEEN."""
    return [(shape, colour, ground) for shape in SHAPES for colour in sorted(COLOURS) for ground in sorted(COLOURS)
            if colour != ground and (shape, colour, ground) not in UNSEEN]


def procedural_catalog(variants: int, size: int = 64, seed: int = 0) -> list[CatalogItem]:
    """`variants` pictures of every (shape, colour, background) outside UNSEEN, each a little moved and
    resized, in a shuffled order; PNG (lossless: the colours are the captions' exactly)."""
    rng = random.Random(seed)
    work = [(combo, variant) for combo in training_combinations() for variant in range(variants)]
    rng.shuffle(work)
    items, seen = [], set()
    for index, ((shape, colour, ground), variant) in enumerate(work):
        data = None
        while data is None or data in seen:  # the same jitter twice would be an exact duplicate upload
            image = picture(shape, colour, ground, size=size, jitter=rng)
            shift = size // 16
            image = image.rotate(0, translate=(rng.randint(-shift, shift), rng.randint(-shift, shift)),
                                 fillcolor=COLOURS[ground])
            data = encode(image, "png")
        seen.add(data)
        items.append(CatalogItem(
            name=f"procedural/{index:05d} {colour} {shape} on {ground} {variant}.png",
            image=data,
            sidecar={"caption": caption_of(shape, colour, ground), "license": LICENSE, "source": "atelier procedural catalog"},
        ))
    return items
