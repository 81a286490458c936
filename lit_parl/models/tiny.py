"""The embedded default's policy: a tiny random-init Qwen2 with a one-token-per-character tokenizer; and its reward
model counterpart (a one-logit sequence classifier on the same tokenizer) for learned rewards made here."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from lit_parl.models.char_tokenizer import VOCABULARIES, build_char_tokenizer


def _config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings):
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )


def _tiny(auto_class, what: str, vocabulary: str, seed: int, shape: tuple, **config_fields):
    """A random-init model of ``auto_class`` on the character tokenizer, its weights drawn from ``seed`` alone."""
    if vocabulary not in VOCABULARIES:
        raise ValueError(f"{what}(vocabulary={vocabulary!r}): choose one of {sorted(VOCABULARIES)}")
    tokenizer = build_char_tokenizer(VOCABULARIES[vocabulary])
    config = _config(tokenizer, *shape)
    for name, value in config_fields.items():
        setattr(config, name, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model, tokenizer


def tiny_qwen2(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vocabulary: str = "basic",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A random-init Qwen2 with the project's character tokenizer (no download). ``vocabulary``: ``basic``
    (digits, lowercase letters, the digit tasks' signs) or ``ascii`` (every printable ASCII character, for
    text prompts; the ids of ``basic``'s characters kept, the model's random weights not)."""
    shape = (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings)
    return _tiny(AutoModelForCausalLM, "tiny_qwen2", vocabulary, seed, shape)


def tiny_reward_model(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
    vocabulary: str = "basic",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A random-init Qwen2 sequence classifier with one label (a reward model's logit) and the character tokenizer:
    what the tests and ``benchmarks/rewards`` train and score with (``lit_parl.rewards.RewardModel`` reads it once
    saved with ``save_pretrained``)."""
    shape = (hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings)
    return _tiny(AutoModelForSequenceClassification, "tiny_reward_model", vocabulary, seed, shape, num_labels=1)
