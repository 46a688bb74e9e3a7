"""atelier/prompt_match.py: the demo's prompts are catalogue captions, and the classifiers read a
picture's foreground and background colours, and its shape, as the catalogue draws them."""

import io
import random

import numpy as np
import pytest
from PIL import Image, ImageFilter

from atelier.catalog import COLOURS, SHAPES, UNSEEN, caption_of, encode, picture
from atelier.prompt_match import (DEMO_PROMPTS, GRID_PROMPTS, PROMPT, grid_match_rate, match_rate, matches,
                                  matches_grid, picture_shape, prompt_colours)


def test_the_demo_prompts_are_catalogue_captions_half_of_them_never_trained_on() -> None:
    assert isinstance(PROMPT, str) and DEMO_PROMPTS[0] == PROMPT
    assert all(prompt_colours(prompt) for prompt in DEMO_PROMPTS)
    assert DEMO_PROMPTS[-len(UNSEEN):] == [caption_of(*combo) for combo in UNSEEN]


@pytest.mark.parametrize("shape, colour, ground", [("circle", "red", "blue"), ("triangle", "white", "black"),
                                                   ("square", "yellow", "green")])
def test_a_catalogue_picture_matches_its_caption_and_not_its_swap(shape: str, colour: str, ground: str) -> None:
    png = encode(picture(shape, colour, ground, size=32), "png")

    assert matches(caption_of(shape, colour, ground), png)
    assert not matches(caption_of(shape, ground, colour), png)
    assert match_rate([(caption_of(shape, colour, ground), png), (caption_of(shape, ground, colour), png)]) == 0.5


def test_a_prompt_outside_the_catalogue_is_refused() -> None:
    with pytest.raises(ValueError, match="not a catalogue prompt"):
        prompt_colours("a photo of a cat")
    assert "purple" not in COLOURS


def blurred_and_noisy(shape: str, colour: str, ground: str, rng: random.Random, noise: np.random.Generator) -> bytes:
    """A catalogue picture as a small model draws it: soft edges, grainy flat colours."""
    image = picture(shape, colour, ground, size=64, jitter=rng).filter(ImageFilter.GaussianBlur(2))
    pixels = np.asarray(image).astype(float) + noise.normal(0, 12, (64, 64, 3))
    return encode(Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)), "png")


def test_the_grid_is_every_shape_foreground_and_background_the_unseen_ones_too() -> None:
    assert len(GRID_PROMPTS) == len(set(GRID_PROMPTS)) == len(SHAPES) * len(COLOURS) * (len(COLOURS) - 1) == 90
    assert {caption_of(*combo) for combo in UNSEEN} <= set(GRID_PROMPTS)


def test_every_grid_picture_drawn_soft_and_grainy_matches_its_prompt_and_no_other_shape() -> None:
    rng, noise = random.Random(0), np.random.default_rng(0)
    results = []
    for prompt in GRID_PROMPTS:
        _, colour, shape, _, _, ground, _ = prompt.split()
        png = blurred_and_noisy(shape, colour, ground, rng, noise)
        results.append((prompt, png))
        for other in SHAPES:
            if other != shape:
                assert not matches_grid(caption_of(other, colour, ground), png), (prompt, other)
    assert grid_match_rate(results) == 1.0


@pytest.mark.parametrize("shape", SHAPES)
def test_a_picture_reads_as_its_shape_whatever_its_margin(shape: str) -> None:
    for seed in range(6):  # the catalogue's margins run from an eighth to a quarter of the side
        image = picture(shape, "white", "black", size=96, jitter=random.Random(seed))
        assert picture_shape(image) == shape


def test_a_picture_with_no_figure_or_pure_noise_matches_no_prompt() -> None:
    flat = encode(Image.new("RGB", (64, 64), COLOURS["blue"]), "png")
    noise = np.random.default_rng(1)
    noisy = [encode(Image.fromarray(noise.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "png") for _ in range(20)]

    assert picture_shape(Image.open(io.BytesIO(flat))) == "none"
    assert grid_match_rate([(prompt, png) for prompt, png in zip(GRID_PROMPTS, [flat, *noisy])]) == 0.0
