"""Limits known before anything starts: checked when the module and datamodule are built, not mid-run.

A run that can only fail, fails before any engine process is launched and before any minute of
generation is spent: a completion limit the model's context cannot hold, a pool that cannot serve the
requested length, or a micro-batch whose activations and logits exceed the memory budget one gives.
(Per-prompt lengths are checked as prompts are tokenized; that is the data's job, not this module's.)

Example::

    >>> from lit_parl.models import tiny_qwen2
    >>> config = tiny_qwen2()[0].config
    >>> check_context(config, max_new_tokens=6)
    >>> gib = micro_batch_bytes(config, samples=64, sample_tokens=32, logprob_chunk_size=1024) / 2**30
    >>> 0 < gib < 1
    True
"""

from __future__ import annotations

from transformers import PretrainedConfig

# Bytes a transformer layer keeps for the backward pass, per token, in units of the element size: the
# attention block's inputs, q/k/v, its output and two norms (~12 x hidden), and a gated MLP's three
# intermediate activations plus their product (~4 x intermediate). Memory-efficient attention (SDPA,
# flex, flash) keeps no seq x seq scores. It is an estimate, meant to catch a setting that is off by
# several times, not to size a run to the last gigabyte.
_HIDDEN_FACTOR, _INTERMEDIATE_FACTOR = 12, 4
# Logits of one LM-head chunk in float32: the kernel holds four to five [chunk, vocabulary] tensors at once
# (the logits / T, their log-softmax, its exp, the gradient; benchmarks/costs/scaling_costs.py measured it).
_LOGITS_COPIES = 5


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence the model's positions allow (``max_position_embeddings``), if the config says."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def check_context(config: PretrainedConfig, max_new_tokens: int, setting: str = "sampling.max_new_tokens") -> None:
    """A completion of ``max_new_tokens`` (an episode's tokens: ``setting`` names the limit) after at least one
    prompt token must fit the model's context."""
    limit = context_length(config)
    if limit is not None and max_new_tokens + 1 > limit:
        raise ValueError(
            f"{setting}={max_new_tokens} does not fit this model's context of {limit} tokens "
            f"(max_position_embeddings), which must also hold the prompt: lower {setting} below {limit}"
        )


def micro_batch_bytes(
    config: PretrainedConfig, samples: int, sample_tokens: int, logprob_chunk_size: int, element_bytes: int = 4
) -> int:
    """Estimated activation and logits memory of one micro-batch's forward and backward (see the factors above).

    ``sample_tokens`` is prompt plus completion: each sample on its own row (the padded layout, the
    largest; shared-prompt packing stores each group's prompt once).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    intermediate = getattr(text, "intermediate_size", None) or 4 * hidden
    tokens = samples * sample_tokens
    activations = tokens * layers * (_HIDDEN_FACTOR * hidden + _INTERMEDIATE_FACTOR * intermediate) * element_bytes
    logits = min(tokens, logprob_chunk_size) * text.vocab_size * 4 * _LOGITS_COPIES
    return activations + logits


def check_memory(
    config: PretrainedConfig, samples: int, sample_tokens: int | None, logprob_chunk_size: int, budget_gib: float | None
) -> None:
    """Refuse a micro-batch whose estimated activation and logits memory exceeds ``budget_gib`` (None: no budget);
    ``sample_tokens``: prompt and completion tokens of the longest sample (None: the model's context, a bound)."""
    if budget_gib is None:
        return
    sample_tokens = sample_tokens or context_length(config)
    if sample_tokens is None:
        raise ValueError(
            "GRPOModule(memory_budget_gib=...) needs max_sample_tokens: this model's config gives no context length"
        )
    need = micro_batch_bytes(config, samples, sample_tokens, logprob_chunk_size) / 2**30
    if need > budget_gib:
        raise ValueError(
            f"a micro-batch of {samples} samples of up to {sample_tokens} tokens needs about {need:.1f} GiB "
            f"of activations and logits, over module.memory_budget_gib={budget_gib:g}: lower shape.micro_batch_size "
            "(the update does not change: gradients add up over a mini-batch's micro-batches), "
            "or module.logprob_chunk_size for the logits"
        )
