"""Tokens per word of a tokenizer learned from captions, on captions over words it never saw.

Nothing is downloaded: a procedural language stands in for captions. Its words are pronounceable
(onset, vowel, coda syllables), Zipf-distributed, and built as captions' words are: a root of one to
three syllables, often with a suffix, sometimes a prefix; captions follow a small grammar of
function words (one syllable, frequent) around content words. The tokenizer
(trainer/models/tokenizer.py, CLIP's format and default 49,408-id ceiling, as a from-scratch preset
builds it) is learned from `--captions` training captions, then measured on captions made of the same
grammar whose every content word never occurs in the training captions:

- `value` (`train.tokens_per_word_unseen`): unseen words as a language makes them, drawn from its own
  distribution and kept only if training never had them (new compositions of known roots and affixes,
  and rare roots); tokens over all words of those captions, function words included, BOS/EOS not.
- `unseen_content_word`: the same, over the unseen content words alone.
- `one_token_a_morpheme`: the same captions at one token per morpheme (function word, prefix, root, suffix): what a
  tokenizer that had learned every root and affix as one piece would give, and `morphemes_per_unseen_content_word`.
  A new word is mostly a new composition of known parts, so this is the floor the goal meets.
- `novel_roots`: the hardest case, content words on roots from a disjoint set training never drew from.
- `seen_heldout`: held-out captions of the training distribution (what most captions of a job are).

    .venv/bin/python bench/tokenizer_unseen.py [--captions 50000] [--test 2000] [--seed 0] [--learner unigram]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "functions")]  # a script, not a test: the repo and the Lambda code

from bench.stamp import commit  # noqa: E402
from trainer.models.tokenizer import CLIP_VOCAB_SIZE, MIN_FREQUENCY, learn_clip  # noqa: E402

ONSETS = "b c d f g h k l m n p r s t v w z br tr st pl kr gl sh ch th sp".split()
VOWELS = "a e i o u ai ou ea ee oo".split()
CODAS = ["", "", "", "n", "r", "s", "l", "t", "k", "m"]


class Language:
    """A procedural caption language: function words, roots (a training set and a disjoint one), affixes."""

    def __init__(self, seed: int, roots: int = 6000, function_words: int = 30):
        rng = random.Random(seed)
        self.function = self._distinct(rng, function_words, 1, 1, set())
        self.suffixes = self._distinct(rng, 12, 1, 1, set(self.function))
        self.prefixes = self._distinct(rng, 5, 1, 1, set(self.function) | set(self.suffixes))
        taken = set(self.function) | set(self.suffixes) | set(self.prefixes)
        all_roots = self._distinct(rng, 2 * roots, 1, 3, taken)
        self.roots, self.novel_roots = all_roots[:roots], all_roots[roots:]
        # cumulative Zipf weights, computed once (random.choices would sum them at every draw)
        self.root_weights = list(itertools.accumulate(1 / (rank + 1) for rank in range(roots)))
        self.function_weights = list(itertools.accumulate(1 / (rank + 1) ** 0.8 for rank in range(function_words)))

    @staticmethod
    def _syllable(rng: random.Random) -> str:
        onset = rng.choice(ONSETS) if rng.random() < 0.85 else ""
        return onset + rng.choice(VOWELS) + rng.choice(CODAS)

    def _distinct(self, rng: random.Random, count: int, low: int, high: int, taken: set[str]) -> list[str]:
        words: list[str] = []
        while len(words) < count:
            word = "".join(self._syllable(rng) for _ in range(rng.choices(range(low, high + 1),
                                                                          [0.45, 0.4, 0.15][:high - low + 1])[0]))
            if word not in taken and len(word) > 1:
                taken.add(word)
                words.append(word)
        return words

    def content_word(self, rng: random.Random, roots: list[str] | None = None) -> str:
        return "".join(self.content_parts(rng, roots))

    def content_parts(self, rng: random.Random, roots: list[str] | None = None) -> tuple[str, str, str]:
        """A content word's prefix, root and suffix (an absent affix is "")."""
        root = rng.choice(roots) if roots else rng.choices(self.roots, cum_weights=self.root_weights)[0]
        prefix = rng.choice(self.prefixes) if rng.random() < 0.15 else ""
        suffix = rng.choice(self.suffixes) if rng.random() < 0.5 else ""
        return prefix, root, suffix

    def caption(self, rng: random.Random, content=None) -> str:
        """6-14 words: a function word, then one or two content words, and again."""
        words: list[str] = []
        target = rng.randint(6, 14)
        while len(words) < target:
            words.append(rng.choices(self.function, cum_weights=self.function_weights)[0])
            for _ in range(rng.randint(1, 2)):
                words.append(content(rng) if content else self.content_word(rng))
        return " ".join(words)


def tokens_per_word(tokenizer, captions: list[str], only=None) -> float:
    """Tokens (BOS and EOS left out) per word of the captions, or of their words `only` picks; `tokenizer` a
    transformers tokenizer or a `tokenizers.Tokenizer`."""
    words = [word for caption in captions for word in caption.split() if only is None or only(word)]
    encoded = getattr(tokenizer, "backend_tokenizer", tokenizer).encode_batch(words, add_special_tokens=False)
    return sum(len(encoding.ids) for encoding in encoded) / len(words)


def learn_unigram(captions: list[str], vocab_size: int):
    """A Unigram model (SentencePiece's, T5's kind) learned by `tokenizers` after T5's Metaspace split: the other
    learner a caption tokenizer could use, measured against the trainer's BPE. Its word-start piece "\u2581" counts
    where it comes alone, as T5 emits it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(captions, trainers.UnigramTrainer(
        vocab_size=vocab_size, unk_token="<unk>", special_tokens=["<unk>"], show_progress=False))
    return tokenizer


def learned(training: list[str], vocab_size: int, learner: str, min_frequency: int):
    if learner == "unigram":
        return learn_unigram(training, vocab_size)
    return learn_clip(training, vocab_size, min_frequency)


def measure(captions: int, test: int, seed: int, vocab_size: int = CLIP_VOCAB_SIZE, learner: str = "bpe",
            min_frequency: int = MIN_FREQUENCY) -> dict:
    """The figures for a tokenizer learned from `captions` training captions, over `test` captions of each kind:
    the trainer's (CLIP's BPE, `learner` "bpe") or a Unigram model ("unigram")."""
    language = Language(seed)
    rng = random.Random(seed + 1)
    training = [language.caption(rng) for _ in range(captions)]
    seen = {word for caption in training for word in caption.split()}
    started = time.perf_counter()
    tokenizer = learned(training, vocab_size, learner, min_frequency)
    learn_s = time.perf_counter() - started

    morphemes: dict[str, int] = {}  # each unseen content word's prefix, root and suffix present

    def unseen(rng: random.Random) -> str:
        while (word := "".join(parts := language.content_parts(rng))) in seen:
            pass
        morphemes.setdefault(word, sum(1 for part in parts if part))
        return word
    test_rng = random.Random(seed + 2)
    heldout = [language.caption(test_rng) for _ in range(test)]
    over_unseen = [language.caption(test_rng, unseen) for _ in range(test)]
    over_novel = [language.caption(test_rng, lambda r: language.content_word(r, language.novel_roots))
                  for _ in range(test)]
    assert not any(word in seen for c in over_unseen for word in c.split() if word not in language.function)
    content = (lambda word: word not in language.function)
    words = [word for caption in over_unseen for word in caption.split()]
    content_morphemes = [morphemes[word] for word in words if content(word)]
    return {"value": round(tokens_per_word(tokenizer, over_unseen), 3),
            # one token a morpheme, what a tokenizer that knows every root and affix would spend on these captions
            "one_token_a_morpheme": round((len(words) - len(content_morphemes) + sum(content_morphemes)) / len(words), 3),
            "morphemes_per_unseen_content_word": round(sum(content_morphemes) / len(content_morphemes), 3),
            "unseen_content_word": round(tokens_per_word(tokenizer, over_unseen, content), 3),
            "novel_roots": round(tokens_per_word(tokenizer, over_novel), 3),
            "novel_roots_content_word": round(tokens_per_word(tokenizer, over_novel, content), 3),
            "seen_heldout": round(tokens_per_word(tokenizer, heldout), 3),
            "vocab_size": tokenizer.get_vocab_size() if learner == "unigram" else len(tokenizer), "training_words": sum(len(c.split()) for c in training),
            "distinct_training_words": len(seen), "learn_s": round(learn_s, 2)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--captions", type=int, default=50000, help="training captions")
    parser.add_argument("--test", type=int, default=2000, help="test captions of each kind")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=CLIP_VOCAB_SIZE, help="the tokenizer's ceiling")
    parser.add_argument("--learner", choices=("bpe", "unigram"), default="bpe",
                        help="bpe: the trainer's (CLIP's format); unigram: tokenizers' UnigramTrainer, for comparison")
    parser.add_argument("--min-frequency", type=int, default=MIN_FREQUENCY, help="bpe: a merge's least count")
    args = parser.parse_args(argv)
    figures = measure(args.captions, args.test, args.seed, args.vocab_size, args.learner, args.min_frequency)
    import tokenizers
    shipped = args.learner == "bpe" and args.min_frequency == MIN_FREQUENCY  # the trainer's tokenizer, as it learns
    line = {"metric": "train.tokens_per_word_unseen" + ("" if shipped else "_variant"), "unit": "tokens/word", **figures,
            "config": {"captions": args.captions, "test": args.test, "seed": args.seed, "vocab_ceiling": args.vocab_size,
                       "format": "clip-bpe" if args.learner == "bpe" else "unigram",
                       "min_frequency": args.min_frequency if args.learner == "bpe" else None},
            "commit": commit(), "machine": f"{platform.machine()}, nproc {os.cpu_count()}, no GPU",
            "versions": {"python": platform.python_version(), "tokenizers": tokenizers.__version__}}
    print(json.dumps(line), flush=True)
    return line


if __name__ == "__main__":
    main()
