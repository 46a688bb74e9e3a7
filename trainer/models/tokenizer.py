"""The caption tokenizer: a CLIP BPE tokenizer whose merges are learned in code, so nothing is downloaded.

A from-scratch model has no CLIP vocabulary file to load (open_clip_torch ships one, but would
replace our pinned CPU torch), so this module builds a vocabulary in CLIP's format: the 256
byte-level symbols of CLIP's `bytes_to_unicode`, each again with the `</w>` end-of-word suffix, then
the merges BPE learns from CAPTION_WORDS (until every word in it is one token), then
`<|startoftext|>` and `<|endoftext|>` (also the padding, as in Stable Diffusion's tokenizer). Any
text tokenizes: what the merges do not cover falls back to bytes. The vocabulary is the same on
every machine.

`build_tokenizer()` returns a `transformers.CLIPTokenizer`, so the `tokenizer/` folder of a saved
pipeline loads with `CLIPTokenizer.from_pretrained(path, subfolder="tokenizer")`, as diffusers'
training scripts load it, or with `AutoTokenizer`, and gives the same ids as the trainer's.
"""

import json
import string

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import CLIPTokenizer, T5TokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"
MODEL_MAX_LENGTH = 77  # CLIP's context length; the text encoder's position embeddings match it

# Words that captions use often, each learned as one token; anything else is spelled in pieces.
CAPTION_WORDS = """
a an the of in on at with and or by from to for under over near above below behind beside
photo photograph picture image painting drawing illustration render sketch portrait landscape
close up view closeup detailed high quality sharp blurry bright dark light shadow color colorful
red orange yellow green blue purple pink brown black white gray grey gold silver
man woman person people child boy girl baby face hand hands eyes hair smile group crowd
dog cat bird horse cow sheep fish animal animals flower flowers tree trees plant grass leaf leaves
sky cloud clouds sun moon star stars night day morning evening sunset sunrise rain snow fog
water sea ocean lake river beach wave waves mountain mountains hill forest field desert island
city street road bridge building buildings house home room window door wall floor roof tower
car bus train boat ship plane bicycle table chair bed book cup food fruit apple bread plate
old new small large big little tall long short round square empty full wet dry warm cold
standing sitting walking running lying flying holding looking wearing playing smiling
is are was two three one many some its his her their this that there
colour colours colors cyan magenta violet beige navy teal turquoise maroon olive crimson
circle circles square squares triangle triangles rectangle oval ellipse diamond heart hexagon
shape shapes line lines stripe stripes dot dots pattern solid plain outline filled
background foreground ground backdrop scene
left right top bottom centre center middle corner side upper lower between inside outside next
""".split()


def build_tokenizer() -> CLIPTokenizer:
    """The caption tokenizer: deterministic, offline, CLIP's (77 tokens, BOS ... EOS, padded with EOS)."""
    merges = _learn_merges()
    return CLIPTokenizer(
        vocab=_vocabulary(merges),
        merges=merges,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,  # never used: every byte has a symbol
        model_max_length=MODEL_MAX_LENGTH,
    )


def _symbols() -> list[str]:
    """CLIP's base symbols: one printable character per byte (in its order), then each ending a word."""
    alphabet = list(bytes_to_unicode().values())
    return alphabet + [symbol + END_OF_WORD for symbol in alphabet]


def _learn_merges() -> list[tuple[str, str]]:
    """BPE merges learned from CAPTION_WORDS, split as CLIPTokenizer splits text, until no pair is left."""
    clip = CLIPTokenizer().backend_tokenizer  # an empty CLIP tokenizer, for its normalizer and pre-tokenizer
    learner = Tokenizer(models.BPE(end_of_word_suffix=END_OF_WORD))
    learner.normalizer, learner.pre_tokenizer = clip.normalizer, clip.pre_tokenizer
    words = list(dict.fromkeys(CAPTION_WORDS))
    trainer = trainers.BpeTrainer(
        # At most one merge per character of the corpus: room for all, so training ends when every word is one token.
        vocab_size=len(_symbols()) + len("".join(words)),
        # The symbols go in first so that they get fixed ids: the trainer numbers those it meets itself in
        # hash-map order, and ties between equally frequent pairs go to the lower ids, so the merges would
        # differ from one process to the next.
        special_tokens=_symbols(),
        end_of_word_suffix=END_OF_WORD,
        show_progress=False,
    )
    learner.train_from_iterator(words, trainer)
    return [tuple(pair) for pair in json.loads(learner.to_str())["model"]["merges"]]


def _vocabulary(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Token -> id in CLIP's order: base symbols, the merges' results in merge order, BOS, EOS."""
    tokens = dict.fromkeys([*_symbols(), *(first + second for first, second in merges), BOS, EOS])
    return {token: index for index, token in enumerate(tokens)}


T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2: padding, end of sequence, unknown


def build_t5_tokenizer(max_length: int) -> T5TokenizerFast:
    """A T5 tokenizer (SentencePiece-style Unigram, as T5's own) learned offline from CAPTION_WORDS:
    `T5TokenizerFast.from_pretrained` loads its saved folder, as the SD3 and PixArt pipelines load theirs.
    Pieces are learned per word after T5's Metaspace split (a word-initial piece starts with '▁');
    anything else falls back to single characters, which the alphabet keeps, or `<unk>`."""
    learner = Tokenizer(models.Unigram())
    learner.normalizer = normalizers.NFKC()
    learner.pre_tokenizer = pre_tokenizers.Metaspace()
    words = list(dict.fromkeys(CAPTION_WORDS))
    trainer = trainers.UnigramTrainer(
        vocab_size=len(T5_SPECIALS) + 4 * len(words), special_tokens=list(T5_SPECIALS), unk_token="<unk>",
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation), show_progress=False)
    learner.train_from_iterator([" ".join(words)] * 4, trainer)
    vocab = [(piece, score) for piece, score in json.loads(learner.to_str())["model"]["vocab"]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)
