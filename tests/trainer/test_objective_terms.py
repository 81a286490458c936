"""The GRPO objective's terms on hand-built tensors: standardised advantages, the on-policy losses, clipping, the
k3 KL and the mask, each against a value derived by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lit_parl import GRPOObjective
from lit_parl.trainer.grpo_objective import LOSS_AGGREGATIONS


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
    terms = GRPOObjective(clip_eps=0.2, loss_aggregation="seq-mean-token-mean")(
        logp, logp.detach(), None, advantages, mask
    )
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
    terms = GRPOObjective(beta=0.5)(
        logp, logp.detach(), logp.detach().clone(), torch.zeros(1), torch.ones(1, 4, dtype=torch.bool)
    )
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
