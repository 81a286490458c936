"""A policy from local files: a Hugging Face model directory, or a GGUF file (converted once and cached)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.extras import require_installed


def cache_root() -> Path:
    """Where lit_parl keeps what it converts or fetches: ``$LIT_PARL_CACHE``, else ``~/.cache/lit_parl``."""
    return Path(os.environ.get("LIT_PARL_CACHE", Path.home() / ".cache" / "lit_parl"))


def pretrained(path: str, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local Hugging Face model directory (config, weights and tokenizer).

    Args:
        path: the directory (written by ``save_pretrained``); nothing is downloaded.
        dtype: the policy's weights' dtype. Keep ``float32`` (the master weights the optimizer updates) and compute
            in bfloat16 with ``Trainer(precision="bf16-mixed")`` (``trainer=gpu``): bfloat16 weights lose every
            update smaller than about 2^-8 of a weight.
    """
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"pretrained(path={path!r}): not a Hugging Face model directory (no config.json there). "
            "Point it (model.path on the command line) at a local directory written by save_pretrained; "
            "nothing is downloaded."
        )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def gguf(
    path: str, cache_dir: str | None = None, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A local GGUF file (llama.cpp's format) as an ordinary transformers model and its tokenizer.

    transformers de-quantizes a GGUF file into a model that refuses ``save_pretrained``, and the rollout
    engines start from a saved directory. So the first call rebuilds the model from its config and
    weights and saves it, with the tokenizer (chat template included), under ``cache_dir``; later calls
    load that directory (``pretrained``). The cache entry is keyed by the file's path, size and time.

    Args:
        path: the ``.gguf`` file.
        cache_dir: where converted models are kept; ``None``: ``$LIT_PARL_CACHE`` or ``~/.cache/lit_parl``,
            then ``gguf/``.
        dtype: the policy's weights' dtype (``float32``: see ``pretrained``).
    """
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(
            f"gguf(path={path!r}): no such file. Point model.path at a local .gguf file; nothing is downloaded."
        )
    stat = file.stat()
    key = hashlib.blake2b(f"{file}/{stat.st_size}/{stat.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    root = Path(cache_dir) if cache_dir else cache_root() / "gguf"
    directory = root / f"{file.stem}-{key}"
    if not (directory / "config.json").is_file():
        require_installed("gguf", "gguf", "reading a GGUF file (model=gguf)")  # transformers reads it with gguf
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # the weights are de-quantized now: an ordinary model's config
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        staging = directory.with_name(directory.name + f".{os.getpid()}.tmp")  # a half-written entry is never used
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(directory)
    return pretrained(str(directory), dtype)
