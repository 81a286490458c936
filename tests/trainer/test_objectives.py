"""The GRPO family (``lit_parl.trainer.grpo_objective``) against hand derivations and a plain-Python reference.

Every expected value below comes from the formulas of ``GRPOObjective``'s docstring, written out again
here as loops over samples and tokens in Python floats (float64): ``reference_objective`` for the loss
and its gradient, ``hand_*`` for rewards and advantages. Nothing is copied from running the code.

What ``tests/trainer/test_objective_terms.py`` covers (on-policy GRPO values, symmetric clipping, k3 in the
loss, mask exclusion, basic validation) is not repeated; here: the Hydra presets as composed, off-policy
ratios with asymmetric and sequence-level (GSPO) clipping under every aggregation, the clip boundaries,
k1/k2/k3 in the loss and in the reward, the entropy bonus and its kernel, truncated importance sampling,
reward shaping, RLOO, and the validation messages.
"""

from __future__ import annotations

import math
import statistics

import hydra.utils
import pytest
import torch
from hydra import compose, initialize_config_module

from lit_parl import GRPOModule, GRPOObjective, IterationShape, tiny_qwen2
from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.kernels.logprobs import linear_token_logprobs
from lit_parl.trainer.grpo_objective import LOSS_AGGREGATIONS, kl_estimate

F64 = torch.float64
TIGHT = dict(rtol=1e-9, atol=1e-12)  # float64 reference vs float64 torch: only rounding order differs


# ------------------------------------------------------------------------------------------------------
# hand formulas
# ------------------------------------------------------------------------------------------------------
def hand_kl(lp: float, ref: float, estimator: str) -> tuple[float, float]:
    """(KL estimate, d/dlogp) of one token, Schulman's estimators written out."""
    if estimator == "k1":  # logp - ref
        return lp - ref, 1.0
    if estimator == "k2":  # ½ (logp - ref)²
        return 0.5 * (lp - ref) ** 2, lp - ref
    if estimator == "k3":  # exp(ref - logp) - (ref - logp) - 1
        return math.exp(ref - lp) - (ref - lp) - 1, -math.exp(ref - lp) + 1
    raise AssertionError(estimator)


def pessimistic(r: float, A: float, lo: float, hi: float) -> tuple[float, float, bool]:
    """-min(r A, clip(r, lo, hi) A), its derivative in r as PyTorch defines it, and whether it clipped.

    PyTorch's backward of ``torch.minimum(u, c)`` sends the gradient to the smaller input and, on a tie,
    half to each; ``clamp``'s backward passes the gradient where lo <= r <= hi, bounds included. So at
    r == lo or r == hi (where u == c), d/dr = -(½ A + ½ A · 1) = -A: the unclipped derivative."""
    u = r * A
    c = min(max(r, lo), hi) * A
    value = -min(u, c)
    to_u = 1.0 if u < c else 0.5 if u == c else 0.0
    inside = 1.0 if lo <= r <= hi else 0.0
    d_dr = -(to_u * A + (1.0 - to_u) * A * inside)
    return value, d_dr, c < u


def reference_objective(
    logp,
    old,
    adv,
    mask,
    *,
    clip_eps=0.2,
    clip_eps_high=None,
    ratio_level="token",
    aggregation="seq-mean-token-mean",
    max_length=None,
    beta=0.0,
    ref=None,
    kl_estimator="k3",
    kl_in_reward=False,
    entropy=None,
    entropy_coef=0.0,
    tis_cap=None,
    rollout=None,
):
    """Loss (loss_sum / normaliser), its gradient w.r.t. logp and entropy, and the stats, by plain loops.

    Per token of sample i: ℓ = w_t · (-min(ρ A_i, clip(ρ) A_i)) + β KL_t - κ H_t, with ρ the token ratio
    exp(logp - old), or for GSPO the sample's ratio s_i = exp(mean_{t in o_i}(logp - old)); w_t the TIS
    weight min(exp(old - rollout), cap) (a constant); then aggregated:
      token-mean:               Σ_i Σ_t ℓ / Σ_i |o_i|
      seq-mean-token-sum:       Σ_i Σ_t ℓ / B
      seq-mean-token-mean:      Σ_i (Σ_t ℓ / |o_i|) / B
      seq-mean-token-sum-norm:  Σ_i Σ_t ℓ / (B · max_length)
    """
    B, T = len(logp), len(logp[0])
    lo, hi = 1 - clip_eps, 1 + (clip_eps if clip_eps_high is None else clip_eps_high)
    lengths = [sum(1 for t in range(T) if mask[i][t]) for i in range(B)]
    normaliser = {
        "token-mean": sum(lengths),
        "seq-mean-token-sum": B,
        "seq-mean-token-mean": B,
        "seq-mean-token-sum-norm": B * (max_length or 0),
    }[aggregation]
    loss, clipped_tokens, approx_kl, kl_sum, entropy_sum, tis_sum = 0.0, 0, 0.0, 0.0, 0.0, 0.0
    grad = [[0.0] * T for _ in range(B)]
    grad_entropy = [[0.0] * T for _ in range(B)]
    for i in range(B):
        A = adv[i]
        tokens = [t for t in range(T) if mask[i][t]]
        per_sample = 1.0 / max(lengths[i], 1) if aggregation == "seq-mean-token-mean" else 1.0
        coef = per_sample / normaliser  # d loss / d ℓ_t for a token of sample i
        weights = {
            t: (min(math.exp(old[i][t] - rollout[i][t]), tis_cap) if tis_cap is not None else 1.0) for t in tokens
        }
        if ratio_level == "sequence":
            n = max(lengths[i], 1)
            log_s = sum(logp[i][t] - old[i][t] for t in tokens) / n
            s = math.exp(log_s)
            value, d_ds, clipped = pessimistic(s, A, lo, hi)
            # the sample's ratio enters every one of its tokens' losses; d s / d logp_t = s / n
            total_weight = sum(coef * weights[t] for t in tokens)
            for t in tokens:
                grad[i][t] += total_weight * d_ds * s / n
        for t in tokens:
            if ratio_level == "token":
                log_r = logp[i][t] - old[i][t]
                r = math.exp(log_r)
                value, d_dr, clipped = pessimistic(r, A, lo, hi)
                grad[i][t] += coef * weights[t] * d_dr * r
            else:
                log_r = log_s
            loss += coef * weights[t] * value
            clipped_tokens += int(clipped)
            approx_kl += math.exp(-log_r) + log_r - 1
            if tis_cap is not None:
                tis_sum += weights[t]
            if ref is not None:
                kl, d_kl = hand_kl(logp[i][t], ref[i][t], kl_estimator)
                kl_sum += kl
                if beta > 0 and not kl_in_reward:
                    loss += coef * beta * kl
                    grad[i][t] += coef * beta * d_kl
            if entropy is not None:
                entropy_sum += entropy[i][t]
                if entropy_coef > 0:
                    loss -= coef * entropy_coef * entropy[i][t]
                    grad_entropy[i][t] = -coef * entropy_coef
    stats = {"tokens": sum(lengths), "samples": B, "clipped_tokens": clipped_tokens, "approx_kl_sum": approx_kl}
    if ref is not None:
        stats["kl_sum"] = kl_sum
    if entropy is not None:
        stats["entropy_sum"] = entropy_sum
    if tis_cap is not None:
        stats["tis_weight_sum"] = tis_sum
    return loss, grad, grad_entropy, normaliser, stats


def hand_group_advantages(rewards, scale_rewards=True, eps=1e-6):
    if all(r == rewards[0] for r in rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    if not scale_rewards:
        return [r - mean for r in rewards]
    std = statistics.stdev(rewards)  # the sample std (n - 1), as torch.std
    return [(r - mean) / (std + eps) for r in rewards]


def hand_rloo(rewards):
    out = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if j != i]
        out.append(r - sum(others) / len(others))
    return out


def hand_shape(reward, length, truncated, limit, buffer, penalty):
    """DAPO's soft overlong punishment for one completion."""
    if buffer is None:
        return reward
    if truncated:
        return reward - penalty
    if length > limit - buffer:
        return reward + penalty * (limit - buffer - length) / buffer
    return reward


# ------------------------------------------------------------------------------------------------------
# a hand-made batch: 4 samples, ragged (3, 1, 4, 2 tokens), positive and negative advantages, ratios
# inside and outside [0.8, 1.2] / [0.8, 1.28]; masked slots hold arbitrary values
# ------------------------------------------------------------------------------------------------------
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
ADV = [0.8, -1.3, 1.1, -0.4]
RATIOS = [
    [1.1, 1.5, 0.6, 9.0],  # A > 0: 1.5 clipped (no gradient), 0.6 below 1 - eps kept (unclipped is smaller)
    [1.6, 0.1, 5.0, 0.3],  # one token; A < 0 above 1 + eps: kept
    [0.95, 1.25, 1.3, 0.75],  # A > 0: 1.25 inside [0.8, 1.28] but clipped with 1.2; 1.3 clipped by both
    [0.5, 1.02, 7.0, 0.2],  # A < 0 below 1 - eps: clipped
]
OLD = [[-1.2, -0.4, -2.3, -0.7], [-0.9, -3.0, -1.1, -0.2], [-0.3, -1.7, -0.6, -2.2], [-1.5, -0.8, -0.1, -4.0]]
REF = [[-1.0, -0.9, -1.9, -0.3], [-1.4, -2.0, -1.3, -0.6], [-0.2, -2.1, -0.9, -1.8], [-1.1, -0.5, -0.7, -3.1]]
ENTROPY = [[1.3, 0.7, 2.1, 0.4], [0.9, 1.8, 0.2, 1.1], [0.5, 1.6, 2.4, 0.8], [1.2, 0.3, 1.7, 2.6]]
# old - rollout: weights exp(·) = 0.74, 1.22, 4.48 (capped at 2), ...
ROLLOUT_SHIFT = [[0.3, -0.2, -1.5, 0.0], [-2.0, 0.5, 0.1, 0.0], [0.1, -0.9, 0.6, 0.05], [-0.4, 0.2, 0.0, 1.0]]


def make_batch(log_ratio_scale: float = 1.0):
    """(logp leaf, old, mask, advantages) in float64; logp = old + scale · log(ratio)."""
    old = torch.tensor(OLD, dtype=F64)
    logp = (old + log_ratio_scale * torch.tensor(RATIOS, dtype=F64).log()).requires_grad_(True)
    return logp, old, torch.tensor(MASK, dtype=torch.bool), torch.tensor(ADV, dtype=F64)


def check_against_reference(objective, logp, old, mask, adv, ref=None, entropy=None, rollout=None, **options):
    terms = objective(logp, old, ref, adv, mask, rollout, entropy)
    expected, grad, grad_entropy, normaliser, stats = reference_objective(
        logp.tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        ref=None if ref is None else ref.tolist(),
        entropy=None if entropy is None else entropy.tolist(),
        rollout=None if rollout is None else rollout.tolist(),
        **options,
    )
    assert float(terms.normaliser) == normaliser
    loss = terms.loss_sum / terms.normaliser
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-10, abs=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64), **TIGHT)
    if entropy is not None and entropy.requires_grad:
        if options.get("entropy_coef", 0.0) > 0:
            torch.testing.assert_close(entropy.grad, torch.tensor(grad_entropy, dtype=F64), **TIGHT)
        else:
            assert entropy.grad is None
    assert set(terms.stats) == set(stats)
    for name, value in stats.items():
        assert float(terms.stats[name]) == pytest.approx(value, rel=1e-10, abs=1e-12), name
        assert not terms.stats[name].requires_grad, name
    return terms


def test_hand_batch_covers_every_clip_case():
    """The batch exercises what it claims (checked with the hand formula, before any objective runs)."""
    cases = set()
    for i in range(4):
        for t in range(4):
            if MASK[i][t]:
                r, A = RATIOS[i][t], ADV[i]
                side = "above" if r > 1.2 else "below" if r < 0.8 else "inside"
                cases.add((side, A > 0, pessimistic(r, A, 0.8, 1.2)[2]))
    assert {
        ("above", True, True),
        ("above", False, False),
        ("below", True, False),
        ("below", False, True),
        ("inside", True, False),
        ("inside", False, False),
    } <= cases


# ------------------------------------------------------------------------------------------------------
# 1. the presets, as Hydra composes them
# ------------------------------------------------------------------------------------------------------
GRPO_OPTIONS = dict(
    clip_eps=0.2,
    clip_eps_high=0.2,
    beta=0.0,
    kl_estimator="k3",
    kl_in_reward=False,
    loss_aggregation="seq-mean-token-mean",
    max_length=None,
    advantage="group",
    scale_rewards=True,
    ratio_level="token",
    entropy_coef=0.0,
    tis_cap=None,
    dynamic_sampling=False,
    overlong_buffer=None,
    overlong_penalty=1.0,
)
PRESETS = {
    "grpo": GRPO_OPTIONS,
    # Dr. GRPO: no std scaling; Σ_i Σ_t / (B · L) with L the completion length limit
    "dr_grpo": {**GRPO_OPTIONS, "scale_rewards": False, "loss_aggregation": "seq-mean-token-sum-norm", "max_length": 6},
    # DAPO: clip-higher, token-level mean, dynamic sampling, soft overlong punishment
    "dapo": {
        **GRPO_OPTIONS,
        "clip_eps_high": 0.28,
        "loss_aggregation": "token-mean",
        "dynamic_sampling": True,
        "overlong_buffer": 2,
        "overlong_penalty": 1.0,
    },
    # GSPO: one length-normalised ratio per sequence, GSPO's clip range
    "gspo": {**GRPO_OPTIONS, "ratio_level": "sequence", "clip_eps": 3e-4, "clip_eps_high": 4e-4},
    # RLOO: leave-one-out baseline, no std scaling
    "rloo": {**GRPO_OPTIONS, "advantage": "rloo", "scale_rewards": False},
}


def compose_objective(preset: str, *overrides: str) -> tuple[GRPOObjective, object]:
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"algorithm={preset}", "run_dir=/tmp/x", *overrides])
    return hydra.utils.instantiate(cfg.algorithm.objective), cfg


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_composes_to_its_documented_options(preset):
    objective, cfg = compose_objective(preset)
    assert isinstance(objective, GRPOObjective)
    got = {name: getattr(objective, name) for name in PRESETS[preset]}
    assert got == PRESETS[preset]
    assert objective.needs_reference is False  # β = 0 in every preset: no reference forward
    if preset == "dr_grpo":
        assert objective.max_length == cfg.sampling.max_new_tokens


def test_dr_grpo_max_length_follows_the_length_limit():
    objective, cfg = compose_objective("dr_grpo", "sampling.max_new_tokens=9")
    assert cfg.sampling.max_new_tokens == 9 and objective.max_length == 9


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_pipeline_rewards_to_loss(preset):
    """Rewards -> shaped rewards -> advantages -> loss value and gradient, each step by hand."""
    objective, cfg = compose_objective(preset)
    options = PRESETS[preset]
    limit = cfg.sampling.max_new_tokens  # 6
    rewards = [1.0, 0.0, 0.5, 0.25]
    lengths = [2, 5, 6, 4]
    truncated = [False, False, True, False]
    shaped = objective.shape_rewards(
        torch.tensor(rewards, dtype=F64), torch.tensor(lengths), torch.tensor(truncated), limit
    )
    expected_shaped = [
        hand_shape(r, n, tr, limit, options["overlong_buffer"], options["overlong_penalty"])
        for r, n, tr in zip(rewards, lengths, truncated)
    ]
    if preset == "dapo":  # L - B = 4: length 4 untouched, 5 -> -0.5, cut at 6 -> -1
        assert expected_shaped == [1.0, -0.5, -0.5, 0.25]
    torch.testing.assert_close(shaped, torch.tensor(expected_shaped, dtype=F64), **TIGHT)

    advantages = objective.advantages(shaped)
    if options["advantage"] == "rloo":
        expected_adv = hand_rloo(expected_shaped)
    else:
        expected_adv = hand_group_advantages(expected_shaped, options["scale_rewards"], 1e-6)
    torch.testing.assert_close(advantages, torch.tensor(expected_adv, dtype=F64), **TIGHT)

    # GSPO's clip range is ~1e-3 wide: scale the log-ratios so that some samples fall inside, some out
    logp, old, mask, _ = make_batch(log_ratio_scale=0.002 if preset == "gspo" else 1.0)
    ref_options = {k: options[k] for k in ("clip_eps", "clip_eps_high", "ratio_level", "max_length")}
    terms = check_against_reference(
        objective, logp, old, mask, advantages.detach(), aggregation=options["loss_aggregation"], **ref_options
    )
    if preset == "gspo":  # samples 1 and 3 leave [1 - 3e-4, 1 + 4e-4]; sample 3 (A < 0, s < 1 - eps) is clipped
        s = [
            math.exp(sum(0.002 * math.log(RATIOS[i][t]) for t in range(4) if MASK[i][t]) / sum(MASK[i]))
            for i in range(4)
        ]
        assert [1 - 3e-4 <= v <= 1 + 4e-4 for v in s] == [True, False, True, False]
        assert float(terms.stats["clipped_tokens"]) == sum(MASK[3])


# ------------------------------------------------------------------------------------------------------
# 2. value and gradient off-policy: token / sequence ratio, symmetric / asymmetric clip, 4 aggregations
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("clip_eps_high", [None, 0.28])
def test_clipped_objective_value_and_gradient(aggregation, ratio_level, clip_eps_high):
    logp, old, mask, adv = make_batch()
    objective = GRPOObjective(
        clip_eps=0.2, clip_eps_high=clip_eps_high, loss_aggregation=aggregation, max_length=7, ratio_level=ratio_level
    )
    check_against_reference(
        objective,
        logp,
        old,
        mask,
        adv,
        clip_eps=0.2,
        clip_eps_high=clip_eps_high,
        ratio_level=ratio_level,
        aggregation=aggregation,
        max_length=7,
    )


def test_aggregation_normalisers_by_hand():
    """The four normalisers written out for the hand batch (lengths 3, 1, 4, 2; B = 4; L = 7)."""
    logp, old, mask, adv = make_batch()
    got = {}
    for aggregation in LOSS_AGGREGATIONS:
        got[aggregation] = float(
            GRPOObjective(loss_aggregation=aggregation, max_length=7)(logp, old, None, adv, mask).normaliser
        )
    assert got == {
        "token-mean": 10.0,
        "seq-mean-token-sum": 4.0,
        "seq-mean-token-mean": 4.0,
        "seq-mean-token-sum-norm": 28.0,
    }


def test_asymmetric_clip_only_widens_the_upper_side():
    """ratio 1.25, A > 0: clipped with ε = 0.2 (no gradient), kept with ε_high = 0.28 (gradient -r A);
    ratio 0.75, A < 0: clipped by 1 - ε either way."""
    old = torch.zeros(2, 1, dtype=F64)
    logp = torch.tensor([[math.log(1.25)], [math.log(0.75)]], dtype=F64, requires_grad=True)
    adv = torch.tensor([2.0, -2.0], dtype=F64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    for high, expected_loss, expected_grad in (
        (None, [-1.2 * 2, 0.8 * 2], [0.0, 0.0]),
        (0.28, [-1.25 * 2, 0.8 * 2], [-1.25 * 2, 0.0]),
    ):
        logp.grad = None
        terms = GRPOObjective(clip_eps=0.2, clip_eps_high=high, loss_aggregation="seq-mean-token-sum")(
            logp, old, None, adv, mask
        )
        terms.loss_sum.backward()
        assert float(terms.loss_sum.detach()) == pytest.approx(sum(expected_loss), abs=1e-12)
        torch.testing.assert_close(logp.grad[:, 0], torch.tensor(expected_grad, dtype=F64), **TIGHT)


def test_gspo_gradient_flows_through_the_mean():
    """Inside the clip range, ℓ_i = -s_i A_i for each of its n tokens; with seq-mean-token-mean the sample
    contributes -s_i A_i / B and d/dlogp_t = -A_i s_i / (n B) for every token t of the sample."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -0.1]], dtype=F64)
    deltas = [[0.1, -0.05, 0.0], [0.02, 0.0, 0.0]]  # mean log-ratios 0.05/3... and 0.02/2 (all inside [0.8, 1.2])
    logp = (old + torch.tensor(deltas, dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.5, -0.5], dtype=F64)
    terms = GRPOObjective(ratio_level="sequence")(logp, old, None, adv, mask)
    (terms.loss_sum / terms.normaliser).backward()
    s0, s1 = math.exp((0.1 - 0.05) / 3), math.exp(0.02 / 2)
    assert float((terms.loss_sum / terms.normaliser).detach()) == pytest.approx((-s0 * 1.5 + s1 * 0.5) / 2, abs=1e-12)
    expected = [[-1.5 * s0 / 3 / 2] * 3, [0.5 * s1 / 2 / 2] * 2 + [0.0]]
    torch.testing.assert_close(logp.grad, torch.tensor(expected, dtype=F64), **TIGHT)


# ------------------------------------------------------------------------------------------------------
# 3. edge cases
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["group-scaled", "group", "rloo"])
@pytest.mark.parametrize("value", [0.0, 1.0, 1 / 3, 0.7])
def test_all_equal_rewards_give_exactly_zero_loss_and_gradient(kind, value):
    objective = GRPOObjective(advantage="rloo" if kind == "rloo" else "group", scale_rewards=kind == "group-scaled")
    for group_size in (2, 3, 4, 7):
        advantages = objective.advantages(torch.full((group_size,), value, dtype=torch.float32))
        assert advantages.tolist() == [0.0] * group_size
    logp, old, mask, _ = make_batch()  # off-policy ratios: a non-zero advantage would give gradient
    advantages = objective.advantages(torch.full((4,), value, dtype=F64))
    terms = objective(logp, old, None, advantages, mask)
    terms.loss_sum.backward()
    assert float(terms.loss_sum.detach()) == 0.0
    assert torch.all(logp.grad == 0)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_one_token_completions(ratio_level):
    """With one token the sequence ratio is the token ratio: token and sequence levels agree."""
    old = torch.tensor([[-0.5], [-1.5], [-2.5]], dtype=F64)
    logp = (old + torch.tensor([[math.log(1.5)], [math.log(0.9)], [math.log(0.5)]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, -1.0], dtype=F64)
    mask = torch.ones(3, 1, dtype=torch.bool)
    terms = GRPOObjective(ratio_level=ratio_level)(logp, old, None, adv, mask)
    (terms.loss_sum / terms.normaliser).backward()
    # 1.5, A=1: clipped at 1.2 -> -1.2, grad 0;  0.9, A=-2: inside -> 1.8, grad 1.8;  0.5, A=-1: clipped at 0.8 -> 0.8,
    # grad 0
    assert float((terms.loss_sum / terms.normaliser).detach()) == pytest.approx((-1.2 + 1.8 + 0.8) / 3, abs=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0], [1.8 / 3], [0.0]], dtype=F64), **TIGHT)
    assert float(terms.stats["clipped_tokens"]) == 2


def exact_log(bound: float) -> float:
    """x with exp(x) == bound exactly in float64, both in Python and in torch (x = log(bound) ± a few ulps)."""
    candidates = [math.log(bound)]
    for direction in (math.inf, -math.inf):
        x = math.log(bound)
        for _ in range(40):
            x = math.nextafter(x, direction)
            candidates.append(x)
    for x in candidates:
        if math.exp(x) == bound and torch.exp(torch.tensor(x, dtype=F64)).item() == bound:
            return x
    raise AssertionError(f"no float64 x with exp(x) == {bound}")


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_ratio_exactly_at_the_clip_boundaries(ratio_level):
    """r == 1 - ε or r == 1 + ε_high: both terms of the min are equal, so the loss is -r A (continuous);
    torch.minimum splits the gradient ½/½ and clamp passes it at its bounds, so d/dlogp = -r A, the
    unclipped gradient, for either sign of A. Just outside, the clipped side has gradient 0."""
    clip_eps, clip_eps_high = 0.2, 0.28
    lo, hi = 1 - clip_eps, 1 + clip_eps_high
    objective = GRPOObjective(
        clip_eps=clip_eps, clip_eps_high=clip_eps_high, loss_aggregation="seq-mean-token-sum", ratio_level=ratio_level
    )
    rows = []  # (log ratio, advantage, expected loss, expected gradient)
    for bound, sign_outward in ((lo, -math.inf), (hi, math.inf)):
        x = exact_log(bound)
        outside = x  # the nearest x whose ratio is past the bound (several x share exp(x) == bound)
        while math.exp(outside) == bound or torch.exp(torch.tensor(outside, dtype=F64)).item() == bound:
            outside = math.nextafter(outside, sign_outward)
        assert math.exp(outside) == torch.exp(torch.tensor(outside, dtype=F64)).item()
        for A in (1.5, -1.5):
            rows.append((x, A, -bound * A, -bound * A))
            r_out = math.exp(outside)
            clipped_side = (bound == hi and A > 0) or (bound == lo and A < 0)
            rows.append((outside, A, -(bound if clipped_side else r_out) * A, 0.0 if clipped_side else -r_out * A))
    # one-token completions (old = 0): the token ratio and GSPO's sequence ratio are the same exp(x)
    logp = torch.tensor([[x] for x, *_ in rows], dtype=F64, requires_grad=True)
    old = torch.zeros_like(logp)
    adv = torch.tensor([A for _, A, *_ in rows], dtype=F64)
    terms = objective(logp, old, None, adv, torch.ones(len(rows), 1, dtype=torch.bool))
    terms.loss_sum.backward()
    # per-row values via the hand loss on each row alone
    for k, (x, A, loss, grad) in enumerate(rows):
        one = GRPOObjective(
            clip_eps=clip_eps,
            clip_eps_high=clip_eps_high,
            loss_aggregation="seq-mean-token-sum",
            ratio_level=ratio_level,
        )
        lp = torch.tensor([[x]], dtype=F64, requires_grad=True)
        t = one(
            lp, torch.zeros(1, 1, dtype=F64), None, torch.tensor([A], dtype=F64), torch.ones(1, 1, dtype=torch.bool)
        )
        assert float(t.loss_sum.detach()) == pytest.approx(loss, rel=1e-14), (k, x, A)
        # the hand rule agrees (its derivative is in r; d/dlogp = r · d/dr)
        value, d_dr, _ = pessimistic(math.exp(x), A, lo, hi)
        assert (value, d_dr * math.exp(x)) == pytest.approx((loss, grad), rel=1e-14)
        assert float(logp.grad[k, 0]) == pytest.approx(grad, rel=1e-14, abs=0.0), (k, x, A)
    assert float(terms.loss_sum.detach()) == pytest.approx(sum(row[2] for row in rows), rel=1e-14)
    # at the boundary the clip removed nothing; just outside, the two clipped-side rows
    assert float(terms.stats["clipped_tokens"]) == 2


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_empty_mask_row(aggregation, ratio_level):
    """An empty completion adds nothing (no NaN from its 0 tokens) but still counts as a sample in B."""
    old = torch.tensor([[-1.0, -0.5, -2.0], [3.0, -4.0, 1.0], [-0.2, -0.9, -1.4]], dtype=F64)
    logp = (old + torch.tensor([[0.3, -0.4, 0.1], [2.0, -3.0, 5.0], [-0.1, 0.05, 0.0]], dtype=F64)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.9, 2.0, -0.6], dtype=F64)
    objective = GRPOObjective(loss_aggregation=aggregation, max_length=5, ratio_level=ratio_level)
    terms = check_against_reference(
        objective, logp, old, mask, adv, aggregation=aggregation, max_length=5, ratio_level=ratio_level
    )
    assert torch.all(torch.isfinite(logp.grad)) and torch.all(logp.grad[1] == 0)
    assert float(terms.normaliser) == {"token-mean": 5, "seq-mean-token-sum-norm": 15}.get(aggregation, 3)


# ------------------------------------------------------------------------------------------------------
# 4. advantages and reward shaping
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scale_rewards", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_group_advantages_by_hand(scale_rewards, eps):
    rewards = [0.2, 0.9, 0.4, 0.4, 1.0]
    objective = GRPOObjective(scale_rewards=scale_rewards, eps=eps)
    got = objective.advantages(torch.tensor(rewards, dtype=torch.float32))
    assert got.dtype == torch.float32
    torch.testing.assert_close(
        got, torch.tensor(hand_group_advantages(rewards, scale_rewards, eps), dtype=torch.float32)
    )


@pytest.mark.parametrize(
    "rewards", [[1.0, 0.0], [1.0, 0.0, 0.5, 0.25], [0.3, 0.3, 0.9], [2.0, -1.0, 0.5, 0.5, 4.0, 0.0]]
)
def test_rloo_advantages_leave_one_out_loop(rewards):
    objective = GRPOObjective(advantage="rloo")
    got = objective.advantages(torch.tensor(rewards, dtype=F64))
    torch.testing.assert_close(got, torch.tensor(hand_rloo(rewards), dtype=F64), **TIGHT)
    # scale_rewards is not an RLOO option: no std division either way
    torch.testing.assert_close(
        GRPOObjective(advantage="rloo", scale_rewards=False).advantages(torch.tensor(rewards, dtype=F64)), got
    )


@pytest.mark.parametrize("buffer,penalty", [(4, 1.0), (3, 0.5), (1, 2.0)])
def test_overlong_shaping_by_hand(buffer, penalty):
    limit = 10
    lengths = [1, 3, 6, 7, 8, 9, 10, 10, 5]
    truncated = [False, False, False, False, False, False, False, True, True]  # the last: cut, however long
    rewards = [0.5, 1.0, 0.0, 0.25, 1.0, 0.75, 1.0, 1.0, 0.2]
    objective = GRPOObjective(overlong_buffer=buffer, overlong_penalty=penalty)
    got = objective.shape_rewards(torch.tensor(rewards), torch.tensor(lengths), torch.tensor(truncated), limit)
    expected = [hand_shape(r, n, tr, limit, buffer, penalty) for r, n, tr in zip(rewards, lengths, truncated)]
    torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-7)
    assert got.dtype == torch.float32
    for r, n, tr, shaped in zip(rewards, lengths, truncated, got.tolist()):
        if tr:
            assert shaped == pytest.approx(r - penalty)  # cut at the limit: the full penalty
        elif n <= limit - buffer:
            assert shaped == r  # untouched, exactly
        else:
            assert r - penalty <= shaped < r  # linear in (L - B, L]
    # off: identity
    off = GRPOObjective().shape_rewards(torch.tensor(rewards), torch.tensor(lengths), torch.tensor(truncated), limit)
    assert off.tolist() == torch.tensor(rewards).tolist()


def test_the_acceptor_shapes_rewards_then_computes_advantages():
    from lit_parl.data import GroupAcceptor
    from lit_parl.rollout.records import Group, GroupRequest

    acceptor = GroupAcceptor(
        GRPOObjective(overlong_buffer=2, overlong_penalty=0.5, scale_rewards=False), group_size=4, max_new_tokens=6
    )
    rewards, lengths, truncated = [1.0, 1.0, 0.0, 1.0], [3, 5, 4, 6], [False, False, False, True]
    completions = [[5] * n for n in lengths]
    group = Group(
        0,
        0,
        [0, 1, 2, 3],
        completions,
        [[0.0] * n for n in lengths],
        rewards,
        ["length" if t else "stop" for t in truncated],
    )
    trajectories = acceptor.accept(group, {0: GroupRequest(0, (4,), 0, (1, 2, 3, 4))}, version=0)
    shaped = torch.tensor([t.shaped_reward for t in trajectories])
    advantages = torch.tensor([t.advantage for t in trajectories])
    expected_shaped = [hand_shape(r, n, tr, 6, 2, 0.5) for r, n, tr in zip(rewards, lengths, truncated)]
    assert expected_shaped == [1.0, 0.75, 0.0, 0.5]
    torch.testing.assert_close(shaped, torch.tensor(expected_shaped))
    torch.testing.assert_close(advantages, torch.tensor(hand_group_advantages(expected_shaped, scale_rewards=False)))


# ------------------------------------------------------------------------------------------------------
# 5. KL: estimators, in the loss, in the reward
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_value_and_gradient(estimator):
    logp = torch.tensor([-1.0, -0.2, -3.0, -0.7, -2.2], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -0.2, -1.0, -0.9, -4.0], dtype=F64)
    kl = kl_estimate(logp, ref, estimator)
    expected = [hand_kl(a, b, estimator) for a, b in zip(logp.tolist(), ref.tolist())]
    torch.testing.assert_close(kl, torch.tensor([v for v, _ in expected], dtype=F64), **TIGHT)
    kl.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([d for _, d in expected], dtype=F64), **TIGHT)
    assert float(kl[1].detach()) == 0.0  # logp == ref
    if estimator != "k1":
        assert torch.all(kl >= 0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_kl_in_the_loss(estimator, aggregation, ratio_level):
    logp, old, mask, adv = make_batch()
    ref = torch.tensor(REF, dtype=F64)
    objective = GRPOObjective(
        beta=0.07,
        kl_estimator=estimator,
        loss_aggregation=aggregation,
        max_length=6,
        ratio_level=ratio_level,
        clip_eps_high=0.28,
    )
    check_against_reference(
        objective,
        logp,
        old,
        mask,
        adv,
        ref=ref,
        beta=0.07,
        kl_estimator=estimator,
        aggregation=aggregation,
        max_length=6,
        ratio_level=ratio_level,
        clip_eps_high=0.28,
    )


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_reward_leaves_the_loss_without_kl(estimator):
    logp, old, mask, adv = make_batch()
    ref = torch.tensor(REF, dtype=F64)
    objective = GRPOObjective(beta=0.07, kl_estimator=estimator, kl_in_reward=True)
    assert objective.needs_reference
    terms = check_against_reference(
        objective, logp, old, mask, adv, ref=ref, beta=0.07, kl_estimator=estimator, kl_in_reward=True
    )
    hand_kl_sum = sum(
        hand_kl(logp[i, t].item(), REF[i][t], estimator)[0] for i in range(4) for t in range(4) if MASK[i][t]
    )
    assert float(terms.stats["kl_sum"]) == pytest.approx(hand_kl_sum, rel=1e-12)
    # and the loss is exactly the β = 0 loss
    logp0 = logp.detach().clone().requires_grad_(True)
    plain = GRPOObjective(beta=0.0)(logp0, old, None, adv, mask)
    assert float(plain.loss_sum.detach()) == float(terms.loss_sum.detach())
    # β = 0 with ref_logp given: KL logged, not in the loss
    logged = GRPOObjective(beta=0.0, kl_estimator=estimator)(logp0, old, ref, adv, mask)
    assert float(logged.loss_sum.detach()) == float(plain.loss_sum.detach())
    assert float(logged.stats["kl_sum"]) == pytest.approx(hand_kl_sum, rel=1e-12)


def _kl_batch(group_size=3, drop=None):
    """Two groups (prompts 7 and 9) of 3, delivered interleaved; shaped rewards differ from the rewards."""
    completions = {7: [[4, 5], [6, 7, 8, 9], [3]], 9: [[2, 2, 2], [5, 6, 1], [8, 8]]}
    rewards = {7: [1.0, 0.0, 0.5], 9: [0.25, 0.25, 0.75]}
    shaped = {7: [1.0, -0.5, 0.5], 9: [0.25, 0.0, 0.75]}
    trajectories = []
    for k in range(group_size):
        for prompt in (7, 9):
            if drop == (prompt, k):
                continue
            c = completions[prompt][k]
            trajectories.append(
                Trajectory(
                    prompt_id=prompt,
                    sample_index=k,
                    version=0,
                    prompt_tokens=[1, prompt],
                    completion_tokens=c,
                    rollout_logprobs=[-0.5] * len(c),
                    reward=rewards[prompt][k],
                    advantage=0.0,
                    truncated=False,
                    shaped_reward=shaped[prompt][k],
                )
            )
    return collate(trajectories, pad_id=0, sample_offset=0, packing="padded", group_size=group_size)


@pytest.fixture(scope="module")
def policy_and_tokenizer():
    return tiny_qwen2()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("advantage,scale_rewards", [("group", True), ("group", False), ("rloo", False)])
def test_kl_in_reward_advantages_group_by_group(estimator, advantage, scale_rewards):
    beta = 0.3
    objective = GRPOObjective(
        beta=beta, kl_estimator=estimator, kl_in_reward=True, advantage=advantage, scale_rewards=scale_rewards
    )
    batch = _kl_batch()
    n, T = batch.completion_mask.shape
    assert (n, T) == (6, 4) and batch.prompt_ids == [7, 7, 7, 9, 9, 9]
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(n, T, generator=gen) * 2
    ref = -torch.rand(n, T, generator=gen) * 2
    old[~batch.completion_mask] = 1.5  # off-mask values must not count
    got = objective.kl_in_reward_advantages(batch, old, ref)

    mask = batch.completion_mask.tolist()
    expected = [0.0] * n
    for prompt in (7, 9):
        rows = [i for i in range(n) if batch.prompt_ids[i] == prompt]
        group_rewards = []
        for i in rows:
            sequence_kl = sum(hand_kl(float(old[i, t]), float(ref[i, t]), estimator)[0] for t in range(T) if mask[i][t])
            group_rewards.append(float(batch.shaped_rewards[i]) - beta * sequence_kl)
        values = (
            hand_rloo(group_rewards) if advantage == "rloo" else hand_group_advantages(group_rewards, scale_rewards)
        )
        for i, v in zip(rows, values):
            expected[i] = v
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_kl_in_reward_refuses_a_split_group(policy_and_tokenizer):
    policy, tokenizer = policy_and_tokenizer
    module = GRPOModule(
        policy,
        GRPOObjective(beta=0.1, kl_in_reward=True),
        IterationShape(prompts=2, group_size=3, micro_batch_size=6),
        tokenizer=tokenizer,
    )
    batch = _kl_batch(drop=(7, 2))  # prompt 7 has 2 of its 3 samples here
    zeros = torch.zeros(batch.completion_mask.shape)
    with pytest.raises(ValueError, match="whole groups"):
        module.objective.kl_in_reward_advantages(batch, zeros, zeros - 0.1)


# ------------------------------------------------------------------------------------------------------
# 6. entropy: the kernel, and the bonus
# ------------------------------------------------------------------------------------------------------
def naive_entropy_and_logprobs(h, w, b, targets, temperature):
    """-Σ_v p_v log p_v and log p_target of softmax((h Wᵀ + b) / T), row by row, in float64."""
    logits = (h.double() @ w.double().T + (0 if b is None else b.double())) / temperature
    log_p = logits - torch.logsumexp(logits, -1, keepdim=True)
    entropy = torch.stack([-(log_p[n].exp() * log_p[n]).sum() for n in range(h.shape[0])])
    return log_p.gather(-1, targets[:, None])[:, 0], entropy


@pytest.mark.parametrize("chunk", [1, 3, 50])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("upstream", ["both", "entropy-only", "logprob-only"])
def test_linear_token_logprobs_entropy_and_gradients(chunk, temperature, with_bias, upstream):
    gen = torch.Generator().manual_seed(11)
    N, d, V = 7, 5, 11
    h = torch.randn(N, d, generator=gen, requires_grad=True)
    w = torch.randn(V, d, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    a, c = torch.randn(N, generator=gen).double(), torch.randn(N, generator=gen).double()
    inputs = [h, w] + ([b] if with_bias else [])

    logp, entropy = linear_token_logprobs(h, w, targets, temperature, bias=b, chunk_size=chunk, with_entropy=True)
    naive_logp, naive_entropy = naive_entropy_and_logprobs(h, w, b, targets, temperature)
    assert entropy.dtype == torch.float32 and entropy.shape == (N,)
    torch.testing.assert_close(entropy.double(), naive_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp.double(), naive_logp, rtol=1e-5, atol=1e-5)
    assert torch.all(entropy >= 0) and torch.all(entropy <= math.log(V) + 1e-5)

    def loss(lp, ent):
        terms = {
            "both": (lp.double() * a).sum() + (ent.double() * c).sum(),
            "entropy-only": (ent.double() * c).sum(),
            "logprob-only": (lp.double() * a).sum(),
        }
        return terms[upstream]

    grads = torch.autograd.grad(loss(logp, entropy), inputs)
    expected = torch.autograd.grad(loss(naive_logp, naive_entropy), inputs)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-5)


def test_entropy_hand_value_on_a_known_distribution():
    """Logits (0, log 2, log 3) -> p = (1/6, 2/6, 3/6); H = -Σ p log p."""
    w = torch.tensor([[0.0], [math.log(2)], [math.log(3)]])
    h = torch.ones(1, 1)
    _, entropy = linear_token_logprobs(h, w, torch.tensor([0]), with_entropy=True)
    p = [1 / 6, 2 / 6, 3 / 6]
    assert float(entropy[0]) == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-6)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_entropy_bonus_value_and_gradient(aggregation):
    logp, old, mask, adv = make_batch()
    entropy = torch.tensor(ENTROPY, dtype=F64, requires_grad=True)
    objective = GRPOObjective(entropy_coef=0.03, loss_aggregation=aggregation, max_length=8)
    check_against_reference(
        objective, logp, old, mask, adv, entropy=entropy, entropy_coef=0.03, aggregation=aggregation, max_length=8
    )
    # coefficient 0: the entropy is logged, not in the loss (and not differentiated)
    logp.grad = None
    entropy0 = torch.tensor(ENTROPY, dtype=F64, requires_grad=True)
    objective0 = GRPOObjective(entropy_coef=0.0, loss_aggregation=aggregation, max_length=8)
    check_against_reference(objective0, logp, old, mask, adv, entropy=entropy0, aggregation=aggregation, max_length=8)


def test_objective_through_the_kernel_with_entropy_bonus():
    """The module's path: logp and entropy from one kernel call into the objective; gradients w.r.t. the
    hidden states, head weight and bias equal autograd through the naive formulas."""
    gen = torch.Generator().manual_seed(2)
    B, T, d, V = 3, 4, 6, 9
    h = torch.randn(B * T, d, generator=gen, requires_grad=True)
    w = torch.randn(V, d, generator=gen, requires_grad=True)
    bias = torch.randn(V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (B * T,), generator=gen)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2, 0.4])
    objective = GRPOObjective(entropy_coef=0.05, clip_eps_high=0.28, loss_aggregation="token-mean")

    def run(logp, entropy):
        logp, entropy = logp.view(B, T).double(), entropy.view(B, T).double()
        old = logp.detach() + torch.tensor(
            [[0.1, -0.3, 0.02, 0.0], [0.4, 0.0, 0.0, 0.0], [-0.05, 0.25, -0.2, 0.1]], dtype=F64
        )
        terms = objective(logp, old, None, adv.double(), mask, None, entropy)
        return terms.loss_sum / terms.normaliser

    got = torch.autograd.grad(
        run(*linear_token_logprobs(h, w, targets, 0.8, bias=bias, chunk_size=5, with_entropy=True)), (h, w, bias)
    )
    expected = torch.autograd.grad(run(*naive_entropy_and_logprobs(h, w, bias, targets, 0.8)), (h, w, bias))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------
# 7. truncated importance sampling
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("tis_cap", [1.0, 2.0])
def test_tis_weights_each_token_by_the_capped_ratio(ratio_level, aggregation, tis_cap):
    logp, old, mask, adv = make_batch()
    rollout = (old - torch.tensor(ROLLOUT_SHIFT, dtype=F64)).requires_grad_(True)
    old = old.clone().requires_grad_(True)
    objective = GRPOObjective(tis_cap=tis_cap, ratio_level=ratio_level, loss_aggregation=aggregation)
    check_against_reference(
        objective,
        logp,
        old,
        mask,
        adv,
        rollout=rollout,
        tis_cap=tis_cap,
        ratio_level=ratio_level,
        aggregation=aggregation,
    )
    # the weight is a constant: no gradient reaches the rollout log-probs, and old_logp gets only the
    # ratio's share (log ratio = logp - old, so d/dold = -d/dlogp)
    assert rollout.grad is None
    torch.testing.assert_close(old.grad, -logp.grad, **TIGHT)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_tis_weights_the_policy_gradient_term_not_the_kl(estimator):
    """With β > 0 in the loss, the TIS weight multiplies the clipped policy-gradient term only (as in
    verl's TIS); β·KL and the entropy bonus are added unweighted (``reference_objective`` does the same)."""
    logp, old, mask, adv = make_batch()
    rollout = old - torch.tensor(ROLLOUT_SHIFT, dtype=F64)
    ref = torch.tensor(REF, dtype=F64)
    entropy = torch.tensor(ENTROPY, dtype=F64, requires_grad=True)
    objective = GRPOObjective(tis_cap=2.0, beta=0.2, kl_estimator=estimator, entropy_coef=0.05, clip_eps_high=0.28)
    check_against_reference(
        objective,
        logp,
        old,
        mask,
        adv,
        ref=ref,
        entropy=entropy,
        rollout=rollout,
        tis_cap=2.0,
        beta=0.2,
        kl_estimator=estimator,
        entropy_coef=0.05,
        clip_eps_high=0.28,
    )


def test_tis_weight_by_hand():
    """min(exp(old - rollout), cap): exp(0.5) = 1.65 kept, exp(1.5) = 4.48 capped at 2, exp(-1) = 0.37 kept."""
    old = torch.zeros(1, 3, dtype=F64)
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)  # on-policy: per-token loss -A, gradient -A
    rollout = torch.tensor([[-0.5, -1.5, 1.0]], dtype=F64)
    terms = GRPOObjective(tis_cap=2.0, loss_aggregation="seq-mean-token-sum")(
        logp, old, None, torch.tensor([2.0], dtype=F64), torch.ones(1, 3, dtype=torch.bool), rollout
    )
    weights = [math.exp(0.5), 2.0, math.exp(-1.0)]
    terms.loss_sum.backward()
    assert float(terms.loss_sum.detach()) == pytest.approx(-2.0 * sum(weights), rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0 * w for w in weights]], dtype=F64), **TIGHT)
    assert float(terms.stats["tis_weight_sum"]) == pytest.approx(sum(weights), rel=1e-12)


def test_tis_off_ignores_the_rollout_logprobs():
    logp, old, mask, adv = make_batch()
    objective = GRPOObjective(clip_eps_high=0.28)
    without = objective(logp, old, None, adv, mask)
    (grad_without,) = torch.autograd.grad(without.loss_sum, logp)
    rollout = old + 5.0  # far from old: would change everything if used
    with_rollout = objective(logp, old, None, adv, mask, rollout)
    (grad_with,) = torch.autograd.grad(with_rollout.loss_sum, logp)
    assert float(with_rollout.loss_sum.detach()) == float(without.loss_sum.detach())
    assert torch.equal(grad_with, grad_without)
    assert "tis_weight_sum" not in with_rollout.stats


def test_tis_without_rollout_logprobs_raises():
    logp, old, mask, adv = make_batch()
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOObjective(tis_cap=2.0)(logp, old, None, adv, mask)


# ------------------------------------------------------------------------------------------------------
# 8. validation messages name the option and the valid choices
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "option,bad,choices",
    [
        ("kl_estimator", "k4", ("k1", "k2", "k3")),
        ("advantage", "ppo", ("group", "rloo")),
        ("ratio_level", "sample", ("token", "sequence")),
        ("loss_aggregation", "token-sum", LOSS_AGGREGATIONS),
    ],
)
def test_unknown_choice_names_option_and_choices(option, bad, choices):
    with pytest.raises(ValueError) as info:
        GRPOObjective(**{option: bad})
    message = str(info.value)
    assert option in message and repr(bad) in message
    for choice in choices:
        assert choice in message


def test_kl_estimate_unknown_estimator():
    with pytest.raises(ValueError) as info:
        kl_estimate(torch.zeros(2), torch.zeros(2), "k9")
    assert "k9" in str(info.value) and all(k in str(info.value) for k in ("k1", "k2", "k3"))


@pytest.mark.parametrize(
    "kwargs,names",
    [
        ({"loss_aggregation": "seq-mean-token-sum-norm"}, ("max_length", "seq-mean-token-sum-norm")),
        ({"loss_aggregation": "seq-mean-token-sum-norm", "max_length": 0}, ("max_length",)),
        ({"tis_cap": 0.5}, ("tis_cap", "0.5")),
        ({"tis_cap": 0.0}, ("tis_cap",)),
        ({"overlong_buffer": 0}, ("overlong_buffer", "0")),
        ({"overlong_buffer": -3}, ("overlong_buffer", "-3")),
        ({"clip_eps_high": 0.0}, ("clip_eps_high",)),
        ({"entropy_coef": -0.1}, ("entropy_coef",)),
    ],
)
def test_bad_values_name_the_option(kwargs, names):
    with pytest.raises(ValueError) as info:
        GRPOObjective(**kwargs)
    assert str(info.value).startswith("GRPOObjective:")
    for name in names:
        assert name in str(info.value)


def test_valid_edge_values_accepted():
    GRPOObjective(tis_cap=1.0)  # cap 1: weights never above 1
    GRPOObjective(overlong_buffer=1)
    GRPOObjective(loss_aggregation="seq-mean-token-sum-norm", max_length=1)
