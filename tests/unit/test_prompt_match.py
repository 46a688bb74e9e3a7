"""atelier/prompt_match.py: the demo's prompts are catalogue captions, and the classifier reads a
picture's foreground and background colours as the catalogue draws them."""

import pytest

from atelier.catalog import COLOURS, UNSEEN, caption_of, encode, picture
from atelier.prompt_match import DEMO_PROMPTS, PROMPT, match_rate, matches, prompt_colours


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
