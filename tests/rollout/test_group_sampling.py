"""The hf sampler's groups: per-sample seeds, log-probs equal to a full forward, independence from the batch,
stopping, and the empirical distribution of draws; each against an independent reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from helpers.sampling_references import completion_logprobs_reference
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sampling import filter_logits, sample_groups


@pytest.fixture(scope="module")
def peaked_model(model):
    """The tiny model with logits 2x larger: a far-from-uniform next-token distribution, so that
    sampling from the wrong distribution (wrong temperature, wrong filter) is visible in a histogram."""
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.model.norm.weight.mul_(2.0)
    return peaked


def _ids(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text).input_ids)


@torch.no_grad()
def _next_token_probs(model, prompt, temperature):
    logits = model(input_ids=torch.tensor([list(prompt)]), use_cache=False).logits[0, -1].double()
    return torch.softmax(logits / temperature, dim=-1)


def _sample(model, tok, requests, sampling):
    groups = list(sample_groups(model, requests, sampling, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id))
    by_id = {g.request.prompt_id: g for g in groups}
    assert len(by_id) == len(groups) == len(requests), "every request must be answered exactly once"
    return by_id


def _seeds(prompt_id: int, group_size: int, base: int = 0, version: int = 0) -> tuple[int, ...]:
    return tuple(sample_seed(base, version, prompt_id, s) for s in range(group_size))


def test_sample_seed_distinct_and_in_range():
    seeds = [
        sample_seed(0, version, prompt, sample) for version in range(3) for prompt in range(64) for sample in range(16)
    ]
    assert len(set(seeds)) == len(seeds) == 3 * 64 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    # another run seed gives other seeds
    other = {sample_seed(1, 0, prompt, sample) for prompt in range(64) for sample in range(16)}
    assert not other & set(seeds)
    # deterministic
    assert sample_seed(5, 2, 11, 3) == sample_seed(5, 2, 11, 3)
    # no accidental collision from string concatenation ("1/23" vs "12/3")
    assert sample_seed(0, 1, 23, 4) != sample_seed(0, 12, 3, 4)


PROMPTS = ["5=", "3917=", "12=", "804213=", "77="]  # different lengths: left padding in one call


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=5, temperature=1.0),
        SamplingParams(max_new_tokens=5, temperature=0.6),
        SamplingParams(max_new_tokens=4, temperature=1.7),
        # the sampler's log-probs are those of the unfiltered softmax(logits / T), which is what the
        # trainer recomputes: filtering must not change them, or the on-policy ratio would not be 1
        SamplingParams(max_new_tokens=4, temperature=0.8, top_k=5, top_p=0.9),
    ],
    ids=["T1", "T0.6", "T1.7", "T0.8-topk-topp"],
)
def test_sample_groups_logprobs_match_full_forward(model, tok, sampling):
    requests = [
        GroupRequest(prompt_id=i, prompt_tokens=_ids(tok, p), version=0, seeds=_seeds(i, 3))
        for i, p in enumerate(PROMPTS)
    ]
    groups = _sample(model, tok, requests, sampling)
    checked = 0
    for request in requests:
        group = groups[request.prompt_id]
        assert group.request == request
        assert len(group.completions) == len(group.logprobs) == len(group.finish_reasons) == 3
        for completion, logprobs in zip(group.completions, group.logprobs):
            assert len(completion) == len(logprobs) >= 1
            expected = completion_logprobs_reference(model, request.prompt_tokens, completion, sampling.temperature)
            torch.testing.assert_close(
                torch.tensor(logprobs, dtype=torch.float64),
                torch.tensor(expected, dtype=torch.float64),
                atol=1e-5,
                rtol=0,
            )
            checked += len(completion)
    assert checked >= len(PROMPTS) * 3  # something was really compared


def test_sample_groups_independent_of_batch_composition(model, tok):
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    target = GroupRequest(prompt_id=0, prompt_tokens=_ids(tok, "3917="), version=0, seeds=_seeds(0, 4))
    alone = _sample(model, tok, [target], sampling)[0]

    others = [
        GroupRequest(prompt_id=1, prompt_tokens=_ids(tok, "804213="), version=0, seeds=_seeds(1, 4)),
        GroupRequest(prompt_id=2, prompt_tokens=_ids(tok, "5="), version=0, seeds=_seeds(2, 4)),
        # the same prompt and seeds under another id: must give the very same completions
        GroupRequest(prompt_id=3, prompt_tokens=target.prompt_tokens, version=0, seeds=target.seeds),
    ]
    batched = _sample(model, tok, [others[0], target, others[1], others[2]], sampling)
    reordered = _sample(model, tok, [others[2], others[1], target], sampling)
    for together in (batched[0], batched[3], reordered[0], reordered[3]):
        assert together.completions == alone.completions
        assert together.finish_reasons == alone.finish_reasons
        for a, b in zip(together.logprobs, alone.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0)

    # other seeds give other completions (for at least some samples)
    reseeded = GroupRequest(prompt_id=0, prompt_tokens=target.prompt_tokens, version=0, seeds=_seeds(0, 4, base=1))
    different = _sample(model, tok, [reseeded], sampling)[0]
    assert sum(a != b for a, b in zip(different.completions, alone.completions)) >= 1


def test_sample_groups_samples_of_a_group_differ(model, tok):
    group_size = 8
    request = GroupRequest(prompt_id=0, prompt_tokens=_ids(tok, "3917="), version=0, seeds=_seeds(0, group_size))
    group = _sample(model, tok, [request], SamplingParams(max_new_tokens=6, temperature=1.0))[0]
    distinct = {tuple(c) for c in group.completions}
    # a near-uniform random model over 53 tokens: collisions of 6-token strings are very unlikely
    assert len(distinct) > group_size // 2


@pytest.mark.parametrize("extra_stops", [(), "digits"])
def test_sample_groups_stopping(model, tok, extra_stops):
    eos = tok.eos_token_id
    stop_ids = tuple(_ids(tok, "0123456789")) if extra_stops == "digits" else ()
    stops = {eos, *stop_ids}
    max_new = 6
    sampling = SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=stop_ids)
    requests = [
        GroupRequest(prompt_id=i, prompt_tokens=_ids(tok, p), version=0, seeds=_seeds(i, 16))
        for i, p in enumerate(["5=", "3917=", "12=", "804213="] * 4)
    ]
    groups = _sample(model, tok, requests, sampling)
    reasons_seen = set()
    for group in groups.values():
        for completion, reason in zip(group.completions, group.finish_reasons):
            assert 1 <= len(completion) <= max_new
            assert not stops & set(completion[:-1]), "tokens continued after a stop token"
            if completion[-1] in stops:
                assert reason == "stop"
            else:
                assert reason == "length"
                assert len(completion) == max_new
            reasons_seen.add(reason)
    # 256 samples: both ways of ending occur (with digits as stops almost every sample stops early)
    assert reasons_seen == {"stop", "length"}


def _empirical(model, tok, prompt, sampling, n, requests=10):
    per = n // requests
    reqs = [
        GroupRequest(prompt_id=i, prompt_tokens=prompt, version=0, seeds=_seeds(i, per, base=99))
        for i in range(requests)
    ]
    counts = torch.zeros(len(tok), dtype=torch.float64)
    for group in _sample(model, tok, reqs, sampling).values():
        for completion in group.completions:
            assert len(completion) == 1
            counts[completion[0]] += 1
    return counts / counts.sum()


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most probable tokens whose mass reaches top_p (naive loop)."""
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += float(probs[i])
        if mass >= top_p:
            break
    return kept


def test_sample_groups_empirical_distribution(peaked_model, tok):
    prompt = _ids(tok, "3917=")
    n = 16000  # expected total variation of the histogram itself: ~0.02
    temperature = 0.7
    probs = _next_token_probs(peaked_model, prompt, temperature)
    # the test distinguishes the temperature: softmax(logits) is far from softmax(logits / 0.7)
    assert 0.5 * (probs - _next_token_probs(peaked_model, prompt, 1.0)).abs().sum() > 0.1

    freq = _empirical(peaked_model, tok, prompt, SamplingParams(max_new_tokens=1, temperature=temperature), n)
    assert 0.5 * (freq - probs).abs().sum() < 0.05

    # top-k: never a token outside the k most probable, and the renormalised top-k distribution
    top3 = set(torch.topk(probs, 3).indices.tolist())
    freq = _empirical(peaked_model, tok, prompt, SamplingParams(max_new_tokens=1, temperature=temperature, top_k=3), n)
    assert set(freq.nonzero().flatten().tolist()) <= top3
    expected = torch.zeros_like(probs)
    expected[list(top3)] = probs[list(top3)] / probs[list(top3)].sum()
    assert 0.5 * (freq - expected).abs().sum() < 0.05

    # top-p: never a token outside the nucleus, and the renormalised nucleus distribution
    top_p = 0.5
    nucleus = _nucleus(probs, top_p)
    inside = sorted(float(probs[i]) for i in nucleus)
    assert sum(inside) - inside[0] < top_p - 1e-3 < top_p + 1e-3 < sum(inside)  # not on a rounding edge
    assert 1 < len(nucleus) < len(probs) // 2  # a non-trivial nucleus
    freq = _empirical(
        peaked_model, tok, prompt, SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p), n
    )
    assert set(freq.nonzero().flatten().tolist()) <= nucleus
    expected = torch.zeros_like(probs)
    expected[list(nucleus)] = probs[list(nucleus)] / probs[list(nucleus)].sum()
    assert 0.5 * (freq - expected).abs().sum() < 0.05


def _naive_filter_keep(row: list[float], top_k: int, top_p: float) -> list[bool] | None:
    """Which logits survive top-k then top-p (None when a cumulative mass sits on the top_p boundary)."""
    v = len(row)
    keep = [True] * v
    if 0 < top_k < v:
        kth = sorted(row, reverse=True)[top_k - 1]
        keep = [x >= kth for x in row]
    if top_p < 1.0:
        alive = [i for i in range(v) if keep[i]]
        m = max(row[i] for i in alive)
        z = sum(math.exp(row[i] - m) for i in alive)
        kept, mass = set(), 0.0
        for i in sorted(alive, key=lambda i: -row[i]):
            kept.add(i)
            mass += math.exp(row[i] - m) / z
            if abs(mass - top_p) < 1e-5:
                return None
            if mass >= top_p:
                break
        keep = [i in kept for i in range(v)]
    return keep


@pytest.mark.parametrize(
    "top_k, top_p",
    [(0, 1.0), (1, 1.0), (3, 1.0), (17, 1.0), (100, 1.0), (0, 0.5), (0, 0.9), (0, 1e-4), (5, 0.7), (10, 0.95)],
)
def test_filter_logits_matches_naive(top_k, top_p):
    generator = torch.Generator().manual_seed(1234 + top_k)
    logits = torch.randn(32, 40, generator=generator) * 2.0
    filtered = filter_logits(logits, top_k, top_p)
    assert filtered.shape == logits.shape
    compared = 0
    for row, out in zip(logits.tolist(), filtered):
        keep = _naive_filter_keep(row, top_k, top_p)
        if keep is None:
            continue
        keep_t = torch.tensor(keep)
        assert torch.equal(torch.isfinite(out), keep_t)
        assert torch.equal(out[keep_t], torch.tensor(row)[keep_t])  # survivors are unchanged
        assert torch.all(out[~keep_t] == float("-inf"))
        assert keep_t.sum() >= 1
        compared += 1
    assert compared >= 30


def test_sampling_params_validation():
    for kwargs in (
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"stop": [""]},
        {"top_k": -1},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(stop="</a>").stop == ("</a>",)
