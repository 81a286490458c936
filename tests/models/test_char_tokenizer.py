"""The character tokenizer of the tiny models: one id per character, a round trip through save_pretrained."""

from __future__ import annotations

import string

import pytest
from transformers import AutoTokenizer

from lit_parl.models import tiny_qwen2
from lit_parl.models.char_tokenizer import (
    ASCII_CHARACTERS,
    CHARACTERS,
    SPECIAL_TOKENS,
    build_char_tokenizer,
)


def test_tokenizer_one_id_per_character_and_round_trip(tok):
    vocab = [*SPECIAL_TOKENS, *CHARACTERS]
    for text in ["0", "7", "3917=", "0123456789", "00000=", "98765432109876543210="]:
        ids = tok(text).input_ids
        assert ids == [vocab.index(c) for c in text]  # no specials added, one id per character
        assert tok.decode(ids) == text
    assert tok.pad_token_id == vocab.index("<pad>")
    assert tok.eos_token_id == vocab.index("<eos>")
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(vocab)
    # the end token survives in ids but is dropped by skip_special_tokens decoding
    assert tok.decode([*tok("12").input_ids, tok.eos_token_id], skip_special_tokens=True) == "12"


def test_tokenizer_rejects_duplicate_characters():
    with pytest.raises(ValueError):
        build_char_tokenizer("0123456789=0")


def test_tokenizer_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["3917=", "0123456789", "42=24", "5"]
    for text in texts:
        assert loaded(text).input_ids == tok(text).input_ids
        assert loaded.decode(tok(text).input_ids) == text
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.unk_token_id,
    )
    assert loaded.pad_token_id != loaded.eos_token_id
    assert len(loaded) == len(tok)


def test_the_ascii_vocabulary_holds_every_printable_character_and_keeps_the_basic_ids(tok):
    """Text prompts (countdown's) reach the model as written; the default's characters keep their ids."""
    ascii_tok = build_char_tokenizer(ASCII_CHARACTERS)
    text = string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    ids = ascii_tok(text).input_ids
    assert len(ids) == len(text) and ascii_tok.unk_token_id not in ids and ascii_tok.decode(ids) == text
    assert ascii_tok(CHARACTERS).input_ids == tok(CHARACTERS).input_ids
    assert len(tiny_qwen2(hidden_size=8, intermediate_size=8, vocabulary="ascii")[1]) == len(ascii_tok)
    with pytest.raises(ValueError, match=r"vocabulary='unicode'\): choose one of \['ascii', 'basic'\]"):
        tiny_qwen2(vocabulary="unicode")
