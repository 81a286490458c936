"""Build or load the policy: a tiny random-init Qwen2 for the embedded default, or any local
Hugging Face causal LM directory (Llama/Qwen family)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase, Qwen2Config

from lit_parl.tokenizer import build_char_tokenizer


def tiny_qwen2(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 512,
    seed: int = 0,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A random-init Qwen2 with the project's character tokenizer (no download)."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model, tokenizer


def pretrained(path: str, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local Hugging Face model directory (config, weights and tokenizer)."""
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"pretrained(path={path!r}): not a Hugging Face model directory (no config.json there). Point it (model.path "
            "on the command line) at a local directory written by save_pretrained; nothing is downloaded."
        )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
