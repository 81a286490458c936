"""A character-level tokenizer built in code, so the embedded default needs no hub download.

It is a standard ``PreTrainedTokenizerFast`` (a ``tokenizers`` WordLevel model that splits every character),
so ``save_pretrained`` writes a ``tokenizer.json`` that ``AutoTokenizer.from_pretrained`` loads without
custom code.

Example::

    >>> tok = build_char_tokenizer()
    >>> ids = tok("3917=").input_ids
    >>> tok.decode(ids)
    '3917='
    >>> text = build_char_tokenizer(ASCII_CHARACTERS)
    >>> text.decode(text("<answer>(1 + 2) / 3</answer>").input_ids) , text.unk_token_id in text("Using [7]").input_ids
    ('<answer>(1 + 2) / 3</answer>', False)
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz =+-*/.,:;?!()"
# Every printable ASCII character and the newline, for text prompts (countdown's tags and capitals). Appended
# after CHARACTERS, so the characters both hold keep their ids.
ASCII_CHARACTERS = CHARACTERS + "".join(
    c for c in string.ascii_uppercase + string.punctuation + "\n" if c not in CHARACTERS
)
VOCABULARIES = {"basic": CHARACTERS, "ascii": ASCII_CHARACTERS}  # by the name a model config gives


def build_char_tokenizer(characters: str = CHARACTERS) -> PreTrainedTokenizerFast:
    if len(set(characters)) != len(characters):
        raise ValueError(f"characters must be unique, got duplicates in {characters!r}")
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *characters])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
