"""Shared-prompt packing and attention, checked against INDEPENDENT references.

- The layout (positions, labels, masks, varlen/bucket indices) is compared with one rebuilt here by brute
  force from the rule: a prompt token sees the earlier tokens of its own prompt; a completion token sees
  its whole prompt and the earlier tokens of its own completion; nothing crosses groups.
- Packed log-probs (and their gradients) are compared with each completion run unpacked, with its own
  copy of the prompt, through the plain Hugging Face model: ``log_softmax(model([p + c]).logits / T)``
  gathered at the completion's tokens.
- ``linear_token_logprobs`` is compared with the naive ``log_softmax((h @ W.T + b) / T)`` gather.
- Backends that cannot run here (flash, npu) are driven through fake modules that implement the
  documented semantics of the real kernels with plain SDPA and refuse what the real kernels refuse
  (float32 first of all), so they are tested in bfloat16: against float32 references computed from the
  same bfloat16 values, at bfloat16's tolerance.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.machinery
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from lit_parl.kernels import attention as attention_module
from lit_parl.kernels.attention import (
    ATTENTION_NAME,
    flex_block_mask,
    shared_prompt_attention,
    use_shared_prompt_attention,
)
from lit_parl.kernels.backends import BACKENDS, HALF_ONLY, resolve_backend
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.logprobs import linear_token_logprobs
from lit_parl.kernels.packing import dense_allowed, pack

VOCAB = 53
PAD = 0
RTOL = 1e-5
ATOL = 1e-6
SCALE = 0.3  # not head_dim**-0.5: the kernels must use the scaling they are given

FAMILIES = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}


# ------------------------------------------------------------------------------------------------------
# tiny models and scenarios
# ------------------------------------------------------------------------------------------------------
@functools.cache
def tiny_model(family: str, gqa: bool, seed: int = 0, sliding_window: int | None = None, tied: bool = False):
    """A random 2-layer model. initializer_range 0.2 (not HF's 0.02) makes attention and logits far from
    uniform, so a wrong mask or position changes the log-probs well beyond the tolerance."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if gqa else 4,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=tied,
        pad_token_id=PAD,
        bos_token_id=None,
        eos_token_id=None,
        attention_dropout=0.0,
    )
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    config = FAMILIES[family](**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def random_group(rng: random.Random, prompt_len: int, group_size: int, max_len: int = 6):
    prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
    lengths = [1] + [rng.randint(1, max_len) for _ in range(group_size - 1)]  # always one 1-token completion
    rng.shuffle(lengths)
    return prompt, [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]


@functools.cache
def scenario(name: str):
    """(groups, max_row_tokens), cached: take fresh copies through ``groups_of``."""
    rng = random.Random({"multi": 1, "rows": 2, "edge": 3}[name])
    if name == "multi":  # several groups, prompt lengths 1/5/17, group sizes 2/4/8, one row
        groups = [random_group(rng, 1, 2), random_group(rng, 5, 4), random_group(rng, 17, 8)]
        return groups, None
    if name == "rows":  # several rows with padding; group 2 is split over two places of the micro-batch
        g0, g1, g2, g3 = (
            random_group(rng, 5, 2),
            random_group(rng, 1, 4),
            random_group(rng, 17, 8),
            random_group(rng, 3, 3),
        )
        part_a = (g2[0], g2[1][:3])
        part_b = (g2[0], g2[1][3:])
        return [g0, part_a, g1, g3, part_b], 24
    if name == "edge":  # only 1-token completions in a group (no completion segment at all); P = 1
        return [([7], [[3]]), ([4, 9, 11, 2, 5], [[1], [2], [8]]), ([6], [[5, 6], [9]])], None
    raise KeyError(name)


SCENARIOS = ("multi", "rows", "edge")


def groups_of(name):
    groups, max_row = scenario(name)
    return [(list(p), [list(c) for c in cs]) for p, cs in groups], max_row


def reference_logprobs(model, groups, temperature: float) -> torch.Tensor:
    """Each completion unpacked, with its own prompt copy, through the plain HF model; differentiable."""
    completions = [(p, c) for p, cs in groups for c in cs]
    width = max(len(c) for _, c in completions)
    rows = []
    for prompt, completion in completions:
        P, R = len(prompt), len(completion)
        logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
        logp = torch.log_softmax(logits[P - 1 : P + R - 1].float() / temperature, dim=-1)
        row = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]
        rows.append(F.pad(row, (0, width - R)))
    return torch.stack(rows)


@functools.cache
def cached_reference(family, gqa, seed, name, temperature):
    groups, _ = groups_of(name)
    with torch.no_grad():
        return reference_logprobs(tiny_model(family, gqa, seed), groups, temperature)


def packed_logprobs(
    model, groups, temperature, backend="sdpa", shared_prompt=True, max_row_tokens=None, chunk_size=1024
):
    packed = pack(groups, PAD, shared_prompt=shared_prompt, max_row_tokens=max_row_tokens)
    if packed.attention is not None:
        packed.attention.backend = backend
    return completion_logprobs(model, packed, temperature, chunk_size=chunk_size), packed


# ------------------------------------------------------------------------------------------------------
# brute-force layout
# ------------------------------------------------------------------------------------------------------
def brute_force_layout(groups, max_row_tokens):
    """Rebuild the shared-prompt layout from the rule. Rows are filled greedily in group order, a group
    never split over rows. Returns per-row token records (group, completion or -1, offset, token, position),
    the row length and the [B, L, L] mask for real query tokens."""
    sizes = [len(p) + sum(len(c) - 1 for c in cs) for p, cs in groups]
    rows, row_len = [[]], 0
    for g, size in enumerate(sizes):
        if rows[-1] and max_row_tokens is not None and row_len + size > max_row_tokens:
            rows.append([])
            row_len = 0
        rows[-1].append(g)
        row_len += size
    L = max(sum(sizes[g] for g in row) for row in rows)
    records = []
    for row in rows:
        tokens = []
        for g in row:
            prompt, cs = groups[g]
            tokens += [(g, -1, t, tok, t) for t, tok in enumerate(prompt)]
            for i, c in enumerate(cs):
                tokens += [(g, i, t, tok, len(prompt) + t) for t, tok in enumerate(c[:-1])]
        records.append(tokens)
    mask = torch.zeros((len(rows), L, L), dtype=torch.bool)
    for b, tokens in enumerate(records):
        for q, (gq, iq, tq, _, _) in enumerate(tokens):
            for k, (gk, ik, tk, _, _) in enumerate(tokens):
                if gq != gk:
                    continue
                if iq == -1:
                    mask[b, q, k] = ik == -1 and tk <= tq
                else:
                    mask[b, q, k] = ik == -1 or (ik == iq and tk <= tq)
    return records, L, mask


def block_diagonal(mask: torch.Tensor) -> torch.Tensor:
    """[B, L, L] -> [B*L, B*L] over flat token indices."""
    B, L, _ = mask.shape
    full = torch.zeros((B * L, B * L), dtype=torch.bool)
    for b in range(B):
        full[b * L : (b + 1) * L, b * L : (b + 1) * L] = mask[b]
    return full


# ------------------------------------------------------------------------------------------------------
# 1. layout invariants
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCENARIOS)
def test_shared_prompt_layout_matches_brute_force(name):
    groups, max_row = groups_of(name)
    packed = pack(groups, PAD, shared_prompt=True, max_row_tokens=max_row)
    layout = packed.attention
    records, L, mask = brute_force_layout(groups, max_row)
    B = len(records)
    assert packed.input_ids.shape == (B, L)

    # tokens, positions, padding
    flat_of = {}
    for b, tokens in enumerate(records):
        n = len(tokens)
        assert packed.input_ids[b, :n].tolist() == [tok for *_, tok, _ in tokens]
        assert packed.position_ids[b, :n].tolist() == [pos for *_, pos in tokens]
        assert (packed.input_ids[b, n:] == PAD).all()
        assert (layout.segment_ids[b, :n] >= 0).all() and (layout.segment_ids[b, n:] == -1).all()
        for j, (g, i, t, _, _) in enumerate(tokens):
            flat_of[(g, i, t)] = b * L + j
    real = (layout.segment_ids.flatten() >= 0).nonzero()[:, 0]
    assert packed.tokens_computed == sum(len(p) + sum(len(c) - 1 for c in cs) for p, cs in groups) == len(real)

    # labels: completions' tokens in sample order; c_i[0] read at the prompt's last position
    completions = [(g, i, p, c) for g, (p, cs) in enumerate(groups) for i, c in enumerate(cs)]
    width = max(len(c) for *_, c in completions)
    exp_pos, exp_tgt, exp_slot = [], [], []
    for s, (g, i, p, c) in enumerate(completions):
        exp_pos += [flat_of[(g, -1, len(p) - 1)]] + [flat_of[(g, i, t)] for t in range(len(c) - 1)]
        exp_tgt += c
        exp_slot += [s * width + t for t in range(len(c))]
    assert packed.label_targets.tolist() == exp_tgt
    assert packed.label_positions.tolist() == exp_pos
    assert packed.label_slots.tolist() == exp_slot
    assert packed.completion_mask.tolist() == [[t < len(c) for t in range(width)] for *_, c in completions]
    # a 1-token completion has no input token but exactly one label (at the prompt's last position)
    for s, (g, i, p, c) in enumerate(completions):
        if len(c) == 1:
            assert (g, i, 0) not in flat_of
            assert packed.completion_mask[s].sum() == 1

    # dense mask == brute force on every real query; no real query sees a pad; no empty softmax row
    dense = dense_allowed(layout)[:, 0]
    real_q = layout.segment_ids >= 0
    assert torch.equal(dense[real_q], mask[real_q])
    assert dense.any(-1).all()

    flat_dense = block_diagonal(dense)
    # varlen form: every real token exactly once as a query; segments are bottom-right causal
    assert sorted(layout.query_index.tolist()) == real.tolist()
    cu_q, cu_k = layout.cu_seqlens_q, layout.cu_seqlens_k
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert cu_q[0] == 0 and cu_k[0] == 0 and len(cu_q) == len(cu_k)
    assert cu_q[-1] == len(layout.query_index) and cu_k[-1] == len(layout.key_index)
    q_lens, k_lens = cu_q.diff(), cu_k.diff()
    assert (q_lens >= 1).all() and (k_lens >= q_lens).all()
    assert layout.max_seqlen_q == int(q_lens.max()) and layout.max_seqlen_k == int(k_lens.max())
    varlen = torch.zeros_like(flat_dense)
    for s in range(len(cu_q) - 1):
        qs = layout.query_index[cu_q[s] : cu_q[s + 1]]
        ks = layout.key_index[cu_k[s] : cu_k[s + 1]]
        assert torch.equal(ks[len(ks) - len(qs) :], qs)  # the queries are the keys' last tokens
        i, j = torch.arange(len(qs))[:, None], torch.arange(len(ks))[None, :]
        varlen[qs[:, None], ks[None, :]] = j <= i + len(ks) - len(qs)
    assert torch.equal(varlen[real], flat_dense[real])

    # buckets: each real token a valid query exactly once; allowed keys map exactly onto the dense mask
    counts = torch.zeros(flat_dense.shape, dtype=torch.long)
    seen = torch.zeros(B * L, dtype=torch.long)
    for bucket in layout.buckets:
        S, Q = bucket.query_index.shape
        K = bucket.key_index.shape[1]
        assert bucket.allowed.shape == (S, 1, Q, K)
        assert bucket.allowed[:, 0].any(-1).all()  # padded query slots too: no NaN
        seen.index_add_(
            0, bucket.query_index[bucket.query_valid], torch.ones_like(bucket.query_index[bucket.query_valid])
        )
        sel = bucket.allowed[:, 0] & bucket.query_valid[:, :, None]
        qi = bucket.query_index[:, :, None].expand(S, Q, K)[sel]
        ki = bucket.key_index[:, None, :].expand(S, Q, K)[sel]
        counts.index_put_((qi, ki), torch.ones_like(qi), accumulate=True)
    assert torch.equal(seen[real], torch.ones_like(real)) and seen.sum() == len(real)
    assert torch.equal(counts[real], flat_dense[real].long())


def test_pack_docstring_example_and_row_splitting():
    batch = pack([([7, 8, 9], [[1, 2], [3]])], pad_id=0, shared_prompt=True)
    assert batch.input_ids.tolist() == [[7, 8, 9, 1]] and batch.position_ids.tolist() == [[0, 1, 2, 3]]
    assert batch.label_positions.tolist() == [2, 3, 2] and batch.label_targets.tolist() == [1, 2, 3]

    groups, max_row = groups_of("rows")
    packed = pack(groups, PAD, shared_prompt=True, max_row_tokens=max_row)
    sizes = [len(p) + sum(len(c) - 1 for c in cs) for p, cs in groups]
    assert packed.input_ids.shape[0] >= 3
    assert (packed.attention.segment_ids == -1).any()  # some row is padded
    per_row = (packed.attention.segment_ids >= 0).sum(1)
    assert all(n <= max(max_row, max(sizes)) for n in per_row.tolist())
    # without max_row_tokens: one row, no padding
    one = pack(groups, PAD, shared_prompt=True)
    assert one.input_ids.shape == (1, sum(sizes)) and (one.attention.segment_ids >= 0).all()


def test_padded_layout_one_row_per_completion():
    groups, _ = groups_of("multi")
    packed = pack(groups, PAD, shared_prompt=False, max_row_tokens=10)
    completions = [(p, c) for p, cs in groups for c in cs]
    L = max(len(p) + len(c) - 1 for p, c in completions)
    assert packed.attention is None and packed.position_ids is None
    assert packed.input_ids.shape == (len(completions), L)
    width = max(len(c) for _, c in completions)
    pos, tgt, slot = [], [], []
    for s, (p, c) in enumerate(completions):
        row = p + c[:-1]
        assert packed.input_ids[s].tolist() == row + [PAD] * (L - len(row))
        pos += [s * L + len(p) - 1 + t for t in range(len(c))]
        tgt += c
        slot += [s * width + t for t in range(len(c))]
    assert packed.label_positions.tolist() == pos
    assert packed.label_targets.tolist() == tgt
    assert packed.label_slots.tolist() == slot
    assert packed.tokens_computed == sum(len(p) + len(c) - 1 for p, c in completions)


def test_pack_rejects_empty_completion():
    with pytest.raises(ValueError):
        pack([([1, 2], [[3], []])], PAD, shared_prompt=True)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "padded"])
def test_pack_rejects_empty_prompt(shared):
    """c_i[0] is read at the prompt's last position: an empty prompt has none, and must be refused clearly
    (like an empty completion), not fail with an IndexError from inside the packer."""
    with pytest.raises(ValueError, match="prompt"):
        pack([([5], [[3]]), ([], [[1, 2]])], PAD, shared_prompt=shared)


# ------------------------------------------------------------------------------------------------------
# 2. packed log-probs == unpacked HF reference
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.parametrize("backend", ["sdpa", "dense"])
@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logprobs_equal_unpacked_reference(family, gqa, backend, name):
    model = tiny_model(family, gqa)
    groups, max_row = groups_of(name)
    for temperature in (1.0, 0.7):
        with torch.no_grad():
            got, packed = packed_logprobs(model, groups, temperature, backend, max_row_tokens=max_row)
        expected = cached_reference(family, gqa, 0, name, temperature)
        assert got.shape == packed.completion_mask.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
        assert (got[~packed.completion_mask] == 0).all()
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("gqa", [True, False], ids=["gqa", "mha"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_rows_equal_unpacked_reference(family, gqa):
    model = tiny_model(family, gqa)
    groups, _ = groups_of("rows")
    with torch.no_grad():
        got, packed = packed_logprobs(model, groups, 0.7, shared_prompt=False)
    assert packed.attention is None
    torch.testing.assert_close(got, cached_reference(family, gqa, 0, "rows", 0.7), rtol=RTOL, atol=ATOL)


def test_reference_is_sensitive_to_the_mask():
    """Power check: plain causal attention over the packed row (completions seeing each other) must miss
    the reference by far more than the tolerance, or the equality tests above would prove little."""
    model = tiny_model("qwen2", True)
    groups, _ = groups_of("multi")
    packed = pack(groups, PAD, shared_prompt=True)
    with torch.no_grad():
        hidden = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids).last_hidden_state
        logits = model.lm_head(hidden.reshape(-1, hidden.shape[-1])[packed.label_positions])
        wrong = torch.log_softmax(logits, -1).gather(-1, packed.label_targets[:, None])[:, 0]
    expected = cached_reference("qwen2", True, 0, "multi", 1.0)[packed.completion_mask]
    assert (wrong - expected).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------------
# 3. gradients
# ------------------------------------------------------------------------------------------------------
def assert_grads_close(got, expected, names):
    for name, g, e in zip(names, got, expected):
        scale = float(e.abs().max())
        torch.testing.assert_close(g, e, rtol=RTOL, atol=max(1e-5 * scale, 1e-8), msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "family, backend, tied",
    [
        ("qwen2", "sdpa", False),
        ("qwen2", "dense", False),
        ("llama", "sdpa", False),
        ("llama", "dense", False),
        ("qwen2", "sdpa", True),
    ],
    ids=["qwen2-sdpa", "qwen2-dense", "llama-sdpa", "llama-dense", "qwen2-sdpa-tied"],
)
def test_packed_gradients_equal_unpacked_reference(family, backend, tied):
    model = tiny_model(family, True, tied=tied)
    names, params = zip(*model.named_parameters())
    groups, max_row = groups_of("rows")
    temperature = 0.7
    # chunk_size 5: the LM-head kernel's backward runs over several chunks
    got, packed = packed_logprobs(model, groups, temperature, backend, max_row_tokens=max_row, chunk_size=5)
    weights = torch.randn(packed.completion_mask.shape, generator=torch.Generator().manual_seed(5))
    mask = packed.completion_mask.float()
    grads = torch.autograd.grad((got * weights * mask).sum(), params, allow_unused=True)
    expected = reference_logprobs(model, groups, temperature)
    ref_grads = torch.autograd.grad((expected * weights * mask).sum(), params, allow_unused=True)
    assert all(g is not None for g in ref_grads)
    assert_grads_close(grads, ref_grads, names)


# ------------------------------------------------------------------------------------------------------
# 4. tri-model: one layout, three models
# ------------------------------------------------------------------------------------------------------
def test_tri_model_shares_one_layout():
    groups, max_row = groups_of("rows")
    packed = pack(groups, PAD, shared_prompt=True, max_row_tokens=max_row)
    packed.attention.backend = "sdpa"
    outputs = []
    for seed in (0, 1, 2):  # policy, old, reference
        model = tiny_model("qwen2", True, seed)
        with torch.no_grad():
            got = completion_logprobs(model, packed, 1.0)
        torch.testing.assert_close(got, cached_reference("qwen2", True, seed, "rows", 1.0), rtol=RTOL, atol=ATOL)
        outputs.append(got)
    assert (outputs[0] - outputs[1]).abs().max() > 1e-2  # the three models really differ


# ------------------------------------------------------------------------------------------------------
# 5. chunked LM-head log-probs
# ------------------------------------------------------------------------------------------------------
def naive_linear_logprobs(h, w, targets, temperature, b=None):
    logits = h.float() @ w.float().T + (b.float() if b is not None else 0.0)
    return torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("chunk", [1, 3, 10, 17])
def test_linear_token_logprobs_float32(chunk, with_bias):
    gen = torch.Generator().manual_seed(chunk)
    N, d, V, T = 10, 8, 13, 0.7
    h = torch.randn(N, d, generator=gen, requires_grad=True)
    w = torch.randn(V, d, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)
    inputs = [h, w] + ([b] if with_bias else [])

    got = linear_token_logprobs(h, w, targets, T, bias=b, chunk_size=chunk)
    expected = naive_linear_logprobs(h, w, targets, T, b)
    assert got.dtype == torch.float32 and got.shape == (N,)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    grads = torch.autograd.grad((got * upstream).sum(), inputs)
    ref = torch.autograd.grad((expected * upstream).sum(), inputs)
    for g, e in zip(grads, ref):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def test_linear_token_logprobs_bfloat16():
    gen = torch.Generator().manual_seed(0)
    N, d, V, T = 12, 16, 29, 0.7
    h = torch.randn(N, d, generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(V, d, generator=gen) * 0.3).bfloat16().requires_grad_()
    b = torch.randn(V, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (N,), generator=gen)
    upstream = torch.randn(N, generator=gen)
    got = linear_token_logprobs(h, w, targets, T, bias=b, chunk_size=5)
    expected = naive_linear_logprobs(h, w, targets, T, b)  # float32 from the same bf16 values
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=5e-2)
    grads = torch.autograd.grad((got * upstream).sum(), (h, w, b))
    ref = torch.autograd.grad((expected * upstream).sum(), (h, w, b))
    for g, e in zip(grads, ref):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e.float(), rtol=5e-2, atol=5e-2)


def test_linear_token_logprobs_rejects_bad_chunk():
    with pytest.raises(ValueError):
        linear_token_logprobs(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1]), chunk_size=0)


def test_linear_token_logprobs_saves_no_full_logits():
    """The autograd graph keeps only the inputs: no tensor of N*V (or more) elements is saved for backward."""
    N, d, V = 64, 16, 1000
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    b = torch.randn(V, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    saved = []

    def pack_hook(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        out = linear_token_logprobs(h, w, targets, 0.7, bias=b, chunk_size=8)
    assert saved, "the hook saw nothing: the check would be vacuous"
    assert all(torch.Size(s).numel() < N * V for s in saved), saved
    out.sum().backward()
    assert h.grad is not None and w.grad is not None and b.grad is not None


def test_linear_token_logprobs_never_allocates_full_logits():
    """N=4096, V=50000 (819 MB of float32 logits): with chunk 256, no single CPU allocation of forward or
    backward comes near N*V*4 bytes (measured with the profiler's memory events)."""
    N, d, V, chunk = 4096, 8, 50000, 256
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = linear_token_logprobs(h, w, targets, 1.0, chunk_size=chunk)
        out.sum().backward()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    assert sizes, "the profiler recorded no allocation: the check would be vacuous"
    largest = max(sizes)
    assert largest >= chunk * V * 4  # it did see the chunk's logits
    assert largest < N * V * 4 // 8, f"largest allocation {largest} bytes"


# ------------------------------------------------------------------------------------------------------
# 6. backend selection, missing layout, context restore
# ------------------------------------------------------------------------------------------------------
def test_resolve_backend_on_cpu():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("sdpa", "cpu") == "sdpa"
    assert resolve_backend("dense", torch.device("cpu")) == "dense"
    for name, need in (("flex", "CUDA"), ("flash", "flash-attn"), ("npu", "torch_npu")):
        with pytest.raises(ValueError, match=need):
            resolve_backend(name, "cpu")
    with pytest.raises(ValueError) as error:
        resolve_backend("xformers", "cpu")
    assert "xformers" in str(error.value)
    assert all(name in str(error.value) for name in BACKENDS)


def test_missing_layout_and_context_restore():
    model = tiny_model("qwen2", True)
    before = model.config._attn_implementation
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="shared_prompt"):
        with use_shared_prompt_attention(model):
            assert model.config._attn_implementation == ATTENTION_NAME
            model(input_ids=ids)
    assert model.config._attn_implementation == before
    with pytest.raises(KeyError):
        with use_shared_prompt_attention(model):
            raise KeyError("body fails")
    assert model.config._attn_implementation == before
    with torch.no_grad():  # the model works normally afterwards
        model(input_ids=ids)


def test_attention_dropout_is_refused():
    q = torch.randn(1, 2, 3, 4)
    layout = pack([([1, 2], [[3, 4]])], PAD, shared_prompt=True).attention
    with pytest.raises(ValueError, match="dropout"):
        shared_prompt_attention(None, q, q, q, None, dropout=0.1, shared_prompt=layout)


def require_flex() -> None:
    """Skip only when this torch has no flex_attention (torch < 2.5); any error of ours then fails the test."""
    pytest.importorskip(
        "torch.nn.attention.flex_attention",
        reason=f"torch {torch.__version__} has no torch.nn.attention.flex_attention (torch >= 2.5)",
    )


@pytest.mark.parametrize("backend", ["sdpa", "dense", "flash", "npu", "flex"])
@pytest.mark.parametrize("window", [1, 3, 6, 19])
def test_sliding_window_is_applied(fake_device_kernels, monkeypatch, backend, window):
    """Mistral applies its sliding window in attention (``sliding_window`` kwarg): a window shorter than the
    prompt, or (19) longer than the longest query segment (the 17-token prompt) but shorter than the longest
    key span (that prompt and a 6-token completion: 22 keys), must give exactly what the model computes
    unpacked (flash and npu through the fakes)."""
    if backend == "flex":
        require_flex()
    monkeypatch.setattr(attention_module, "_flex_by_device", {})
    model = tiny_model("mistral", True, sliding_window=window)
    groups, _ = groups_of("multi")  # the 17-token prompt exceeds the window
    expected = reference_logprobs(model, groups, 1.0).detach()
    half_only = backend in HALF_ONLY  # bfloat16 only: under autocast, as bf16-mixed trains
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16) if half_only else contextlib.nullcontext():
        got, packed = packed_logprobs(model, groups, 1.0, backend)
    if half_only:  # the bounds of test_device_backends_through_the_model_in_bfloat16
        error = (got - expected)[packed.completion_mask].abs()
        assert error.mean() < 0.05 and error.max() < 0.25, (float(error.mean()), float(error.max()))
    else:
        torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    if window in (6, 19):  # the window matters: ignoring it gives other numbers, far beyond bfloat16's bounds too
        plain = tiny_model("mistral", True, sliding_window=None)
        plain.load_state_dict(model.state_dict())
        unwindowed = (reference_logprobs(plain, groups, 1.0) - expected)[packed.completion_mask].abs()
        assert unwindowed.max() > 0.5, float(unwindowed.max())


def test_sliding_window_gradients_match():
    model = tiny_model("mistral", True, sliding_window=4)
    groups, _ = groups_of("multi")
    weights = None
    grads = {}
    for name in ("reference", "sdpa"):
        model.zero_grad(set_to_none=True)
        logp = (
            reference_logprobs(model, groups, 1.0)
            if name == "reference"
            else packed_logprobs(model, groups, 1.0, "sdpa")[0]
        )
        if weights is None:
            weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
        (logp * weights).sum().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["sdpa"], grads["reference"]):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-5)


# ------------------------------------------------------------------------------------------------------
# 7-8. kernel-level: every backend against a brute-force attention on random q/k/v
# ------------------------------------------------------------------------------------------------------
@functools.cache
def layer_inputs():
    """A real layout ("rows": several rows, padding, split group) and q/k/v shaped like a GQA layer."""
    groups, max_row = groups_of("rows")
    layout = pack(groups, PAD, shared_prompt=True, max_row_tokens=max_row).attention
    _, _, mask = brute_force_layout(groups, max_row)
    B, L = layout.segment_ids.shape
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(B, 4, L, 16, generator=gen) * 2
    k = torch.randn(B, 2, L, 16, generator=gen) * 2
    v = torch.randn(B, 2, L, 16, generator=gen)
    real = layout.segment_ids >= 0
    # brute-force reference: SDPA with the rule's mask (pad queries attend to themselves only)
    m = mask | (~real[:, :, None] & torch.eye(L, dtype=torch.bool))
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=m[:, None], scale=SCALE
    )
    return layout, q, k, v, real, ref.transpose(1, 2)  # [B, L, H, D]


def run_kernel(layout, backend, q, k, v):
    layout.backend = backend
    try:
        out, weights = shared_prompt_attention(None, q, k, v, None, scaling=SCALE, shared_prompt=layout)
    finally:
        layout.backend = "sdpa"
    assert weights is None and out.shape == (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    return out


@pytest.mark.parametrize("backend", ["sdpa", "dense"])
def test_kernel_forward_and_backward_against_brute_force(backend):
    layout, q, k, v, real, ref = layer_inputs()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = run_kernel(layout, backend, q, k, v)
    torch.testing.assert_close(out[real], ref[real], rtol=RTOL, atol=ATOL)
    # gradients of the real tokens' outputs against the brute-force attention's
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * real[:, :, None, None]
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    groups, max_row = groups_of("rows")
    _, _, mask = brute_force_layout(groups, max_row)
    L = mask.shape[-1]
    m = mask | (~real[:, :, None] & torch.eye(L, dtype=torch.bool))
    ref2 = F.scaled_dot_product_attention(
        q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), attn_mask=m[:, None], scale=SCALE
    ).transpose(1, 2)
    ref_grads = torch.autograd.grad((ref2 * upstream).sum(), (q2, k2, v2))
    for g, e in zip(grads, ref_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_flex_block_mask_matches_dense():
    require_flex()
    for name in SCENARIOS:
        groups, max_row = groups_of(name)
        layout = pack(groups, PAD, shared_prompt=True, max_row_tokens=max_row).attention
        block_mask = flex_block_mask(layout, "cpu")
        B, L = layout.segment_ids.shape
        b = torch.arange(B)[:, None, None]
        qi = torch.arange(L)[None, :, None]
        ki = torch.arange(L)[None, None, :]
        token_mask = block_mask.mask_mod(b, torch.zeros((), dtype=torch.long), qi, ki)
        dense = dense_allowed(layout)[:, 0]
        assert torch.equal(token_mask.expand(B, L, L), dense), name
        # every allowed (q, kv) pair lies in a block the BlockMask computes
        blocks = block_mask.to_dense()[:, 0].bool()  # [B, nq_blocks, nkv_blocks]
        bq, bk = block_mask.BLOCK_SIZE
        where = dense.nonzero()
        assert blocks[where[:, 0], where[:, 1] // bq, where[:, 2] // bk].all(), name


def test_flex_forward_on_cpu_matches_brute_force(monkeypatch):
    """flex_attention runs eagerly on the CPU (forward only): an error here is a bug, not a missing feature."""
    require_flex()
    monkeypatch.setattr(attention_module, "_flex_by_device", {})  # restored afterwards (it is cached per process)
    layout, q, k, v, real, ref = layer_inputs()
    layout.__dict__.pop("_block_masks", None)
    try:
        with torch.no_grad():
            out = run_kernel(layout, "flex", q, k, v)
    finally:
        layout.__dict__.pop("_block_masks", None)  # layer_inputs() is cached: leave no flex mask on it
    torch.testing.assert_close(out[real], ref[real], rtol=RTOL, atol=ATOL)


def _torch_check(condition: bool, message: str) -> None:
    """A failed ``TORCH_CHECK``: the real kernels raise RuntimeError with these messages."""
    if not condition:
        raise RuntimeError(message)


def fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **kwargs,
):
    """flash-attn 2.x's ``flash_attn_varlen_func`` with plain SDPA, refusing what it refuses.

    The checks are ``mha_varlen_fwd``'s ``TORCH_CHECK``s (csrc/flash_attn/flash_api.cpp), with their messages:
    q float16/bfloat16, k and v of q's dtype, cu_seqlens int32 and contiguous, a head dimension of at most
    256, query heads a multiple of the key/value heads, k/v/cu_seqlens shapes that agree. "Must be on CUDA"
    stands here for "on q's device". Two things the C++ checks would refuse never reach them through the
    Python function, so the fake accepts them too: a last dimension that is not contiguous
    (``maybe_contiguous`` copies it) and a head dimension that is not a multiple of 8 (padded, then sliced off).

    Semantics: per segment, query i of q_len sees key j of k_len iff j <= i + k_len - q_len (bottom-right
    causal) and, with ``window_size=(left, 0)``, j >= i + k_len - q_len - left; GQA by head groups. The output
    has q's dtype.
    """
    assert causal and dropout_p == 0.0 and not kwargs and window_size[1] in (-1, 0)  # what lit_parl passes
    _torch_check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _torch_check(k.dtype == q.dtype, "query and key must have the same dtype")
    _torch_check(v.dtype == q.dtype, "query and value must have the same dtype")
    _torch_check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _torch_check(cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for name, tensor in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _torch_check(tensor.device == q.device, f"{name} must be on CUDA")
    _torch_check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _torch_check(cu_seqlens_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _torch_check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [total, heads, head_size]")
    batch, (total_q, H, D), (total_k, Hkv) = cu_seqlens_q.numel() - 1, q.shape, k.shape[:2]
    _torch_check(batch > 0, "batch size must be positive")
    _torch_check(D <= 256, "FlashAttention forward only supports head dimension at most 256")
    _torch_check(H % Hkv == 0, "Number of heads in key/value must divide number of heads in query")
    _torch_check(k.shape == (total_k, Hkv, D), "k must have shape (total_k, num_heads_k, head_size_og)")
    _torch_check(v.shape == (total_k, Hkv, D), "v must have shape (total_k, num_heads_k, head_size_og)")
    _torch_check(cu_seqlens_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
    q, k, v = (x.contiguous() if x.stride(-1) != 1 else x for x in (q, k, v))  # the Python wrapper's maybe_contiguous
    # lit_parl's layout fills every slot: the segments cover q and k exactly
    assert total_q == int(cu_seqlens_q[-1]) and total_k == int(cu_seqlens_k[-1])
    outputs = []
    for s in range(batch):
        qs = q[cu_seqlens_q[s] : cu_seqlens_q[s + 1]].transpose(0, 1)
        ks = k[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        vs = v[cu_seqlens_k[s] : cu_seqlens_k[s + 1]].transpose(0, 1).repeat_interleave(H // Hkv, 0)
        q_len, k_len = qs.shape[1], ks.shape[1]
        assert q_len <= max_seqlen_q and k_len <= max_seqlen_k
        diagonal = torch.arange(q_len)[:, None] + (k_len - q_len)
        allowed = torch.arange(k_len)[None, :] <= diagonal
        if window_size[0] >= 0:
            allowed &= torch.arange(k_len)[None, :] >= diagonal - window_size[0]
        outputs.append(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=softmax_scale).transpose(0, 1)
        )
    return torch.cat(outputs)


def fake_npu_fusion_attention(
    q, k, v, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0, **kwargs
):
    """torch_npu's ``npu_fusion_attention`` (layout BNSD) with plain SDPA, refusing what its documentation rules
    out (torch_npu API reference, CANN 7.0/8.0): query, key and value FLOAT16 or BFLOAT16, all of one dtype;
    4-D BNSD tensors with ``head_num`` query heads, N1 a multiple of N2 and D at most 512; ``atten_mask`` BOOL
    in shape BNSS, B1SS, 11SS or SS, True marking a position that does NOT take part. (torch_npu 6.0's page also
    lists FLOAT32; lit_parl relies only on float16/bfloat16, which every release takes.)
    Returns the 7-tuple whose first item is the output."""
    assert input_layout == "BNSD" and keep_prob == 1.0 and pse is None and padding_mask is None  # what lit_parl passes
    _torch_check(
        q.dtype in (torch.float16, torch.bfloat16),
        f"npu_fusion_attention: query dtype {q.dtype} not in FLOAT16, BFLOAT16",
    )
    _torch_check(
        k.dtype == q.dtype and v.dtype == q.dtype, "npu_fusion_attention: query, key and value must have one dtype"
    )
    _torch_check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, "npu_fusion_attention: BNSD tensors are 4-D")
    (B, N1, Sq, D), (N2, Skv) = q.shape, k.shape[1:3]
    _torch_check(head_num == N1, f"npu_fusion_attention: head_num {head_num} != query heads {N1}")
    _torch_check(
        N1 % N2 == 0 and k.shape == v.shape == (B, N2, Skv, D),
        "npu_fusion_attention: key/value heads must divide query heads",
    )
    _torch_check(D <= 512, "npu_fusion_attention: D must be at most 512")
    _torch_check(atten_mask is None or atten_mask.dtype == torch.bool, "npu_fusion_attention: atten_mask must be BOOL")
    if atten_mask is not None:
        allowed_shapes = {(B, N1, Sq, Skv), (B, 1, Sq, Skv), (1, 1, Sq, Skv), (Sq, Skv)}
        _torch_check(
            tuple(atten_mask.shape) in allowed_shapes,
            f"npu_fusion_attention: atten_mask shape {tuple(atten_mask.shape)} not BNSS/B1SS/11SS/SS",
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=None if atten_mask is None else ~atten_mask, scale=scale, enable_gqa=N2 != N1
    )
    return (out, None, None, None, 0, 0, 0)


def fake_module(name: str, **functions) -> types.ModuleType:
    """A stand-in package with a spec, so ``importlib.util.find_spec`` sees it as installed."""
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for attribute, function in functions.items():
        setattr(module, attribute, function)
    return module


@pytest.fixture
def fake_device_kernels(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "flash_attn", fake_module("flash_attn", flash_attn_varlen_func=fake_flash_attn_varlen_func)
    )
    monkeypatch.setitem(
        sys.modules, "torch_npu", fake_module("torch_npu", npu_fusion_attention=fake_npu_fusion_attention)
    )


BF16_TOL = {"rtol": 2e-2, "atol": 2e-2}  # bfloat16 keeps 8 significant bits: 2^-8 = 3.9e-3 relative per rounding


def brute_force_attention(q, k, v, real):
    """The rule's attention in float32 (``layer_inputs``' mask) for q/k/v of any dtype: [B, L, H, D]."""
    groups, max_row = groups_of("rows")
    _, _, mask = brute_force_layout(groups, max_row)
    L = mask.shape[-1]
    m = mask | (~real[:, :, None] & torch.eye(L, dtype=torch.bool))
    q, k, v = q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m[:, None], scale=SCALE).transpose(1, 2)


@pytest.mark.parametrize("backend", ["flash", "npu", "sdpa", "dense"])
def test_kernels_in_bfloat16_against_a_float32_brute_force(fake_device_kernels, backend):
    """bfloat16 q/k/v (flash and npu through the fakes, which take nothing else): outputs and gradients against
    the rule's attention computed in float32 from the same bfloat16 values, at bfloat16's tolerance. A wrong
    mask misses by far more (checked: plain causal attention over the packed rows)."""
    layout, q, k, v, real, _ = layer_inputs()
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    out = run_kernel(layout, backend, q, k, v)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = brute_force_attention(q32, k32, v32, real)
    torch.testing.assert_close(out.float()[real], ref[real], **BF16_TOL)
    causal = F.scaled_dot_product_attention(
        q32, k32.repeat_interleave(2, 1), v32.repeat_interleave(2, 1), is_causal=True, scale=SCALE
    )
    assert (causal.transpose(1, 2) - ref)[real].abs().max() > 1.0  # the tolerance is far below a mask's error
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)) * real[:, :, None, None]
    grads = torch.autograd.grad((out.float() * upstream).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (q32, k32, v32))
    for g, e in zip(grads, ref_grads):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), e, rtol=5e-2, atol=5e-2 * float(e.abs().max()))


def test_the_fake_kernels_refuse_what_the_real_ones_refuse():
    """The fakes stand in for flash-attn and torch_npu only if they take no more than the real kernels: float32
    (the issue: a float32 model reached flash through an accepting fake), mixed dtypes, int64 cu_seqlens, a head
    dimension above flash's 256, key/value heads that do not divide the query heads, a non-bool npu mask."""
    layout, q, k, v, real, _ = layer_inputs()
    qf, kf, vf = (attention_module._flat(t) for t in (q, k, v))
    args = (layout.cu_seqlens_q, layout.cu_seqlens_k, layout.max_seqlen_q, layout.max_seqlen_k)

    def flash(q, k, v, *rest):
        return fake_flash_attn_varlen_func(
            q[layout.query_index],
            k[layout.key_index],
            v[layout.key_index],
            *(rest or args),
            softmax_scale=SCALE,
            causal=True,
        )

    bq, bk, bv = qf.bfloat16(), kf.bfloat16(), vf.bfloat16()
    good = flash(bq, bk, bv)
    assert good.dtype == torch.bfloat16
    assert flash(bq.half(), bk.half(), bv.half()).dtype == torch.float16
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16 data type"):
        flash(qf, kf, vf)
    with pytest.raises(RuntimeError, match="query and value must have the same dtype"):
        flash(bq, bk, vf)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        flash(bq, bk, bv, layout.cu_seqlens_q.long(), *args[1:])
    with pytest.raises(RuntimeError, match="head dimension at most 256"):
        flash(*(t.repeat(1, 1, 17) for t in (bq, bk, bv)))  # head_dim 272
    with pytest.raises(RuntimeError, match="must divide number of heads in query"):
        flash(bq, bk.repeat(1, 3, 1)[:, :3], bv.repeat(1, 3, 1)[:, :3])  # 4 query heads, 3 key/value heads
    # what flash-attn's Python function fixes before its checks: a strided last dimension, a head_dim of 12
    strided = torch.stack([bq, bq], -1)[..., 0]  # bq with a last-dimension stride of 2
    assert strided.stride(-1) != 1 and torch.equal(flash(strided, bk, bv), good)
    assert flash(bq[..., :12], bk[..., :12], bv[..., :12]).shape[-1] == 12

    qs, ks, vs = (t[:1].bfloat16() for t in (q, k, v))  # BNSD, one row
    ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)
    mask = torch.ones(1, 1, qs.shape[2], ks.shape[2], dtype=torch.bool).triu(1)
    out = fake_npu_fusion_attention(qs, ks, vs, 4, "BNSD", atten_mask=mask, scale=SCALE)[0]
    assert out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="not in FLOAT16, BFLOAT16"):
        fake_npu_fusion_attention(qs.float(), ks.float(), vs.float(), 4, "BNSD", atten_mask=mask, scale=SCALE)
    with pytest.raises(RuntimeError, match="one dtype"):
        fake_npu_fusion_attention(qs, ks, vs.float(), 4, "BNSD", atten_mask=mask, scale=SCALE)
    with pytest.raises(RuntimeError, match="atten_mask must be BOOL"):
        fake_npu_fusion_attention(qs, ks, vs, 4, "BNSD", atten_mask=mask.bfloat16(), scale=SCALE)
    with pytest.raises(RuntimeError, match="head_num 2"):
        fake_npu_fusion_attention(qs, ks, vs, 2, "BNSD", atten_mask=mask, scale=SCALE)
    with pytest.raises(RuntimeError, match="not BNSS/B1SS/11SS/SS"):
        fake_npu_fusion_attention(qs, ks, vs, 4, "BNSD", atten_mask=mask[0], scale=SCALE)


@pytest.mark.parametrize("backend", ["flash", "npu"])
def test_half_only_backends_refuse_float32_compute_naming_the_fix(fake_device_kernels, backend):
    """A float32 forward never reaches flash or npu: the kernel checks the dtype it computes in and names the fix;
    under autocast (``bf16-mixed``) the same float32 tensors run, cast to bfloat16."""
    layout, q, k, v, real, _ = layer_inputs()
    with pytest.raises(
        ValueError, match=r"float16/bfloat16 only.*precision='bf16-mixed'.*model.dtype=bfloat16.*flex.*sdpa"
    ):
        run_kernel(layout, backend, q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_kernel(layout, backend, q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.float()[real], brute_force_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), real)[real], **BF16_TOL
    )


def test_auto_picks_by_device_and_compute_dtype(fake_device_kernels):
    """``auto`` with flash-attn and torch_npu installed (the fakes): flash for bf16/fp16 on CUDA and flex for float32;
    npu for bf16 on an Ascend device and sdpa for float32; an explicit half-only backend for float32 is an error."""
    assert resolve_backend("auto", "cuda", torch.bfloat16) == "flash"
    assert resolve_backend("auto", "cuda", torch.float16) == "flash"
    assert resolve_backend("auto", "cuda", torch.float32) == "flex"
    assert resolve_backend("auto", "npu", torch.bfloat16) == "npu"
    assert resolve_backend("auto", "npu", torch.float32) == "sdpa"
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "sdpa"
    assert resolve_backend("auto", "cuda") == "flash"  # dtype not known yet: the device's best
    assert resolve_backend("flex", "cuda", torch.float32) == "flex"
    for backend, device in (("flash", "cuda"), ("npu", "npu")):
        assert resolve_backend(backend, device, torch.bfloat16) == backend
        with pytest.raises(ValueError, match=rf"'{backend}' computes in float16/bfloat16 only.*bf16-mixed"):
            resolve_backend(backend, device, torch.float32)


# how the model computes in bfloat16: Lightning's bf16-mixed (autocast over float32 weights), or bf16 weights
PRECISIONS = {
    "bf16-mixed": (lambda model: model, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
    "bf16-weights": (lambda model: copy.deepcopy(model).to(torch.bfloat16), contextlib.nullcontext),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("backend", ["flash", "npu", "flex", "sdpa"])
def test_device_backends_through_the_model_in_bfloat16(fake_device_kernels, monkeypatch, backend, precision):
    """Packed log-probs computed in bfloat16, each backend (flash and npu through the fakes, flex for real, forward
    only) against the float32 unpacked reference. Over the completions the mean error stays below 0.05 nats and
    the largest below 0.25 (this model's logits reach ~11); a wrong mask gives ~2 and ~7 (a window of 2 keys)."""
    if backend == "flex":
        require_flex()
    monkeypatch.setattr(attention_module, "_flex_by_device", {})
    convert, context = PRECISIONS[precision]
    model = convert(tiny_model("qwen3", True))
    groups, max_row = groups_of("rows")
    with torch.no_grad(), context():
        got, packed = packed_logprobs(model, groups, 0.7, backend, max_row_tokens=max_row)
    assert got.dtype == torch.float32
    error = (got - cached_reference("qwen3", True, 0, "rows", 0.7))[packed.completion_mask].abs()
    assert error.mean() < 0.05 and error.max() < 0.25, (float(error.mean()), float(error.max()))


@pytest.mark.parametrize("backend", ["flex"])
def test_device_backends_through_the_model(monkeypatch, backend):
    """flex for real in float32 (eager on the CPU, forward only: no flex backward there); flash and npu compute
    in bfloat16 only (``test_device_backends_through_the_model_in_bfloat16``)."""
    require_flex()
    monkeypatch.setattr(attention_module, "_flex_by_device", {})
    model = tiny_model("qwen3", True)
    groups, max_row = groups_of("rows")
    with torch.no_grad():
        got, _ = packed_logprobs(model, groups, 0.7, backend, max_row_tokens=max_row)
    torch.testing.assert_close(got, cached_reference("qwen3", True, 0, "rows", 0.7), rtol=RTOL, atol=ATOL)
