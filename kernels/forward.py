"""The trainer's forward pass: completion log-probs ``[n_samples, T]`` of a packed or padded micro-batch.

The backbone (``model.get_decoder()``) runs over the packed tokens with shared-prompt attention, or over
padded rows with the model's own causal attention. The hidden states are gathered at the label
positions only, and the LM head runs through ``linear_token_logprobs``. The head therefore never sees
prompt positions, and no ``[N, V]`` float32 logits exist at once.

Inside an autocast region (Lightning's ``bf16-mixed``), the hidden states and the head's weight are cast to
the autocast dtype before the head's kernel, whose backward runs outside the region: forward and backward
then compute the same bfloat16 logits (the float32 weight receives the gradient through the cast). Outside
autocast everything runs in the weights' dtype.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .attention import use_shared_prompt_attention
from .logprobs import linear_token_logprobs
from .packing import PackedTokens

_UNSUPPORTED_HEAD_OPTIONS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def check_supported(model: PreTrainedModel) -> None:
    """The LM head must be a plain linear layer (the Llama/Qwen/Mistral families)."""
    for option in _UNSUPPORTED_HEAD_OPTIONS:
        if getattr(model.config, option, None) not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} transforms its logits ({option}={getattr(model.config, option)}); lit_parl's "
                "log-prob kernel supports plain linear LM heads (Llama, Qwen2/3, Mistral families)"
            )


def completion_logprobs(
    model: PreTrainedModel, tokens: PackedTokens, temperature: float, chunk_size: int = 1024, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs ``[n, T]`` of the completions (and, ``with_entropy``, the per-token entropy ``[n, T]``)."""
    backbone = model.get_decoder()
    head = model.get_output_embeddings()
    if tokens.attention is not None:
        with use_shared_prompt_attention(model):
            hidden = backbone(
                input_ids=tokens.input_ids,
                position_ids=tokens.position_ids,
                shared_prompt=tokens.attention,
                use_cache=False,
            ).last_hidden_state
    else:
        hidden = backbone(input_ids=tokens.input_ids, use_cache=False).last_hidden_state
    selected = hidden.reshape(-1, hidden.shape[-1])[tokens.label_positions]
    weight, bias = head.weight, head.bias
    # the backward recomputes the logits outside autocast: same dtype
    if torch.is_autocast_enabled(selected.device.type):
        dtype = torch.get_autocast_dtype(selected.device.type)
        selected, weight = selected.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    logprobs, entropy = linear_token_logprobs(
        selected, weight, tokens.label_targets, temperature, bias=bias, chunk_size=chunk_size, with_entropy=True
    )

    def place(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(tokens.completion_mask.numel()).scatter(0, tokens.label_slots, values)
        return out.view(tokens.completion_mask.shape)

    return (place(logprobs), place(entropy)) if with_entropy else place(logprobs)
