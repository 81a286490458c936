"""Training on multi-turn episodes: environment tokens carry no gradient and no weight in any normaliser,
model tokens are trained under the objective, and the on-policy invariants hold with episodes (SGD, so a
scale error shows). A fit trains on episodes of uneven length (1 to 3 model turns, turns ending on digits)."""

from __future__ import annotations

import copy

import torch

from helpers.components import BatchRecorder, fit, make_components, policy_state, sgd
from helpers.episode_envs import DIGIT_STOPS, TurnTaker
from helpers.pools import InProcessPool, ShufflingPool
from lit_parl import GRPOObjective, Packing
from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.episodes import EpisodeSettings, environment_reward
from lit_parl.rewards import Reward
from lit_parl.rollout.records import SamplingParams

LR = 0.5
SAME_UPDATE = 1e-5  # as in tests/invariants/test_invariants.py: float32 reorderings measure ~5e-7
EPISODES = EpisodeSettings(TurnTaker, max_turns=4, max_episode_tokens=40)
SAMPLING = SamplingParams(max_new_tokens=6, stop_token_ids=DIGIT_STOPS)


def _components(pool=None, mode="async", micro_batch_size=8, objective=None, **kwargs):
    return make_components(
        mode=mode,
        pool=pool or InProcessPool(),
        prompts=8,
        group_size=4,
        micro_batch_size=micro_batch_size,
        rewards=[Reward(environment_reward)],
        objective=objective,
        datamodule_kwargs={"episodes": EPISODES, "sampling": SAMPLING, **kwargs.pop("datamodule_kwargs", {})},
        **sgd(LR),
        **kwargs,
    )


def _update_difference(initial: dict, a: dict, b: dict) -> float:
    moved = torch.cat([(a[k] - initial[k]).flatten() for k in initial]).double()
    apart = torch.cat([(a[k] - b[k]).flatten() for k in initial]).double()
    assert moved.norm() > 1e-3, "training did not move the weights: the comparison would prove nothing"
    return float(apart.norm() / moved.norm())


def test_environment_tokens_get_exactly_zero_gradient_and_no_place_in_the_normaliser():
    module, _ = _components()
    prompt, mask = [5, 6, 41], [1, 1, 0, 0, 0, 1, 1]
    completion = [7, 3, 30, 30, 41, 8, 1]  # a turn, three environment tokens, a turn
    trajectories = [
        Trajectory(
            0, s, 0, prompt, completion[: 7 - s], [-1.0] * (7 - s), 0.0, [1.0, -1.0][s], False, loss_mask=mask[: 7 - s]
        )
        for s in range(2)
    ]
    batch = collate(trajectories, pad_id=0, packing="shared_prompt")
    assert batch.completion_mask.tolist() == [
        [True, True, False, False, False, True, True],
        [True, True, False, False, False, True, False],
    ]
    logp = module.completion_logprobs(module.policy, batch).detach().requires_grad_()
    objective = GRPOObjective(loss_aggregation="token-mean")
    terms = objective(logp, logp.detach(), None, batch.advantages, batch.completion_mask)
    assert float(terms.normaliser) == 4 + 3  # the model's tokens only
    (gradient,) = torch.autograd.grad(terms.loss_sum, logp)
    assert torch.count_nonzero(gradient[:, 2:5]) == 0
    assert torch.count_nonzero(gradient[batch.completion_mask]) == 7


def _token_mean_reference(initial_policy, recorder: BatchRecorder, iteration: int) -> dict:
    """One iteration of token-mean GRPO on episodes written out plainly: one unpadded forward per episode, the
    loss summed over the model's tokens only and divided by their count over the iteration, one SGD step."""
    model = copy.deepcopy(initial_policy).train()
    total, tokens = 0.0, 0
    for epoch, batch in recorder.batches:
        if epoch != iteration:
            continue
        for t in batch.trajectories:
            sequence = t.prompt_tokens + t.completion_tokens
            logits = model(input_ids=torch.tensor([sequence])).logits[0, len(t.prompt_tokens) - 1 : -1]
            logp = logits.float().log_softmax(-1).gather(-1, torch.tensor(t.completion_tokens)[:, None])[:, 0]
            model_tokens = torch.tensor(t.loss_mask, dtype=torch.bool)
            total = total - (t.advantage * torch.exp(logp - logp.detach()))[model_tokens].sum()
            tokens += int(model_tokens.sum())
    (total / tokens).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class EpochEndWeights(BatchRecorder):
    def __init__(self) -> None:
        super().__init__()
        self.weights = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.weights.append(policy_state(pl_module))


def test_episodes_train_the_model_tokens_as_the_loss_written_out_and_every_episode_once():
    module, data = _components(objective=GRPOObjective(loss_aggregation="token-mean"), micro_batch_size=4)
    initial_policy, initial = copy.deepcopy(module.policy), policy_state(module)
    recorder = EpochEndWeights()
    fit(module, data, iterations=2, callbacks=[recorder])
    trained = recorder.samples()
    assert sorted(trained) == sorted({(e, p, s) for e, p, s in trained}) and len(trained) == 2 * 32
    episodes = [t for _, b in recorder.batches if b.pass_index == 0 for t in b.trajectories]
    turns = [sum(1 for i, m in enumerate(t.loss_mask) if m and (i == 0 or not t.loss_mask[i - 1])) for t in episodes]
    assert {1, 2, 3} <= set(turns), "the fit did not train episodes of several turns"
    assert any(t.advantage != 0 for t in episodes)
    reference = _token_mean_reference(initial_policy, recorder, iteration=0)
    assert _update_difference(initial, reference, recorder.weights[0]) < SAME_UPDATE


def test_sync_equals_async_and_the_split_and_layout_do_not_change_the_update_with_episodes():
    runs = {
        "async, micro-batch 8, packed": dict(mode="async", micro_batch_size=8, packing="shared_prompt", seed=1),
        "sync, micro-batch 16, padded": dict(mode="sync", micro_batch_size=16, packing="padded", seed=2),
        "async, micro-batch 4, padded": dict(mode="async", micro_batch_size=4, packing="padded", seed=3),
    }
    weights, orders = {}, {}
    for name, run in runs.items():
        pool = ShufflingPool(InProcessPool(), seed=run["seed"])
        module, data = _components(pool=pool, mode=run["mode"], micro_batch_size=run["micro_batch_size"])
        data.packing = Packing(run["packing"])
        initial = policy_state(module)
        fit(module, data, iterations=2)
        weights[name] = policy_state(module)
        orders[name] = [g.prompt_id for g in pool.returned[:8]]
    assert len({tuple(o) for o in orders.values()}) == 3, "the runs saw the groups in the same order"
    first, *others = weights.values()
    for other in others:
        assert _update_difference(initial, first, other) < SAME_UPDATE
