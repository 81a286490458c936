"""The vectorised packing, collation and sampling are bit-identical to the per-token implementations
they replaced (kept below, verbatim but for their names, as the references).

Every tensor of the layout is compared for dtype, shape, strides and exact values, on random micro-batches
of ragged groups: shared-prompt and padded, with and without ``max_row_tokens`` row splitting (the sdpa
buckets and the varlen windows included), long prompts, groups split over a micro-batch, one-token
completions. Sampling is compared token for token and log-prob for log-prob on a tiny model.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.kernels.packing import GroupTokens, PackedTokens, SegmentBucket, SharedPromptLayout, pack
from lit_parl.models import tiny_qwen2
from lit_parl.rollout import sampling as sampling_module
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sampling import SampledGroup, _cache_keyword, filter_logits, sample_groups


# ------------------------------------------------------------------------------------------------------
# references: the implementations before vectorisation
# ------------------------------------------------------------------------------------------------------
def _reference_bucket(segments: list[tuple[list[int], list[int]]]) -> SegmentBucket:
    """``segments``: (query token indices, key token indices), the queries being the keys' last tokens."""
    count = len(segments)
    q_max = max(len(q) for q, _ in segments)
    k_max = max(len(k) for _, k in segments)
    query_index = torch.zeros((count, q_max), dtype=torch.long)
    key_index = torch.zeros((count, k_max), dtype=torch.long)
    query_valid = torch.zeros((count, q_max), dtype=torch.bool)
    q_len = torch.tensor([len(q) for q, _ in segments])
    k_len = torch.tensor([len(k) for _, k in segments])
    for s, (queries, keys) in enumerate(segments):
        query_index[s, : len(queries)] = torch.tensor(queries)
        key_index[s, : len(keys)] = torch.tensor(keys)
        query_valid[s, : len(queries)] = True
    i = torch.arange(q_max)[None, :, None]
    j = torch.arange(k_max)[None, None, :]
    # bottom-right causal: query i is the (k_len - q_len + i)-th key
    allowed = (j < k_len[:, None, None]) & (j <= i + (k_len - q_len)[:, None, None])
    allowed = allowed & query_valid[:, :, None]
    allowed[:, :, 0] |= ~query_valid  # padded query slots see key 0 only
    return SegmentBucket(query_index, key_index, allowed[:, None], query_valid, k_len - q_len)


def reference_pack(
    groups: list[GroupTokens],
    pad_id: int,
    shared_prompt: bool,
    max_row_tokens: int | None = None,
) -> PackedTokens:
    """Lay out ``groups`` for one forward pass. Samples are numbered in order: group by group, then
    completion by completion; the output rows of ``completion_mask`` follow that numbering."""
    completions = [c for _, cs in groups for c in cs]
    if any(len(c) == 0 for c in completions):
        raise ValueError("every completion needs at least one token")
    if any(len(p) == 0 for p, _ in groups):
        raise ValueError(
            "every prompt needs at least one token (a completion's first token is read at the prompt's last position)"
        )
    width = max(len(c) for c in completions)
    if shared_prompt:
        units = [[(prompt, cs)] for prompt, cs in groups]  # a unit is what shares one prompt
    else:
        units = [[(prompt, [c])] for prompt, cs in groups for c in cs]
    unit_sizes = [sum(len(p) + sum(len(c) - 1 for c in cs) for p, cs in unit) for unit in units]

    rows: list[list[int]] = [[]]  # unit indices per row
    row_len = 0
    for u, size in enumerate(unit_sizes):
        if rows[-1] and max_row_tokens is not None and row_len + size > max_row_tokens:
            rows.append([])
            row_len = 0
        rows[-1].append(u)
        row_len += size
    if not shared_prompt:
        rows = [[u] for u in range(len(units))]  # padded layout: one completion per row, always
    length = max(sum(unit_sizes[u] for u in row) for row in rows)

    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    segment_ids = torch.full((len(rows), length), -1, dtype=torch.long)
    visible_prompt = torch.full((len(rows), length), -1, dtype=torch.long)
    label_positions, label_targets, label_slots = [], [], []
    prompt_segments, completion_segments = [], []  # (query indices, key indices) in flat B * L
    varlen = []  # (query indices, key indices) in segment order
    sample = 0
    segment = 0
    for r, row in enumerate(rows):
        cursor = 0
        for u in row:
            for prompt, cs in units[u]:
                base = r * length
                P = len(prompt)
                prompt_tokens = list(range(base + cursor, base + cursor + P))
                input_ids[r, cursor : cursor + P] = torch.tensor(prompt)
                position_ids[r, cursor : cursor + P] = torch.arange(P)
                segment_ids[r, cursor : cursor + P] = segment
                visible_prompt[r, cursor : cursor + P] = segment
                prompt_segment = segment
                prompt_segments.append((prompt_tokens, prompt_tokens))
                varlen.append((prompt_tokens, prompt_tokens))
                segment += 1
                cursor += P
                last_prompt_position = prompt_tokens[-1]
                for completion in cs:
                    inputs = completion[:-1]
                    n = len(inputs)
                    own = list(range(base + cursor, base + cursor + n))
                    if n:
                        input_ids[r, cursor : cursor + n] = torch.tensor(inputs)
                        position_ids[r, cursor : cursor + n] = torch.arange(P, P + n)
                        segment_ids[r, cursor : cursor + n] = segment
                        visible_prompt[r, cursor : cursor + n] = prompt_segment
                        completion_segments.append((own, prompt_tokens + own))
                        varlen.append((own, prompt_tokens + own))
                        segment += 1
                    positions = [last_prompt_position, *own]
                    label_positions.extend(positions)
                    label_targets.extend(completion)
                    label_slots.extend(sample * width + t for t in range(len(completion)))
                    cursor += n
                    sample += 1

    completion_mask = torch.zeros((len(completions), width), dtype=torch.bool)
    for i, c in enumerate(completions):
        completion_mask[i, : len(c)] = True
    tokens_computed = int((segment_ids >= 0).sum())
    labels = dict(
        label_positions=torch.tensor(label_positions, dtype=torch.long),
        label_targets=torch.tensor(label_targets, dtype=torch.long),
        label_slots=torch.tensor(label_slots, dtype=torch.long),
        completion_mask=completion_mask,
        tokens_computed=tokens_computed,
    )
    if not shared_prompt:
        return PackedTokens(input_ids=input_ids, position_ids=None, attention=None, **labels)

    query_index = torch.tensor([t for q, _ in varlen for t in q], dtype=torch.long)
    key_index = torch.tensor([t for _, k in varlen for t in k], dtype=torch.long)
    cu_q = torch.tensor([0] + [len(q) for q, _ in varlen], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + [len(k) for _, k in varlen], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    buckets = [_reference_bucket(prompt_segments)]
    if completion_segments:
        buckets.append(_reference_bucket(completion_segments))
    attention = SharedPromptLayout(
        segment_ids=segment_ids,
        positions=position_ids,
        visible_prompt=visible_prompt,
        query_index=query_index,
        key_index=key_index,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max(len(q) for q, _ in varlen),
        max_seqlen_k=max(len(k) for _, k in varlen),
        buckets=buckets,
    )
    return PackedTokens(input_ids=input_ids, position_ids=position_ids, attention=attention, **labels)


@torch.inference_mode()
def reference_sample_groups(
    model: PreTrainedModel,
    requests: list[GroupRequest],
    sampling: SamplingParams,
    eos_id: int,
    pad_id: int,
) -> Iterator[SampledGroup]:
    """Yield each request's completions as soon as all of its samples have stopped."""
    if not requests:
        return
    group_size = requests[0].group_size
    if any(r.group_size != group_size for r in requests):
        raise ValueError("sample_groups needs one group size per call")
    device = next(model.parameters()).device
    stops = torch.tensor(sorted({eos_id, *sampling.stop_token_ids}), device=device)

    # prefill each prompt once (left-padded), then repeat its cache for the G samples
    width = max(len(r.prompt_tokens) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(requests), width), dtype=torch.long, device=device)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_tokens) :] = torch.tensor(r.prompt_tokens, device=device)
        attention[i, width - len(r.prompt_tokens) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_kwargs = {_cache_keyword(model): cache, "use_cache": True}
    logits = model(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=1, **cache_kwargs
    ).logits[:, -1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    attention = attention.repeat_interleave(group_size, 0)
    next_position = positions[:, -1:].repeat_interleave(group_size, 0) + 1

    rows = [(i, s) for i in range(len(requests)) for s in range(group_size)]  # (request, sample) of each batch row
    generators = []
    for i, s in rows:
        generator = torch.Generator(device=device)
        generator.manual_seed(requests[i].seeds[s])
        generators.append(generator)
    tokens = [[[] for _ in range(group_size)] for _ in requests]
    logprobs = [[[] for _ in range(group_size)] for _ in requests]
    stopped = [[False] * group_size for _ in requests]
    pending = [group_size] * len(requests)  # samples still running, per request

    for step in range(sampling.max_new_tokens):
        scaled = logits.float() / sampling.temperature
        token_logprobs = scaled.log_softmax(-1)
        uniform = torch.stack([torch.rand(scaled.shape[-1], generator=g, device=device) for g in generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        choice = (filter_logits(scaled, sampling.top_k, sampling.top_p) + gumbel).argmax(-1)
        chosen_logprob = token_logprobs.gather(-1, choice[:, None])[:, 0].tolist()
        is_stop = torch.isin(choice, stops).tolist()
        finished_requests = []
        for (i, s), token, lp, stop in zip(rows, choice.tolist(), chosen_logprob, is_stop):
            if stopped[i][s]:
                continue
            tokens[i][s].append(token)
            logprobs[i][s].append(lp)
            if stop or step == sampling.max_new_tokens - 1:
                stopped[i][s] = True
                pending[i] -= 1
                if pending[i] == 0:
                    finished_requests.append(i)
        for i in finished_requests:
            reasons = ["stop" if seq[-1] in stops.tolist() else "length" for seq in tokens[i]]
            yield SampledGroup(requests[i], tokens[i], logprobs[i], reasons)
        if step == sampling.max_new_tokens - 1 or all(p == 0 for p in pending):
            break
        if finished_requests:  # drop finished groups' rows from the batch and the cache
            keep = [row for row, (i, _) in enumerate(rows) if pending[i] > 0]
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            rows = [rows[k] for k in keep]
            generators = [generators[k] for k in keep]
            choice, attention, next_position = choice[index], attention[index], next_position[index]
        attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
        logits = model(
            input_ids=choice[:, None], attention_mask=attention, position_ids=next_position, **cache_kwargs
        ).logits[:, -1]
        next_position = next_position + 1


def reference_rollout_logprobs(ordered: list[Trajectory], shape) -> torch.Tensor:
    rollout_logprobs = torch.zeros(shape, dtype=torch.float32)
    for i, t in enumerate(ordered):
        rollout_logprobs[i, : len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    return rollout_logprobs


# ------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------
def assert_identical(new, ref, path: str = "packed") -> None:
    """Same structure; every tensor with the same dtype, shape, strides and values (bit for bit)."""
    if isinstance(ref, torch.Tensor):
        assert isinstance(new, torch.Tensor), path
        assert new.dtype == ref.dtype, (path, new.dtype, ref.dtype)
        assert new.shape == ref.shape, (path, new.shape, ref.shape)
        assert new.stride() == ref.stride(), (path, new.stride(), ref.stride())
        assert torch.equal(new, ref), (path, new, ref)
    elif dataclasses.is_dataclass(ref):
        assert type(new) is type(ref), path
        for f in dataclasses.fields(ref):
            assert_identical(getattr(new, f.name), getattr(ref, f.name), f"{path}.{f.name}")
    elif isinstance(ref, list):
        assert isinstance(new, list) and len(new) == len(ref), path
        for k, (a, b) in enumerate(zip(new, ref)):
            assert_identical(a, b, f"{path}[{k}]")
    else:
        assert type(new) is type(ref) and new == ref, (path, new, ref)


def random_groups(
    rng: random.Random,
    n_groups: int,
    prompt_len: tuple[int, int],
    group_size: tuple[int, int],
    completion_len: tuple[int, int],
):
    groups = []
    for _ in range(n_groups):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(*prompt_len))]
        sizes = [rng.choice([1, rng.randint(*completion_len)]) for _ in range(rng.randint(*group_size))]
        groups.append((prompt, [[rng.randrange(1, 50) for _ in range(n)] for n in sizes]))
    if n_groups > 1 and rng.random() < 0.3:  # part of a group elsewhere in the micro-batch (same prompt)
        prompt = groups[0][0]
        groups.append((prompt, [[rng.randrange(1, 50) for _ in range(rng.randint(*completion_len))]]))
    return groups


# ------------------------------------------------------------------------------------------------------
# packing
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shared_prompt", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_pack_identical_on_random_ragged_groups(seed, shared_prompt):
    rng = random.Random(seed)
    groups = random_groups(rng, rng.randint(1, 6), (1, 20), (1, 8), (1, 9))
    for max_row_tokens in (None, rng.randint(1, 20), rng.randint(20, 80)):  # tiny limits: one group per row
        new = pack(groups, 0, shared_prompt=shared_prompt, max_row_tokens=max_row_tokens)
        ref = reference_pack(groups, 0, shared_prompt=shared_prompt, max_row_tokens=max_row_tokens)
        assert_identical(new, ref)


@pytest.mark.parametrize("shared_prompt", [True, False])
@pytest.mark.parametrize(
    "case",
    [
        "default",  # the default job: 8 groups x 8, prompts 6-10, completions 1-6
        "long_prompt",  # prompts ~200 tokens
        "one_token",  # only one-token completions: no completion segment at all
        "single",  # one group, one completion
        "tuples",  # prompts and completions as tuples
    ],
)
def test_pack_identical_on_shaped_cases(case, shared_prompt):
    rng = random.Random(case)
    if case == "default":
        groups = random_groups(rng, 8, (6, 10), (8, 8), (1, 6))
    elif case == "long_prompt":
        groups = random_groups(rng, 8, (190, 210), (8, 8), (1, 6))
    elif case == "one_token":
        groups = [([5, 6, 7], [[3], [4]]), ([9], [[1]]), ([2, 2], [[8], [8], [9]])]
    elif case == "single":
        groups = [([4, 5], [[6, 7, 8]])]
    else:
        groups = [(tuple(p), [tuple(c) for c in cs]) for p, cs in random_groups(rng, 3, (1, 9), (1, 4), (1, 5))]
    for max_row_tokens in (None, 12, 64, 512):
        new = pack(groups, 3, shared_prompt=shared_prompt, max_row_tokens=max_row_tokens)
        ref = reference_pack(groups, 3, shared_prompt=shared_prompt, max_row_tokens=max_row_tokens)
        assert_identical(new, ref)


def test_pack_identical_windowed_bucket_masks():
    """The sliding-window masks the sdpa/npu backends derive from the buckets."""
    rng = random.Random(7)
    groups = random_groups(rng, 5, (1, 30), (1, 8), (1, 12))
    new = pack(groups, 0, shared_prompt=True, max_row_tokens=40).attention
    ref = reference_pack(groups, 0, shared_prompt=True, max_row_tokens=40).attention
    for window in (1, 2, 5, 17, 64):
        for a, b in zip(new.buckets, ref.buckets):
            assert_identical(a.windowed(window), b.windowed(window), f"windowed({window})")


def test_pack_errors_unchanged():
    with pytest.raises(ValueError, match="at least one token"):
        pack([([1, 2], [[3], []])], 0, shared_prompt=True)
    with pytest.raises(ValueError, match="every prompt needs"):
        pack([([5], [[3]]), ([], [[1, 2]])], 0, shared_prompt=False)


# ------------------------------------------------------------------------------------------------------
# collate
# ------------------------------------------------------------------------------------------------------
def random_trajectories(
    rng: random.Random, n_prompts: int, group_size: int, prompt_len: tuple[int, int]
) -> list[Trajectory]:
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(*prompt_len))]
        for s in range(group_size):
            completion = [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
            out.append(
                Trajectory(
                    prompt_id=100 + p,
                    sample_index=s,
                    version=2,
                    prompt_tokens=list(prompt),
                    completion_tokens=completion,
                    rollout_logprobs=[-rng.expovariate(0.7) for _ in completion],
                    reward=rng.random(),
                    advantage=rng.gauss(0, 1),
                    truncated=rng.random() < 0.2,
                    shaped_reward=rng.random(),
                    correct=rng.random() < 0.5,
                    zero_variance=rng.random() < 0.1,
                )
            )
    rng.shuffle(out)  # arrival order: collate groups siblings together
    return out


@pytest.mark.parametrize("packing", ["auto", "shared_prompt", "padded"])
@pytest.mark.parametrize("seed", range(6))
def test_collate_rollout_logprobs_identical(seed, packing):
    rng = random.Random(seed)
    trajectories = random_trajectories(rng, rng.randint(1, 8), rng.randint(1, 8), (1, 12) if seed % 2 else (150, 220))
    max_row_tokens = rng.choice([None, 64])
    batch = collate(trajectories, 0, 0, packing=packing, max_row_tokens=max_row_tokens)
    by_prompt: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_id, []).append(t)
    ordered = [t for group in by_prompt.values() for t in group]
    assert_identical(
        batch.rollout_logprobs, reference_rollout_logprobs(ordered, batch.completion_mask.shape), "rollout_logprobs"
    )
    groups = [(g[0].prompt_tokens, [t.completion_tokens for t in g]) for g in by_prompt.values()]
    assert_identical(
        batch.tokens, reference_pack(groups, 0, batch.tokens.attention is not None, max_row_tokens), "tokens"
    )


def test_collate_rollout_logprobs_fallback_for_short_logprob_lists():
    """A trajectory with fewer log-probs than tokens keeps the old row-by-row fill (zeros after them)."""
    rng = random.Random(3)
    trajectories = random_trajectories(rng, 2, 3, (2, 5))
    trajectories[1].completion_tokens = trajectories[1].completion_tokens + [7, 7]
    batch = collate(trajectories, 0, 0, packing="padded")
    by_prompt: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_id, []).append(t)
    ordered = [t for group in by_prompt.values() for t in group]
    assert_identical(
        batch.rollout_logprobs, reference_rollout_logprobs(ordered, batch.completion_mask.shape), "rollout_logprobs"
    )


# ------------------------------------------------------------------------------------------------------
# sampling
# ------------------------------------------------------------------------------------------------------
@functools.cache
def sampling_model():
    model, tokenizer = tiny_qwen2(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2, seed=1)
    return model.eval(), tokenizer


def requests_for(rng: random.Random, n: int, group_size: int, vocab: int) -> list[GroupRequest]:
    return [
        GroupRequest(
            prompt_id=pid,
            prompt_tokens=tuple(rng.randrange(4, vocab) for _ in range(rng.randint(1, 9))),
            version=0,
            seeds=tuple(sample_seed(rng.randrange(1000), 0, pid, s) for s in range(group_size)),
        )
        for pid in range(n)
    ]


def as_records(groups):
    return [(g.request.prompt_id, g.completions, g.logprobs, g.finish_reasons) for g in groups]


@pytest.mark.parametrize(
    "params, group_size, noise_block",
    [
        (SamplingParams(max_new_tokens=6), 8, None),
        (SamplingParams(max_new_tokens=9, temperature=0.7, top_k=5), 3, None),
        (SamplingParams(max_new_tokens=7, top_p=0.8), 4, 2),  # noise drawn two steps at a time, over 4 blocks
        (SamplingParams(max_new_tokens=5, stop_token_ids=(7, 9, 11)), 2, 1),  # many stops: groups finish early
        (SamplingParams(max_new_tokens=1), 5, None),
        (SamplingParams(max_new_tokens=12, temperature=1.3), 1, 3),
        (SamplingParams(max_new_tokens=20, top_k=3), 2, None),  # blocks of 8 then 12 steps
        (SamplingParams(max_new_tokens=30, temperature=0.5), 3, 5),  # blocks capped at 5 steps
    ],
)
def test_sample_groups_identical(params, group_size, noise_block, monkeypatch):
    model, tokenizer = sampling_model()
    vocab = model.config.vocab_size
    if noise_block is not None:
        monkeypatch.setattr(sampling_module, "_NOISE_BLOCK_ELEMENTS", noise_block * vocab)
    rng = random.Random(params.max_new_tokens * 31 + group_size)
    for n_requests in (1, 6):
        requests = requests_for(rng, n_requests, group_size, vocab)
        new = as_records(sample_groups(model, requests, params, tokenizer.eos_token_id, tokenizer.pad_token_id))
        ref = as_records(
            reference_sample_groups(model, requests, params, tokenizer.eos_token_id, tokenizer.pad_token_id)
        )
        assert new == ref
        assert sorted(r[0] for r in new) == list(range(n_requests))


@pytest.mark.parametrize("vocab", [1, 53, 1000, 151936])
def test_cpu_generator_block_draw_equals_step_draws(vocab):
    """What the blocked Gumbel noise relies on: a CPU generator's (k, V) draw is its k draws of V in order."""
    steps = 4 if vocab < 100_000 else 2
    one, block = torch.Generator(), torch.Generator()
    one.manual_seed(vocab)
    block.manual_seed(vocab)
    assert torch.equal(
        torch.stack([torch.rand(vocab, generator=one) for _ in range(steps)]),
        torch.rand((steps, vocab), generator=block),
    )
    assert torch.equal(torch.rand(vocab, generator=one), torch.rand(vocab, generator=block))
