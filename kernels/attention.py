"""Shared-prompt attention for any transformers model of the Llama/Qwen family, via ``AttentionInterface``.

``shared_prompt_attention`` is registered under the name ``lit_parl_shared_prompt``. Inside
``use_shared_prompt_attention(model)``, the model's attention layers call it with the packed layout,
which is passed to the model's forward as the keyword ``shared_prompt``. Outside that context the
model is untouched.

A prompt token sees the earlier tokens of its prompt. A completion token sees its whole prompt and the
earlier tokens of its own completion. The backends compute exactly this one function:

- ``sdpa``: any device. Each completion's K/V are gathered as ``[prompt, completion]``, and SDPA runs
  with a bottom-right causal boolean mask. Prompts and completions are padded in separate buckets, so
  memory is O(Σ R·(P+R)), not O(L²). Forward and backward work on CPU; this is the CPU default.
- ``flex``: ``torch.nn.attention.flex_attention`` with a ``BlockMask`` built from the segment ids. It
  needs a GPU to train (there is no flex backward on CPU).
- ``flash``: ``flash_attn_varlen_func`` over the varlen segments, with the same K/V index gather.
  ``causal=True`` is bottom-right aligned. It needs CUDA and flash-attn, and float16/bfloat16 compute.
- ``npu``: ``torch_npu.npu_fusion_attention`` on the gathered buckets with an explicit mask (Ascend);
  float16/bfloat16 compute.
- ``dense``: SDPA with the full ``[B, 1, L, L]`` mask. It is the reference for tests.

**Compute dtype.** Attention computes in the autocast dtype inside an autocast region (Lightning's
``bf16-mixed``), else in the dtype of the query. Under autocast, the model's RoPE leaves the query and key
in float32 (float32 cos/sin times a bfloat16 projection) beside a bfloat16 value, so all three are cast to
that one dtype first, as transformers' own flash-attention path does. ``flash`` and ``npu`` refuse float32
compute with an error naming the fix; ``auto`` (``resolve_backend`` with the dtype) never picks them for it.

Example::

    >>> from lit_parl.kernels.packing import pack
    >>> from lit_parl.models import tiny_qwen2
    >>> model, _ = tiny_qwen2()
    >>> batch = pack([([4, 5, 41], [[6, 1], [7, 8, 1]])], pad_id=0, shared_prompt=True)
    >>> with use_shared_prompt_attention(model):
    ...     hidden = model.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
    ...                          shared_prompt=batch.attention).last_hidden_state
    >>> hidden.shape[:2]
    torch.Size([1, 6])
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from .backends import check_dtype, compute_dtype, resolve_backend
from .packing import SharedPromptLayout, dense_allowed

ATTENTION_NAME = "lit_parl_shared_prompt"


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] -> [B*L, H, D]"""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _sdpa(query, key, value, layout: SharedPromptLayout, scaling: float, window: int | None) -> torch.Tensor:
    q, k, v = _flat(query), _flat(key), _flat(value)
    out = q.new_zeros(q.shape)
    gqa = q.shape[1] != k.shape[1]
    for bucket in layout.buckets:
        qs = q[bucket.query_index].transpose(1, 2)  # [S, H, Qmax, D]
        ks = k[bucket.key_index].transpose(1, 2)
        vs = v[bucket.key_index].transpose(1, 2)
        mask = bucket.allowed if window is None else bucket.windowed(window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        o = o.transpose(1, 2)  # [S, Qmax, H, D]
        out[bucket.query_index[bucket.query_valid]] = o[bucket.query_valid]
    return out


def _npu(query, key, value, layout: SharedPromptLayout, scaling: float, window: int | None) -> torch.Tensor:
    import torch_npu  # noqa: F401 - Ascend only

    q, k, v = _flat(query), _flat(key), _flat(value)
    groups = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape)
    for bucket in layout.buckets:
        qs = q[bucket.query_index].transpose(1, 2)
        ks = k[bucket.key_index].transpose(1, 2).repeat_interleave(groups, dim=1)
        vs = v[bucket.key_index].transpose(1, 2).repeat_interleave(groups, dim=1)
        mask = bucket.allowed if window is None else bucket.windowed(window)
        # npu_fusion_attention's atten_mask: True marks a position that does NOT take part
        o = torch_npu.npu_fusion_attention(
            qs, ks, vs, qs.shape[1], input_layout="BNSD", atten_mask=~mask, scale=scaling, keep_prob=1.0
        )[0]
        o = o.transpose(1, 2)
        out[bucket.query_index[bucket.query_valid]] = o[bucket.query_valid]
    return out


def _flash(query, key, value, layout: SharedPromptLayout, scaling: float, window: int | None) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    q, k, v = _flat(query), _flat(key), _flat(value)
    windowed = {} if window is None else {"window_size": (window - 1, 0)}  # keys at distance < window
    o = flash_attn_varlen_func(
        q[layout.query_index],
        k[layout.key_index],
        v[layout.key_index],
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_k=layout.cu_seqlens_k,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_k=layout.max_seqlen_k,
        softmax_scale=scaling,
        causal=True,  # bottom-right aligned when queries are the keys' last tokens (flash-attn >= 2.1)
        **windowed,
    )
    out = q.new_zeros(q.shape)
    out[layout.query_index] = o
    return out


def _dense(query, key, value, layout: SharedPromptLayout, scaling: float, window: int | None) -> torch.Tensor:
    o = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=dense_allowed(layout, window),
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return _flat(o)


def flex_block_mask(layout: SharedPromptLayout, device, window: int | None = None):
    from torch.nn.attention.flex_attention import create_block_mask

    seg, visible, pos = layout.segment_ids.to(device), layout.visible_prompt.to(device), layout.positions.to(device)
    B, L = seg.shape

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (kv_idx <= q_idx) & ((seg[b, kv_idx] == seg[b, q_idx]) | (seg[b, kv_idx] == visible[b, q_idx]))
        if window is not None:
            allowed = allowed & ((pos[b, q_idx] - pos[b, kv_idx] < window) | (seg[b, q_idx] < 0))
        return allowed

    return create_block_mask(mask_mod, B, None, L, L, device=device)


_flex_by_device: dict[str, object] = {}


def _flex(query, key, value, layout: SharedPromptLayout, scaling: float, window: int | None) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if query.device.type not in _flex_by_device:  # compiled on GPU; eager elsewhere (tests)
        _flex_by_device[query.device.type] = (
            torch.compile(flex_attention, dynamic=True) if query.is_cuda else flex_attention
        )
    masks = layout.__dict__.setdefault("_block_masks", {})  # built once per micro-batch, shared by all layers
    if window not in masks:
        masks[window] = flex_block_mask(layout, query.device, window)
    o = _flex_by_device[query.device.type](
        query, key, value, block_mask=masks[window], scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return _flat(o)


_KERNELS = {"sdpa": _sdpa, "flex": _flex, "flash": _flash, "npu": _npu, "dense": _dense}


def shared_prompt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    shared_prompt: SharedPromptLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function: ``query`` ``[B, H, L, D]``, ``key``/``value`` ``[B, Hkv, L, D]``
    (after RoPE) → ``[B, L, H, D]``."""
    if shared_prompt is None:
        raise RuntimeError(
            f"attention '{ATTENTION_NAME}' was called without a `shared_prompt` layout: pass the packed batch's "
            "layout to the decoder's forward inside use_shared_prompt_attention(model) "
            "(lit_parl.kernels.forward.completion_logprobs does this)"
        )
    if dropout:
        raise ValueError("shared-prompt attention does not implement attention dropout; set attention_dropout=0")
    unsupported = sorted(name for name in ("softcap", "s_aux", "position_bias") if kwargs.get(name) is not None)
    if unsupported:
        raise ValueError(f"shared-prompt attention does not implement {unsupported} (Llama/Qwen/Mistral families only)")
    B, H, L, D = query.shape
    scale = scaling if scaling is not None else D**-0.5
    # a window no shorter than the longest segment's keys changes nothing: skip the extra mask
    window = sliding_window if sliding_window is not None and sliding_window < shared_prompt.max_seqlen_k else None
    dtype = compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)  # under autocast: float32 q/k, bf16 v
    backend = shared_prompt.backend
    if backend == "auto":
        backend = resolve_backend("auto", query.device, dtype)
    check_dtype(backend, dtype)
    out = _KERNELS[backend](query, key, value, shared_prompt, scale, window)
    return out.view(B, L, H, D), None


AttentionInterface.register(ATTENTION_NAME, shared_prompt_attention)


@contextmanager
def use_shared_prompt_attention(model: PreTrainedModel) -> Iterator[None]:
    """Route the model's attention through ``shared_prompt_attention`` for the duration of the block."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def checkpoint_context_fn(model: PreTrainedModel):
    """``context_fn`` for non-reentrant ``torch.utils.checkpoint`` around the layers of ``model``: the backward's
    recomputation of a layer runs with the attention implementation its forward had.

    ``use_shared_prompt_attention`` switches the implementation only for the forward's duration; the backward
    comes after, and without this a checkpointed layer would be recomputed with the model's own attention
    (transformers reads ``config._attn_implementation`` at each call), which does not compute the shared-prompt
    function (torch's check of the recomputed tensors catches it only when their number differs).
    """
    config = model.config

    def context_fn():
        implementation = config._attn_implementation  # at the forward

        @contextmanager
        def recomputation() -> Iterator[None]:
            previous = config._attn_implementation
            config._attn_implementation = implementation
            try:
                yield
            finally:
                config._attn_implementation = previous

        return nullcontext(), recomputation()

    return context_fn
