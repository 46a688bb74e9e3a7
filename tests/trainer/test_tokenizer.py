"""trainer.models.tokenizer: caption tokenizers learned from captions (CLIP BPE, T5), their round trip
through a pipeline directory, and the preset's set of them (trainer.models.text_tokenizers)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline
from transformers import AutoTokenizer, CLIPTokenizer, T5TokenizerFast

from trainer.models import text_tokenizers
from trainer.models.loading import from_preset, read_preset
from trainer.models.pipelines import build_pipeline
from trainer.models.text import tokenize
from trainer.models.tokenizer import caption_figures, learn_clip, learn_t5
import trainer

# The corpus a tokenizer is learned from in these tests: shapes and colours, as the demo's captions.
COLOURS = "red orange yellow green blue purple pink brown black white gray".split()
SHAPES = "circle square triangle hexagon star diamond heart ellipse".split()
CORPUS = [f"a {c} {s} on a {b} background" for c in COLOURS for s in SHAPES for b in COLOURS if b != c]


def build_tokenizer() -> CLIPTokenizer:
    return learn_clip(CORPUS)


# Known words, words the corpus lacks, case and spacing, punctuation, digits, accents and other
# scripts, an emoji, a literal special token, the empty caption of caption dropout, and captions past 77 tokens.
CAPTIONS = [
    "a red circle on a blue background",
    "A  Red\tCIRCLE,  top-left corner!",
    "xylophone quokka zeppelin",
    "it's 42 o'clock; 3.14 > 2 & 100% (really?) \"quoted\" #tag @user",
    "café naïve résumé Ærø straße",
    "中文 日本語 한국어 Ελληνικά русский",
    "a cat 😀 on the moon 🌙",
    "<|endoftext|> in the text",
    "",
    "dog " * 200,
    "supercalifragilisticexpialidocious " * 20,
]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids


def vocabulary_and_merges(tokenizer) -> tuple[dict, list]:
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    return model["vocab"], model["merges"]


def test_it_is_a_clip_tokenizer_with_clip_special_tokens():
    tokenizer = build_tokenizer()
    size = len(tokenizer)
    assert type(tokenizer) is CLIPTokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|startoftext|>", "<|endoftext|>", "<|endoftext|>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (size - 2, size - 1, size - 1)
    assert tokenizer.model_max_length == 77


def test_the_vocabulary_starts_with_clips_byte_symbols_then_each_ending_a_word():
    tokens = build_tokenizer().convert_ids_to_tokens(list(range(512)))
    assert tokens[:3] == ["!", '"', "#"] and tokens[93:95] == ["~", "¡"] and tokens[188:190] == ["Ā", "ā"]
    assert tokens[256:] == [token + "</w>" for token in tokens[:256]]
    assert len(set(tokens)) == 512


def test_two_builds_give_the_same_vocabulary_and_merges():
    assert vocabulary_and_merges(build_tokenizer()) == vocabulary_and_merges(build_tokenizer())


def test_another_process_learns_the_same_vocabulary_and_merges_from_the_captions_in_another_order():
    shuffled = CORPUS[:]
    random.Random(7).shuffle(shuffled)
    script = ("import json, sys; from trainer.models.tokenizer import learn_clip; "
              "print(learn_clip(json.load(sys.stdin)).backend_tokenizer.to_str())")
    repo_root = Path(trainer.__file__).resolve().parent.parent
    output = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, check=True,
                            input=json.dumps(shuffled))
    model = json.loads(output.stdout)["model"]
    assert (model["vocab"], model["merges"]) == vocabulary_and_merges(build_tokenizer())


def test_the_t5_tokenizer_is_the_same_in_another_process_for_the_captions_in_another_order():
    shuffled = CORPUS[::-1]
    script = ("import json, sys; from trainer.models.tokenizer import learn_t5; "
              "print(learn_t5(json.load(sys.stdin), 256).backend_tokenizer.to_str())")
    repo_root = Path(trainer.__file__).resolve().parent.parent
    output = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, check=True,
                            input=json.dumps(shuffled))
    assert json.loads(output.stdout)["model"] == json.loads(learn_t5(CORPUS, 256).backend_tokenizer.to_str())["model"]


def test_every_word_the_captions_repeat_is_learned_as_one_token():
    tokenizer = build_tokenizer()
    words = sorted({word for caption in CORPUS for word in caption.split()})
    assert [word for word in words if tokenizer.tokenize(word) != [word + "</w>"]] == []


def test_a_caption_of_known_words_is_bos_a_token_per_word_eos_then_eos_padding():
    tokenizer = build_tokenizer()
    encoded = ids(tokenizer, "a red circle on a blue background")
    assert tokenizer.convert_ids_to_tokens(encoded[:9]) == [
        "<|startoftext|>", "a</w>", "red</w>", "circle</w>", "on</w>", "a</w>", "blue</w>", "background</w>",
        "<|endoftext|>",
    ]
    assert encoded[9:] == [tokenizer.eos_token_id] * 68


def test_the_vocabulary_size_is_a_ceiling_the_tokenizer_never_passes():
    small = learn_clip(CORPUS, vocab_size=530)
    assert len(small) == 530 and max(id_ for caption in CAPTIONS for id_ in ids(small, caption)) < 530
    assert len(learn_t5(CORPUS, 256, vocab_size=120)) <= 120


def test_case_and_whitespace_do_not_change_the_ids():
    tokenizer = build_tokenizer()
    assert ids(tokenizer, "  A\tRED \n Circle ") == ids(tokenizer, "a red circle")


def test_unknown_words_punctuation_digits_and_other_scripts_fall_back_to_pieces_and_bytes():
    tokenizer = build_tokenizer()
    assert tokenizer.tokenize("Café, 42!") == ["c", "a", "f", "Ã", "©</w>", ",</w>", "4</w>", "2</w>", "!</w>"]
    assert tokenizer.unk_token_id not in tokenizer("中 😀 é").input_ids[1:-1]
    assert tokenizer.decode(tokenizer("中 😀 é", add_special_tokens=False).input_ids) == "中 😀 é"


def test_any_text_tokenizes_with_a_tokenizer_learned_from_no_captions():
    for tokenizer in (learn_clip([]), learn_t5([], 256)):
        for caption in CAPTIONS:
            assert tokenizer(caption).input_ids[-1] == tokenizer.eos_token_id


def test_the_t5_tokenizer_has_t5s_special_ids_and_one_piece_per_known_word():
    tokenizer = learn_t5(CORPUS, 256)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert tokenizer.tokenize("a red circle on a blue background") == [
        "▁a", "▁red", "▁circle", "▁on", "▁a", "▁blue", "▁background"]
    assert tokenizer("中").input_ids == [tokenizer.convert_tokens_to_ids("▁"), 2, 1]


def test_the_t5_tokenizer_covers_every_character_of_its_captions_as_they_are_written(tmp_path):
    """Learned on the text the saved tokenizer splits (no normalizer): decomposed accents and ligatures the
    captions hold are pieces, not <unk> (learned on NFKC text, they were unknown after loading)."""
    written = ["cafe\u0301 cre\u0300me bru\u0302le\u0301e", "\ufb01ne \uff26\uff35\uff2c\uff2c print"]
    tokenizer = learn_t5(CORPUS + written * 3, 256)
    tokenizer.save_pretrained(tmp_path / "t5")
    loaded = T5TokenizerFast.from_pretrained(tmp_path / "t5")
    for caption in written:
        assert tokenizer.unk_token_id not in loaded(caption).input_ids, loaded.tokenize(caption)


def test_pixart_s_tokenizer_is_learned_and_measured_on_the_lowercased_prompts_its_pipeline_gives_it():
    preset = read_preset("tiny-pixart")
    captions = [caption.title() + "  " for caption in CORPUS]  # "A Red Circle On A Blue Background  "
    tokenizer = text_tokenizers.learn(preset, captions)["tokenizer"]
    assert tokenizer.tokenize("a red circle on a blue background") == [
        "▁a", "▁red", "▁circle", "▁on", "▁a", "▁blue", "▁background"]
    figures = text_tokenizers.figures({"tokenizer": tokenizer}, captions, preset)["tokenizers"]["tokenizer"]
    assert figures["tokens_per_word"] == 1.0
    # SD3's T5 is handed the prompt as written: its pieces keep the case
    assert "▁Red" in text_tokenizers.learn(read_preset("tiny-sd3"), captions)["tokenizer_3"].get_vocab()


def test_caption_figures_count_tokens_per_word_and_the_captions_cut_at_the_context():
    tokenizer = build_tokenizer()
    figures = caption_figures(tokenizer, ["a red circle", "dog " * 100, "xq"])
    assert figures["captions"] == 3 and figures["cut_share"] == round(1 / 3, 6)
    assert figures["tokens_per_word"] == round((3 + 100 * len(tokenizer.tokenize("dog")) + 2) / 104, 4)


def test_the_empty_caption_is_bos_eos_then_padding():
    tokenizer = build_tokenizer()
    assert ids(tokenizer, "") == [tokenizer.bos_token_id] + [tokenizer.eos_token_id] * 76


def test_a_long_caption_is_truncated_to_77_ending_in_eos():
    tokenizer = build_tokenizer()
    encoded = ids(tokenizer, "red " * 200)
    red = tokenizer.convert_tokens_to_ids("red</w>")
    assert encoded == [tokenizer.bos_token_id] + [red] * 75 + [tokenizer.eos_token_id]


@pytest.mark.parametrize("load", [CLIPTokenizer.from_pretrained, AutoTokenizer.from_pretrained])
def test_saved_into_a_pipelines_tokenizer_folder_it_loads_with_the_same_ids(tmp_path, load):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    loaded = load(tmp_path, subfolder="tokenizer")
    assert type(loaded) is CLIPTokenizer
    assert loaded.model_max_length == 77
    assert [ids(loaded, caption) for caption in CAPTIONS] == [ids(tokenizer, caption) for caption in CAPTIONS]


@pytest.mark.parametrize("load", [T5TokenizerFast.from_pretrained, AutoTokenizer.from_pretrained])
def test_a_saved_t5_tokenizer_loads_with_t5s_class_and_gives_the_same_ids(tmp_path, load):
    tokenizer = learn_t5(CORPUS, 256)
    tokenizer.save_pretrained(tmp_path / "tokenizer_3")
    loaded = load(tmp_path, subfolder="tokenizer_3")
    assert isinstance(loaded, T5TokenizerFast) and loaded.model_max_length == 256
    assert [loaded(caption).input_ids for caption in CAPTIONS] == [tokenizer(caption).input_ids for caption in CAPTIONS]


@pytest.mark.parametrize("preset, folders", [
    ("tiny", {"tokenizer": "clip"}), ("tiny-sdxl", {"tokenizer": "clip", "tokenizer_2": "clip"}),
    ("tiny-sd3", {"tokenizer": "clip", "tokenizer_2": "clip", "tokenizer_3": "t5"}), ("tiny-pixart", {"tokenizer": "t5"})])
def test_a_preset_needs_a_tokenizer_per_text_encoder_saved_and_loaded_as_its_pipeline_subfolders(tmp_path, preset, folders):
    learned = text_tokenizers.learn(read_preset(preset), CORPUS)
    assert {name: kind for name, (kind, _, _, _) in text_tokenizers.needed(read_preset(preset)).items()} == folders
    text_tokenizers.save(learned, tmp_path, {"captions": len(CORPUS)})
    loaded = text_tokenizers.load(tmp_path, read_preset(preset))
    assert {name: loaded[name](CAPTIONS[0]).input_ids for name in folders} == {
        name: learned[name](CAPTIONS[0]).input_ids for name in folders}


def test_the_encoders_built_for_learned_tokenizers_take_every_id_they_emit():
    models = from_preset("tiny-sdxl", 0, tokenizers=text_tokenizers.learn(read_preset("tiny-sdxl"), CORPUS))
    for encoder, tokenizer in zip(models.text_encoders, models.tokenizers):
        assert encoder.config.vocab_size == len(tokenizer) > max(max(ids(tokenizer, c)) for c in CAPTIONS)


def test_the_text_encoder_pools_at_the_eos_token():
    models = from_preset("tiny", 0, tokenizers=text_tokenizers.learn(read_preset("tiny"), CORPUS))
    encoder, tokenizer = models.text_encoders[0], models.tokenizers[0]
    assert encoder.config.eos_token_id == tokenizer.eos_token_id != 2  # 2 would pick argmax(ids), CLIP's legacy rule
    input_ids = torch.tensor([ids(tokenizer, "a red circle"), ids(tokenizer, "")])
    with torch.no_grad():
        output = encoder(input_ids)
    assert torch.equal(output.pooler_output[0], output.last_hidden_state[0, 4])  # BOS a red circle EOS
    assert torch.equal(output.pooler_output[1], output.last_hidden_state[1, 1])  # BOS EOS


def test_a_saved_pipeline_reloads_with_the_same_ids_and_text_embeddings(tmp_path):
    # GIVEN the tiny preset's models as a pipeline, saved
    models = from_preset("tiny", 0)
    build_pipeline(models, models.denoiser).save_pretrained(tmp_path)
    # WHEN diffusers loads it back
    loaded = StableDiffusionPipeline.from_pretrained(tmp_path)
    # THEN its tokenizer is a CLIPTokenizer giving the same ids, and its text encoder the same embeddings
    assert json.loads((tmp_path / "model_index.json").read_text())["tokenizer"] == ["transformers", "CLIPTokenizer"]
    assert type(loaded.tokenizer) is CLIPTokenizer
    caption = "A red circle, top-left, on a blue background: café 42!"
    expected = tokenize(models.tokenizers[0], [caption], torch.device("cpu"))
    assert torch.equal(tokenize(loaded.tokenizer, [caption], torch.device("cpu")), expected)
    with torch.no_grad():
        assert torch.equal(loaded.text_encoder(expected)[0], models.text_encoders[0](expected)[0])
