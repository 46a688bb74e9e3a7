"""Caption tokenizers learned from the captions themselves (the `tokenizers` library), for models whose
base brings none: nothing is downloaded and no word list is built in.

- CLIP (`learn_clip`): byte-level BPE in CLIP's format, as `transformers.CLIPTokenizer` loads it: the
  256 byte symbols of CLIP's `bytes_to_unicode`, each again with the `</w>` end-of-word suffix, then
  the merges learned from the captions (split as CLIP splits text: lower case, its regex, bytes), then
  `<|startoftext|>` and `<|endoftext|>` (also the padding, as in Stable Diffusion's tokenizer). Any
  text tokenizes: what the merges do not cover falls back to bytes, so no id is unknown.
- T5 (`learn_t5`): `T5TokenizerFast` rebuilds a Unigram model from its saved vocabulary (transformers 5
  loads no other model into it), so BPE's pieces, learned after T5's Metaspace split, are saved as
  Unigram pieces scored by their frequency; ids 0, 1, 2 are `<pad>`, `</s>`, `<unk>` as in T5, and a
  character no caption had (beyond printable ASCII) is `<unk>`.

Both are the same on every machine for the same captions, in any order: the byte symbols (CLIP) and
the specials take fixed ids first, the learners count words, and ties between equal counts fall to the
lower ids. `vocab_size` is a ceiling: a small corpus runs out of merges first. The text encoder built
for a learned tokenizer takes `len(tokenizer)` as its vocab_size, so no id falls outside its table.
"""

import json
import math
import string
from collections.abc import Iterable

from tokenizers import Tokenizer, models, trainers
from transformers import CLIPTokenizer, T5TokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
END_OF_WORD = "</w>"
MODEL_MAX_LENGTH = 77  # CLIP's context length; the text encoder's position embeddings match it
CLIP_VOCAB_SIZE = 49408  # CLIP's own (ViT-L/14 and OpenCLIP ViT-bigG alike): the default ceiling
T5_VOCAB_SIZE = 32000  # T5's SentencePiece vocabulary (without its 100 sentinel ids, which captions never use)
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # T5's ids 0, 1, 2: padding, end of sequence, unknown
MIN_FREQUENCY = 2  # a pair seen once is a word's accident, not a piece worth an id


def learn_clip(captions: Iterable[str], vocab_size: int = CLIP_VOCAB_SIZE,
               min_frequency: int = MIN_FREQUENCY) -> CLIPTokenizer:
    """A CLIP tokenizer (77 tokens, BOS ... EOS, padded with EOS) whose merges are learned from `captions`."""
    merges = _learn_merges(captions, vocab_size, min_frequency)
    return CLIPTokenizer(vocab=_vocabulary(merges), merges=merges, bos_token=BOS, eos_token=EOS, pad_token=EOS,
                         unk_token=EOS,  # never used: every byte has a symbol
                         model_max_length=MODEL_MAX_LENGTH)


def _symbols() -> list[str]:
    """CLIP's base symbols: one printable character per byte (in its order), then each ending a word."""
    alphabet = list(bytes_to_unicode().values())
    return alphabet + [symbol + END_OF_WORD for symbol in alphabet]


def _learn_merges(captions: Iterable[str], vocab_size: int, min_frequency: int) -> list[tuple[str, str]]:
    """BPE merges learned from the captions, split as CLIPTokenizer splits text, up to `vocab_size` ids."""
    clip = CLIPTokenizer().backend_tokenizer  # an empty CLIP tokenizer, for its normalizer and pre-tokenizer
    learner = Tokenizer(models.BPE(end_of_word_suffix=END_OF_WORD))
    learner.normalizer, learner.pre_tokenizer = clip.normalizer, clip.pre_tokenizer
    symbols = _symbols()
    if vocab_size < len(symbols) + 2:
        raise ValueError(f"a CLIP vocabulary needs at least {len(symbols) + 2} ids (its byte symbols, BOS, EOS)")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,  # BOS and EOS come after the merges
        min_frequency=min_frequency,
        # The symbols go in first so that they get fixed ids: the trainer numbers those it meets itself in
        # hash-map order, and ties between equally frequent pairs go to the lower ids, so the merges would
        # differ from one process to the next.
        special_tokens=symbols,
        end_of_word_suffix=END_OF_WORD,
        show_progress=False,
    )
    learner.train_from_iterator((caption for caption in captions if caption), trainer)
    return [tuple(pair) for pair in json.loads(learner.to_str())["model"]["merges"]]


def _vocabulary(merges: list[tuple[str, str]]) -> dict[str, int]:
    """Token -> id in CLIP's order: base symbols, the merges' results in merge order, BOS, EOS."""
    tokens = dict.fromkeys([*_symbols(), *(first + second for first, second in merges), BOS, EOS])
    return {token: index for index, token in enumerate(tokens)}


def learn_t5(captions: Iterable[str], max_length: int, vocab_size: int = T5_VOCAB_SIZE) -> T5TokenizerFast:
    """A T5 tokenizer (pieces after T5's Metaspace split; `</s>` ends every caption) learned from `captions`;
    `T5TokenizerFast.from_pretrained` loads its saved folder, as the SD3 and PixArt pipelines do.

    The pieces are BPE's, learned as CLIP's are (the characters take fixed ids first, in code-point
    order); each is scored by its log frequency in the captions as BPE splits them, which is what a
    Unigram model holds. (tokenizers' own UnigramTrainer keeps a few dozen pieces of a small corpus.)"""
    texts = [caption for caption in captions if caption]
    # learned on the text exactly as the saved tokenizer will split it: T5TokenizerFast rebuilds its own
    # normalizer (none) and pre-tokenizer on loading, so pieces of any other normalization would be unreachable
    saved = T5TokenizerFast(vocab=[(special, 0.0) for special in T5_SPECIALS], extra_ids=0).backend_tokenizer
    learner = _splitting_as(Tokenizer(models.BPE(unk_token="<unk>")), saved)
    words = [word for text in texts for word, _ in saved.pre_tokenizer.pre_tokenize_str(
        saved.normalizer.normalize_str(text) if saved.normalizer is not None else text)]
    alphabet = sorted(set("".join(words)) | set(string.ascii_letters + string.digits + string.punctuation + "\u2581"))
    if vocab_size < len(T5_SPECIALS) + len(alphabet):
        raise ValueError(f"a T5 vocabulary of these captions needs at least {len(T5_SPECIALS) + len(alphabet)} ids")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=MIN_FREQUENCY,
                                  special_tokens=[*T5_SPECIALS, *alphabet], show_progress=False)
    learner.train_from_iterator(texts, trainer)
    learned = json.loads(learner.to_str())["model"]
    # the same model without the characters as added tokens, which `encode` would cut out of the text first
    splitter = _splitting_as(Tokenizer(models.BPE(learned["vocab"], [tuple(pair) for pair in learned["merges"]],
                                                  unk_token="<unk>")), saved)
    counts = dict.fromkeys(learner.get_vocab(), 0)
    for encoding in splitter.encode_batch(texts):
        for token in encoding.tokens:
            counts[token] += 1
    total = sum(counts.values()) + len(counts)
    pieces = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    vocab = [(piece, 0.0 if piece in T5_SPECIALS else math.log((counts[piece] + 1) / total)) for piece, _ in pieces]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=max_length)


def _splitting_as(tokenizer: Tokenizer, saved: Tokenizer) -> Tokenizer:
    """`tokenizer`, normalizing and splitting text as `saved` does."""
    tokenizer.pre_tokenizer = saved.pre_tokenizer
    if saved.normalizer is not None:
        tokenizer.normalizer = saved.normalizer
    return tokenizer


def captions_cut(tokenizer, captions: list[str]) -> int:
    """How many of `captions` are longer than the tokenizer's context (specials included): truncation cuts them."""
    return sum(len(ids) > tokenizer.model_max_length for ids in tokenizer(captions).input_ids) if captions else 0


def caption_figures(tokenizer, captions: Iterable[str]) -> dict:
    """How the captions tokenize: how many, tokens per (whitespace-separated) word without the special
    tokens, and the share of captions longer than the context (`model_max_length`, specials included),
    which truncation cuts."""
    count = words = tokens = cut = 0
    extra = len(tokenizer("").input_ids)  # BOS and EOS (CLIP), EOS (T5)
    batch: list[str] = []

    def tally(texts: list[str]) -> None:
        nonlocal count, words, tokens, cut
        for text, ids in zip(texts, tokenizer(texts, add_special_tokens=False).input_ids):
            count, words, tokens = count + 1, words + len(text.split()), tokens + len(ids)
            cut += len(ids) + extra > tokenizer.model_max_length
    for caption in captions:
        batch.append(caption)
        if len(batch) == 1024:
            tally(batch)
            batch = []
    if batch:
        tally(batch)
    return {"captions": count, "words": words, "vocab_size": len(tokenizer),
            "context_length": tokenizer.model_max_length,
            "tokens_per_word": round(tokens / words, 4) if words else None,
            "cut_share": round(cut / count, 6) if count else 0.0}
