"""A small caption tokenizer built in code, so a from-scratch model needs no downloaded files.

WordPiece over a fixed vocabulary: special tokens, every ASCII letter, digit and punctuation mark
(alone and as a word continuation `##x`), then common caption words. Any ASCII text tokenizes
(unknown words fall back to letters), the vocabulary is the same on every machine, and the result
is a `transformers` fast tokenizer that `save_pretrained` writes into a diffusers pipeline.
"""

import string

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)  # ids 0..3; CLIP's pooling looks for EOS by id, so not 2
MODEL_MAX_LENGTH = 77  # CLIP's context length; the text encoder's position embeddings match it

# Whole-word tokens for words captions use often; anything else is spelled with letters.
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
""".split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The caption tokenizer: deterministic, offline, CLIP-shaped (77 tokens, BOS ... EOS, padded)."""
    backend = Tokenizer(models.WordPiece(_vocabulary(), unk_token=UNK, max_input_chars_per_word=100))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()  # words, and each punctuation mark
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} $B {EOS}",
        special_tokens=[(BOS, SPECIAL_TOKENS.index(BOS)), (EOS, SPECIAL_TOKENS.index(EOS))],
    )
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        model_max_length=MODEL_MAX_LENGTH,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
    )


def _vocabulary() -> dict[str, int]:
    """Token -> id, in a fixed order: specials, characters, word continuations, words."""
    characters = string.ascii_lowercase + string.digits + string.punctuation
    continuations = ["##" + c for c in string.ascii_lowercase + string.digits]
    tokens = list(SPECIAL_TOKENS) + list(characters) + continuations
    tokens += [word for word in dict.fromkeys(CAPTION_WORDS) if word not in tokens]
    return {token: index for index, token in enumerate(tokens)}
