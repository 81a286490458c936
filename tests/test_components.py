"""Component tests: each unit checked against an independent reference (hand-derived values or a naive
re-implementation), never against numbers copied from running the code under test."""

from __future__ import annotations

import copy
import csv
import json
import math
import statistics

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_parl import GRPOModule, GRPOObjective, IterationShape, tiny_qwen2
from lit_parl.kernels import token_logprobs
from lit_parl.trainer.grpo_objective import LOSS_AGGREGATIONS
from lit_parl.rollout.sampling import filter_logits, sample_groups
from lit_parl.tasks import CopyTask, ReverseTask, positional_reward
from lit_parl.models.char_tokenizer import CHARACTERS, SPECIAL_TOKENS, build_char_tokenizer
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.data.micro_batch import Trajectory, collate

SHAPE = IterationShape(prompts=1, group_size=4, micro_batch_size=4)


# ------------------------------------------------------------------------------------------------------
# shared fixtures
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model():
    policy, _ = tiny_qwen2(seed=0)
    return policy.eval()


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
def _reference_logprobs(model, prompt, completion, temperature):
    """Log-probs of ``completion`` after ``prompt``: one unpadded, uncached forward of the whole sequence."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids, use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt) - 1  # position len(prompt)-1 predicts completion[0]
    return [float(logp[start + j, token]) for j, token in enumerate(completion)]


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


# ------------------------------------------------------------------------------------------------------
# 1. tokenizer
# ------------------------------------------------------------------------------------------------------
def test_tokenizer_one_id_per_character_and_round_trip(tok):
    vocab = [*SPECIAL_TOKENS, *CHARACTERS]
    for text in ["0", "7", "3917=", "0123456789", "00000=", "98765432109876543210="]:
        ids = tok(text).input_ids
        assert ids == [vocab.index(c) for c in text]  # no specials added, one id per character
        assert tok.decode(ids) == text
    assert tok.pad_token_id == vocab.index("<pad>")
    assert tok.eos_token_id == vocab.index("<eos>")
    assert tok.pad_token_id != tok.eos_token_id
    assert len(tok) == len(vocab)
    # the end token survives in ids but is dropped by skip_special_tokens decoding
    assert tok.decode([*tok("12").input_ids, tok.eos_token_id], skip_special_tokens=True) == "12"


def test_tokenizer_rejects_duplicate_characters():
    with pytest.raises(ValueError):
        build_char_tokenizer("0123456789=0")


def test_tokenizer_save_pretrained_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    texts = ["3917=", "0123456789", "42=24", "5"]
    for text in texts:
        assert loaded(text).input_ids == tok(text).input_ids
        assert loaded.decode(tok(text).input_ids) == text
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (
        tok.pad_token_id,
        tok.eos_token_id,
        tok.unk_token_id,
    )
    assert loaded.pad_token_id != loaded.eos_token_id
    assert len(loaded) == len(tok)


# ------------------------------------------------------------------------------------------------------
# 2. reward and tasks
# ------------------------------------------------------------------------------------------------------
EOS = 1


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ([5, 6], [5, 6, EOS], 1.0),  # exact answer then the end token
        ([5, 6], [5, 6], 2 / 3),  # truncated: 2 matches of target [5, 6, eos]
        ([5, 6], [5, 6, 7], 2 / 3),  # cut at the limit with an extra token, no eos: 2 of max(3, 3)
        ([5, 6], [5, 6, 7, EOS], 2 / 4),  # one extra token before eos: output longer than target
        ([5, 6], [5, 6, 7, 8, 9, 9], 2 / 6),  # runaway completion without eos
        ([5, 6], [5, 6, EOS, 9, 9, 9], 1.0),  # tokens after the end token are ignored
        ([5, 6], [5, 6, EOS, EOS], 1.0),  # only the first end token counts
        ([5, 6], [5, 7, EOS, 6, 6], 2 / 3),  # truncated at the first eos, then scored
        ([5, 6], [], 0.0),  # empty completion
        ([5, 6], [EOS], 0.0),  # stopping at once: eos is at the wrong position
        ([5, 6], [5], 1 / 3),  # one correct token, no eos
        ([5, 6], [9], 0.0),  # one wrong token
        ([5, 6], [5, 9, EOS], 2 / 3),  # wrong digit: partial credit
        ([5, 6], [9, 6, EOS], 2 / 3),
        ([5, 6], [6, 5, EOS], 1 / 3),  # swapped digits: only the eos slot matches
        ([5, 6, 7, 8], [5, 6, EOS], 2 / 5),  # stopped early: 2 matches of target length 5
        ([5, 6, 7, 8], [5, 0, 7, 0, EOS], 3 / 5),
        ([], [EOS], 1.0),  # empty answer: the end token alone is right
        ([], [3, EOS], 0.0),
    ],
)
def test_positional_reward_hand_computed(answer, completion, expected):
    assert positional_reward(answer, completion, EOS) == pytest.approx(expected, abs=1e-12)


def test_positional_reward_never_one_without_eos():
    for completion in ([5, 6], [5, 6, 5, 6], [5, 6, 0, 0, 0, 0]):
        assert positional_reward([5, 6], completion, EOS) < 1.0


def test_task_reward_uses_positional_reward(tok):
    task = ReverseTask(seed=3)
    prompt, answer = task.make(0)
    answer_ids = list(_ids(tok, answer))
    assert task.reward(answer_ids, [*answer_ids, tok.eos_token_id], tok.eos_token_id) == 1.0
    assert task.reward(answer_ids, answer_ids, tok.eos_token_id) < 1.0


@pytest.mark.parametrize("task_cls, transform", [(CopyTask, lambda d: d), (ReverseTask, lambda d: d[::-1])])
def test_digit_tasks_deterministic_and_well_formed(task_cls, transform):
    task = task_cls(min_digits=2, max_digits=5, seed=7)
    again = task_cls(min_digits=2, max_digits=5, seed=7)
    other = task_cls(min_digits=2, max_digits=5, seed=8)
    lengths = set()
    for i in range(200):
        prompt, answer = task.make(i)
        assert (prompt, answer) == again.make(i) == task.make(i)  # same seed and index: same prompt
        assert prompt.endswith("=")
        digits = prompt[:-1]
        assert digits.isdigit() and set(digits) <= set("0123456789")
        assert 2 <= len(digits) <= 5
        assert answer == transform(digits)
        lengths.add(len(digits))
    assert lengths == {2, 3, 4, 5}, "every length in [min, max] should occur in 200 prompts"
    assert sum(task.make(i) != other.make(i) for i in range(50)) > 25, "another seed must give other prompts"
    assert len({task.make(i) for i in range(200)}) > 100, "prompts of different indices must differ"
    assert task.max_answer_tokens() == 5


def test_digit_task_single_length():
    task = CopyTask(min_digits=3, max_digits=3, seed=0)
    assert all(len(task.make(i)[1]) == 3 for i in range(20))


@pytest.mark.parametrize("task_cls", [CopyTask, ReverseTask])
@pytest.mark.parametrize("min_digits, max_digits", [(0, 3), (-1, 2), (5, 4), (0, 0)])
def test_digit_task_invalid_lengths_raise(task_cls, min_digits, max_digits):
    with pytest.raises(ValueError):
        task_cls(min_digits=min_digits, max_digits=max_digits)


# ------------------------------------------------------------------------------------------------------
# 3. per-sample seeds
# ------------------------------------------------------------------------------------------------------
def test_sample_seed_distinct_and_in_range():
    seeds = [sample_seed(0, version, prompt, sample) for version in range(3) for prompt in range(64) for sample in range(16)]
    assert len(set(seeds)) == len(seeds) == 3 * 64 * 16
    assert all(0 <= s < 2**63 for s in seeds)
    # another run seed gives other seeds
    other = {sample_seed(1, 0, prompt, sample) for prompt in range(64) for sample in range(16)}
    assert not other & set(seeds)
    # deterministic
    assert sample_seed(5, 2, 11, 3) == sample_seed(5, 2, 11, 3)
    # no accidental collision from string concatenation ("1/23" vs "12/3")
    assert sample_seed(0, 1, 23, 4) != sample_seed(0, 12, 3, 4)


# ------------------------------------------------------------------------------------------------------
# 4. group sampling
# ------------------------------------------------------------------------------------------------------
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
            expected = _reference_logprobs(model, request.prompt_tokens, completion, sampling.temperature)
            torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)
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
    freq = _empirical(peaked_model, tok, prompt, SamplingParams(max_new_tokens=1, temperature=temperature, top_p=top_p), n)
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


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (1, 1.0), (3, 1.0), (17, 1.0), (100, 1.0), (0, 0.5), (0, 0.9), (0, 1e-4), (5, 0.7), (10, 0.95)])
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
    for kwargs in ({"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"stop": [""]}, {"top_k": -1}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(stop="</a>").stop == ("</a>",)


# ------------------------------------------------------------------------------------------------------
# 5. GRPO objective
# ------------------------------------------------------------------------------------------------------
def test_advantages_standardised_within_group():
    rewards = [1.0, 0.0, 0.5, 0.25, 0.75, 0.0]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)  # sample std, as torch.std
    advantages = GRPOObjective(eps=1e-6).advantages(torch.tensor(rewards, dtype=torch.float64))
    expected = [(r - mean) / (std + 1e-6) for r in rewards]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64))
    assert abs(float(advantages.mean())) < 1e-9
    assert float(advantages.std()) == pytest.approx(std / (std + 1e-6), abs=1e-9)

    centred = GRPOObjective(scale_rewards=False).advantages(torch.tensor(rewards, dtype=torch.float64))
    torch.testing.assert_close(centred, torch.tensor([r - mean for r in rewards], dtype=torch.float64))


REWARD_VALUES = [0.0, 1.0, 0.5, 1 / 3, 2 / 3, 0.2, 0.4, 0.6, 0.8, 0.25, 0.75]  # values positional_reward produces


@pytest.mark.parametrize("scale_rewards", [True, False])
def test_advantages_all_equal_rewards_exactly_zero(scale_rewards):
    """A group where every sample got the same reward carries no signal: its advantages must be 0.

    Rewards are float32, as the datamodule builds them. With scaling, a rounding residue of the mean
    (~1e-8) divided by (std + eps) with std ~1e-8 would become an advantage of several percent."""
    objective = GRPOObjective(scale_rewards=scale_rewards)
    wrong = {}
    for value in REWARD_VALUES:
        for group_size in (2, 4, 7, 8, 16):
            advantages = objective.advantages(torch.full((group_size,), value, dtype=torch.float32))
            worst = float(advantages.abs().max())
            if (scale_rewards and worst != 0.0) or worst > 1e-6:
                wrong[(round(value, 4), group_size)] = worst
    assert not wrong, f"all-equal rewards (value, group size) -> max |advantage|: {wrong}"


def _hand_batch():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    advantages = torch.tensor([0.5, -1.0, 2.0])
    logp = (-torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) * 3).requires_grad_(True)
    return logp, advantages, mask


def test_objective_on_policy_seq_mean_token_mean():
    logp, advantages, mask = _hand_batch()
    lengths = [3, 2, 4]
    terms = GRPOObjective(clip_eps=0.2, loss_aggregation="seq-mean-token-mean")(logp, logp.detach(), None, advantages, mask)
    # ratio = 1: every token's loss is -A; per sequence mean -A; summed over sequences
    assert float(terms.loss_sum.detach()) == pytest.approx(-(0.5 - 1.0 + 2.0), abs=1e-6)
    assert float(terms.normaliser) == 3.0  # sequences
    assert float(terms.stats["tokens"]) == 9.0
    assert float(terms.stats["clipped_tokens"]) == 0.0
    (terms.loss_sum / terms.normaliser).backward()
    expected = torch.zeros(3, 4)
    for b in range(3):
        expected[b, : lengths[b]] = -float(advantages[b]) / lengths[b] / 3
    torch.testing.assert_close(logp.grad, expected)


def test_objective_on_policy_token_mean():
    logp, advantages, mask = _hand_batch()
    lengths = [3, 2, 4]
    terms = GRPOObjective(clip_eps=0.2, loss_aggregation="token-mean")(logp, logp.detach(), None, advantages, mask)
    assert float(terms.loss_sum.detach()) == pytest.approx(-(0.5 * 3 - 1.0 * 2 + 2.0 * 4), abs=1e-6)
    assert float(terms.normaliser) == 9.0  # tokens
    (terms.loss_sum / terms.normaliser).backward()
    expected = torch.zeros(3, 4)
    for b in range(3):
        expected[b, : lengths[b]] = -float(advantages[b]) / 9
    torch.testing.assert_close(logp.grad, expected)


def test_objective_loss_sum_gradient_is_unnormalised():
    """The returned loss_sum is not divided by anything: its gradient per token is -A (token-mean) or -A/len."""
    for aggregation, divide in (("token-mean", False), ("seq-mean-token-mean", True)):
        logp, advantages, mask = _hand_batch()
        GRPOObjective(loss_aggregation=aggregation)(logp, logp.detach(), None, advantages, mask).loss_sum.backward()
        lengths = mask.sum(-1).float()
        expected = -advantages[:, None] * mask / (lengths[:, None] if divide else 1.0)
        torch.testing.assert_close(logp.grad, expected)


def test_objective_empty_sequence_contributes_nothing():
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    terms = GRPOObjective()(logp, logp.detach(), None, torch.tensor([1.0, 5.0]), mask)
    assert float(terms.loss_sum.detach()) == pytest.approx(-1.0)
    assert float(terms.normaliser) == 2.0
    assert torch.isfinite(terms.loss_sum)


def test_objective_clipping():
    clip = 0.2
    # rows: (ratio, advantage); column 1 is masked out with an extreme ratio
    cases = [(1.5, 2.0), (1.5, -2.0), (0.5, 2.0), (0.5, -2.0), (1.1, 2.0), (1.1, -2.0), (0.85, 2.0)]
    ratios = torch.tensor([[r, 3.0] for r, _ in cases])
    advantages = torch.tensor([a for _, a in cases])
    old = -torch.full((len(cases), 2), 1.7)
    logp = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[True, False]] * len(cases))
    terms = GRPOObjective(clip_eps=clip, loss_aggregation="token-mean")(logp, old, None, advantages, mask)

    # hand-derived: loss = -min(r A, clip(r) A); d/dlogp = -r A where the unclipped term is chosen, else 0
    expected_loss, expected_grad = [], []
    for r, a in cases:
        unclipped, clipped = r * a, min(max(r, 1 - clip), 1 + clip) * a
        expected_loss.append(-min(unclipped, clipped))
        expected_grad.append(-r * a if unclipped <= clipped else 0.0)
    # spelled out: the pessimistic bound clips a gain (r > 1+eps, A > 0 or r < 1-eps, A < 0) and keeps a loss
    assert expected_loss == pytest.approx([-2.4, 3.0, -1.0, 1.6, -2.2, 2.2, -1.7])
    assert expected_grad == pytest.approx([0.0, 3.0, -1.0, 0.0, -2.2, 2.2, -1.7])

    assert float(terms.loss_sum.detach()) == pytest.approx(sum(expected_loss), abs=1e-5)
    assert float(terms.normaliser) == len(cases)
    terms.loss_sum.backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor(expected_grad), atol=1e-5, rtol=1e-5)
    assert torch.all(logp.grad[:, 1] == 0)
    # tokens whose gradient the clip removed (masked tokens not counted): rows 0 and 3
    assert float(terms.stats["clipped_tokens"]) == sum(g == 0.0 for g in expected_grad) == 2.0


def test_objective_kl_k3():
    beta = 0.1
    generator = torch.Generator().manual_seed(3)
    logp = (-torch.rand(2, 3, generator=generator) * 2).requires_grad_(True)
    ref = -torch.rand(2, 3, generator=generator) * 2
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    advantages = torch.tensor([0.7, -0.3])
    terms = GRPOObjective(beta=beta, loss_aggregation="token-mean")(logp, logp.detach(), ref, advantages, mask)

    expected_loss, expected_grad, expected_kl = 0.0, torch.zeros(2, 3), 0.0
    for b in range(2):
        for t in range(3):
            if not mask[b, t]:
                continue
            r = float(ref[b, t]) - float(logp.detach()[b, t])
            kl = math.exp(r) - r - 1
            assert kl >= 0
            expected_kl += kl
            expected_loss += -float(advantages[b]) + beta * kl
            # d/dlogp [-A exp(logp - old)] at ratio 1 = -A;  d/dlogp [exp(r) - r - 1] = 1 - exp(r)
            expected_grad[b, t] = -float(advantages[b]) + beta * (1 - math.exp(r))
    assert float(terms.loss_sum.detach()) == pytest.approx(expected_loss, abs=1e-5)
    assert float(terms.stats["kl_sum"]) == pytest.approx(expected_kl, abs=1e-5)
    terms.loss_sum.backward()
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-5, rtol=1e-5)


def test_objective_kl_zero_at_reference():
    logp = torch.full((1, 4), -2.0, requires_grad=True)
    terms = GRPOObjective(beta=0.5)(logp, logp.detach(), logp.detach().clone(), torch.zeros(1), torch.ones(1, 4, dtype=torch.bool))
    assert float(terms.stats["kl_sum"]) == 0.0
    assert float(terms.loss_sum.detach()) == 0.0
    terms.loss_sum.backward()
    assert torch.all(logp.grad == 0)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_objective_mask_excludes_tokens(aggregation):
    logp, advantages, mask = _hand_batch()
    old = logp.detach() + 0.05
    ref = logp.detach() - 0.3
    objective = GRPOObjective(beta=0.1, loss_aggregation=aggregation, max_length=7)
    base = objective(logp, old, ref, advantages, mask)
    base.loss_sum.backward()
    assert torch.all(logp.grad[~mask] == 0)
    assert torch.all(logp.grad[mask] != 0)

    # changing every value at masked positions changes nothing
    logp2 = logp.detach().clone()
    old2, ref2 = old.clone(), ref.clone()
    logp2[~mask] += 2.5
    old2[~mask] -= 1.5
    ref2[~mask] += 3.0
    logp2.requires_grad_(True)
    other = objective(logp2, old2, ref2, advantages, mask)
    assert float(other.loss_sum.detach()) == pytest.approx(float(base.loss_sum.detach()), abs=1e-6)
    assert float(other.normaliser) == float(base.normaliser)
    assert float(other.stats["kl_sum"]) == pytest.approx(float(base.stats["kl_sum"]), abs=1e-6)


def test_objective_validation():
    logp = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="reference"):
        GRPOObjective(beta=0.1)(logp, logp.detach(), None, torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    assert GRPOObjective(beta=0.1).needs_reference and not GRPOObjective(beta=0.0).needs_reference
    with pytest.raises(ValueError) as info:
        GRPOObjective(loss_aggregation="sequence-sum")
    assert "sequence-sum" in str(info.value)
    for option in ("token-mean", "seq-mean-token-mean"):
        assert option in str(info.value)
    for kwargs in ({"clip_eps": 0.0}, {"clip_eps": -0.1}, {"beta": -0.01}):
        with pytest.raises(ValueError):
            GRPOObjective(**kwargs)


# ------------------------------------------------------------------------------------------------------
# 6. kernel
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_token_logprobs_matches_log_softmax(temperature, dtype):
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(2, 7, 13, generator=generator) * 3
    targets = torch.randint(0, 13, (2, 7), generator=generator)
    weights = torch.randn(2, 7, generator=generator)

    logits = base.clone().to(dtype).requires_grad_(True)
    out = token_logprobs(logits, targets, temperature)
    assert out.shape == (2, 7)
    assert out.dtype == torch.float32  # documented: float32 whatever the logits' dtype
    (out * weights.to(out.dtype)).sum().backward()

    reference_logits = base.clone().to(dtype).double().requires_grad_(True)
    expected = torch.log_softmax(reference_logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    (expected * weights.double()).sum().backward()

    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------------
# 7. micro-batch collation and the module's log-probs
# ------------------------------------------------------------------------------------------------------
def _trajectories(tok):
    rows = [("3917=", [4, 12, 9, 1], 0.8), ("5=", [7, 1], -0.5), ("804213=", [3, 3, 3, 5, 6, 8], 0.1), ("12=", [1], -0.4)]
    trajectories = []
    for i, (prompt, completion, advantage) in enumerate(rows):
        trajectories.append(
            Trajectory(
                prompt_id=10 + i,
                sample_index=i % 2,
                version=3,
                prompt_tokens=list(_ids(tok, prompt)),
                completion_tokens=completion,
                rollout_logprobs=[-0.1 * (j + 1) - i for j in range(len(completion))],
                reward=0.25 * i,
                advantage=advantage,
                truncated=completion[-1] != tok.eos_token_id,
            )
        )
    return trajectories


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
def test_collate_layout(tok, packing):
    trajectories = _trajectories(tok)
    # a second sample of prompt 10 arrives last: collate groups it next to its sibling
    sibling = copy.deepcopy(trajectories[0])
    sibling.sample_index, sibling.completion_tokens, sibling.rollout_logprobs = 1, [4, 1], [-2.0, -2.5]
    trajectories.append(sibling)
    batch = collate(trajectories, tok.pad_token_id, sample_offset=8, packing=packing)
    ordered = [trajectories[0], sibling, *trajectories[1:4]]
    width = max(len(t.completion_tokens) for t in ordered)
    assert batch.completion_mask.shape == batch.rollout_logprobs.shape == (5, width)
    tokens = batch.tokens
    flat_inputs = tokens.input_ids.reshape(-1)
    for i, t in enumerate(ordered):
        labels = tokens.label_slots // width == i
        assert tokens.label_targets[labels].tolist() == t.completion_tokens
        assert (tokens.label_slots[labels] % width).tolist() == list(range(len(t.completion_tokens)))
        positions = tokens.label_positions[labels]
        # c[0] is predicted at the last prompt token, c[t] at the position holding c[t-1]
        assert flat_inputs[positions[0]] == t.prompt_tokens[-1]
        assert flat_inputs[positions[1:]].tolist() == t.completion_tokens[:-1]
        assert batch.completion_mask[i].tolist() == [j < len(t.completion_tokens) for j in range(width)]
        torch.testing.assert_close(batch.rollout_logprobs[i, : len(t.completion_tokens)], torch.tensor(t.rollout_logprobs))
        assert torch.all(batch.rollout_logprobs[i][~batch.completion_mask[i]] == 0)
    if packing == "padded":
        assert tokens.attention is None and tokens.input_ids.shape[0] == 5
        for i, t in enumerate(ordered):
            row = t.prompt_tokens + t.completion_tokens[:-1]
            assert tokens.input_ids[i, : len(row)].tolist() == row
    else:  # prompt 10 appears once for its two samples
        assert tokens.input_ids.shape[0] == 1
        assert tokens.tokens_computed == sum(len(t.prompt_tokens) for t in trajectories[:4]) + sum(len(t.completion_tokens) - 1 for t in ordered)
    torch.testing.assert_close(batch.advantages, torch.tensor([t.advantage for t in ordered]))
    torch.testing.assert_close(batch.rewards, torch.tensor([t.reward for t in ordered]))
    assert batch.truncated.tolist() == [t.truncated for t in ordered]
    assert batch.prompt_ids == [t.prompt_id for t in ordered]
    assert batch.sample_indices == [t.sample_index for t in ordered]
    assert (batch.version, batch.sample_offset, batch.ends_step, batch.size) == (3, 8, True, 5)

    mixed = copy.deepcopy(trajectories)
    mixed[1].version = 4
    with pytest.raises(ValueError, match="mixes policy versions"):
        collate(mixed, tok.pad_token_id, 0)
    with pytest.raises(ValueError, match="packing='bogus'"):
        collate(trajectories, tok.pad_token_id, 0, packing="bogus")


@pytest.mark.parametrize("packing", ["padded", "shared_prompt"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_module_completion_logprobs_match_plain_forward(model, tok, temperature, packing):
    trajectories = _trajectories(tok)
    batch = collate(trajectories, tok.pad_token_id, sample_offset=0, packing=packing)
    module = GRPOModule(model, GRPOObjective(), SHAPE, tokenizer=tok, temperature=temperature)
    with torch.no_grad():
        logp = module.completion_logprobs(model, batch)
    assert logp.shape == batch.completion_mask.shape
    for i, t in enumerate(trajectories):
        expected = _reference_logprobs(model, t.prompt_tokens, t.completion_tokens, temperature)
        torch.testing.assert_close(logp[i][batch.completion_mask[i]].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------------
# 8. the CLI run and the Hugging Face export
# ------------------------------------------------------------------------------------------------------
def test_cli_run_summary_metrics_and_hf_export(tmp_path, monkeypatch, capsys):
    from hydra import compose, initialize_config_module

    import lit_parl.cli as cli

    run_dir = tmp_path / "run"
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["iterations=2", f"run_dir={run_dir}", "checkpoint_every=0"])

    built = {}
    real_build = cli.build

    def capturing_build(config):
        module, datamodule, trainer = real_build(config)
        built["module"], built["datamodule"] = module, datamodule
        return module, datamodule, trainer

    monkeypatch.setattr(cli, "build", capturing_build)
    summary = cli.run(cfg)

    # the summary
    keys = {"iterations", "mode", "reward_first", "reward_last10", "wall_s", "completions_per_s", "tokens_per_s", "gen_busy_s", "train_busy_s", "run_dir"}
    assert keys <= summary.keys()
    assert summary["iterations"] == 2
    assert summary["mode"] == cfg.datamodule.mode
    assert summary["run_dir"] == str(run_dir.resolve())
    samples = cfg.shape.prompts * cfg.shape.group_size
    if "completions" in summary:
        assert summary["completions"] == 2 * samples
    assert summary["wall_s"] > 0 and summary["completions_per_s"] > 0 and summary["tokens_per_s"] > 0
    # every completion has between 1 and max_new_tokens tokens
    max_new = cfg.sampling.max_new_tokens
    assert summary["completions_per_s"] <= summary["tokens_per_s"] + 0.01 <= max_new * summary["completions_per_s"] + 0.02
    assert summary["completions_per_s"] == pytest.approx(2 * samples / summary["wall_s"], rel=0.01)
    assert summary["gen_busy_s"] > 0 and summary["train_busy_s"] > 0
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last10"] <= 1.0

    # summary.json and the printed line carry the same dict
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lit_parl summary: ")]
    assert len(lines) == 1
    assert json.loads(lines[0][len("lit_parl summary: ") :]) == summary

    # metrics.csv: one row per iteration with the reward; the summary's rewards are those rewards
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert "reward" in rows[0].keys()
    rewarded = [row for row in rows if row.get("reward")]
    assert len(rewarded) == 2
    rewards = [float(row["reward"]) for row in rewarded]
    assert summary["reward_first"] == pytest.approx(rewards[0], abs=1e-6)
    assert summary["reward_last10"] == pytest.approx(sum(rewards) / 2, abs=1e-6)
    # and the reward is the mean of the iteration's samples' rewards (datamodule history)
    history = built["datamodule"].history
    assert len(history) == 2 and all(stats.completions == samples for stats in history)

    # the Hugging Face export loads with the Auto classes and is the trained policy
    module = built["module"]
    policy_dir = run_dir / "policy"
    loaded = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    loaded_tok = AutoTokenizer.from_pretrained(policy_dir)
    text = "3917=7193"
    assert loaded_tok(text).input_ids == module.tokenizer(text).input_ids
    assert (loaded_tok.pad_token_id, loaded_tok.eos_token_id) == (module.tokenizer.pad_token_id, module.tokenizer.eos_token_id)
    ids = torch.tensor([loaded_tok(text).input_ids, loaded_tok("0123456789").input_ids[:9]])
    trained = module.policy.eval()
    initial, _ = tiny_qwen2(seed=cfg.seed)
    with torch.no_grad():
        exported_logits = loaded(input_ids=ids, use_cache=False).logits
        trained_logits = trained(input_ids=ids, use_cache=False).logits
        initial_logits = initial.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(exported_logits, trained_logits, atol=1e-6, rtol=1e-6)
    assert (trained_logits - initial_logits).abs().max() > 1e-4, "two iterations of training changed nothing"
    assert loaded.config.vocab_size == len(loaded_tok)


def test_micro_batch_transfer_skips_the_walk_on_its_own_device_and_moves_everything_otherwise(model, tok):
    trajectories = _trajectories(tok)
    batch = collate(trajectories, tok.pad_token_id, sample_offset=0, packing="shared_prompt")
    from conftest import make_components

    _, datamodule = make_components()
    assert datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0) is batch
    moved = datamodule.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved.advantages.is_meta and moved.tokens.input_ids.is_meta
    assert moved.tokens.attention.segment_ids.is_meta and moved.tokens.attention.buckets[0].allowed.is_meta
