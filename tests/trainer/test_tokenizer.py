"""trainer.tokenizer: the offline caption tokenizer and its round trip through a pipeline directory."""

from transformers import AutoTokenizer

from trainer.tokenizer import build_tokenizer


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids


def test_the_vocabulary_is_the_same_on_every_build():
    assert build_tokenizer().get_vocab() == build_tokenizer().get_vocab()
    assert len(build_tokenizer()) == 307


def test_special_tokens_have_fixed_ids_with_eos_not_2():
    tokenizer = build_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2, 3)
    assert tokenizer.model_max_length == 77


def test_known_words_are_one_token_and_others_are_spelled():
    tokenizer = build_tokenizer()
    encoded = tokenizer("A red Dog, xyz 42 café").input_ids
    assert tokenizer.convert_ids_to_tokens(encoded) == [
        "<bos>", "a", "red", "dog", ",", "x", "##y", "##z", "4", "##2", "c", "##a", "##f", "##e", "<eos>",
    ]


def test_captions_are_padded_and_truncated_to_77_ending_in_eos():
    tokenizer = build_tokenizer()
    short, long = ids(tokenizer, "a dog"), ids(tokenizer, "dog " * 200)
    assert short[:4] == [2, tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("dog"), 3]
    assert short[4:] == [0] * 73
    assert len(long) == 77 and long[0] == 2 and long[-1] == 3


def test_characters_outside_ascii_become_unk():
    tokenizer = build_tokenizer()
    assert tokenizer("中").input_ids == [2, 1, 3]


def test_save_and_load_give_the_same_ids(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    caption = "Two dogs running on the beach at sunset, 4k!"
    assert ids(loaded, caption) == ids(tokenizer, caption)
    assert loaded.model_max_length == 77
