"""The per-group acceptance made cheaper (issue 29: fewer torch ops between training steps) is bit-identical
to the implementation it replaced, kept below verbatim but for its name as the reference.

Every trajectory field is compared exactly (floats by their bits) on random groups: ties (all-equal
rewards, exact zeros), rewards that float32 rounds, truncated samples under DAPO's overlong shaping, RLOO and
unscaled advantages, reward components with missing values, failed calls and episode loss masks.
"""

from __future__ import annotations

import dataclasses
import random
import struct

import pytest
import torch

from lit_parl.data.group_acceptor import GroupAcceptor
from lit_parl.data.micro_batch import Trajectory
from lit_parl.rollout.records import Group, GroupRequest
from lit_parl.trainer.grpo_objective import GRPOObjective


def reference_advantages(objective: GRPOObjective, rewards: torch.Tensor) -> torch.Tensor:
    if torch.all(rewards == rewards[0]):
        return torch.zeros_like(rewards)
    values = rewards.double()
    G = values.shape[0]
    if objective.advantage == "rloo":
        return ((values - values.mean()) * G / (G - 1)).to(rewards.dtype)
    centred = values - values.mean()
    if objective.scale_rewards:
        centred = centred / (values.std() + objective.eps)
    return centred.to(rewards.dtype)


def reference_accept(acceptor: GroupAcceptor, group: Group, request: GroupRequest) -> list[Trajectory]:
    rewards = torch.tensor(group.rewards, dtype=torch.float32)
    lengths = torch.tensor([len(c) for c in group.completions])
    truncated = torch.tensor([reason == "length" for reason in group.finish_reasons])
    shaped = acceptor.advantages.shape_rewards(rewards, lengths, truncated, acceptor.max_new_tokens)
    advantages = reference_advantages(acceptor.advantages, shaped)
    zero_variance = bool(torch.all(shaped == shaped[0]))
    prompt_tokens = list(request.prompt_tokens)
    reward_list, advantage_list, shaped_list, truncated_list = (
        rewards.tolist(),
        advantages.tolist(),
        shaped.tolist(),
        truncated.tolist(),
    )
    return [
        Trajectory(
            prompt_id=group.prompt_id,
            sample_index=sample,
            version=group.version,
            prompt_tokens=prompt_tokens,
            completion_tokens=list(group.completions[k]),
            rollout_logprobs=list(group.logprobs[k]),
            reward=reward_list[k],
            advantage=advantage_list[k],
            truncated=truncated_list[k],
            shaped_reward=shaped_list[k],
            correct=bool(acceptor.is_correct(reward_list[k])),
            zero_variance=zero_variance,
            reward_components={
                name: values[k] for name, values in group.reward_components.items() if values[k] is not None
            },
            reward_failures=tuple(name for name, positions in group.reward_failures.items() if k in positions),
            loss_mask=None if group.loss_masks is None else list(group.loss_masks[k]),
        )
        for k, sample in enumerate(group.sample_indices)
    ]


def bits(value):
    """Floats by their bits (0.0 and -0.0 differ, NaN equals itself); everything else as it is."""
    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, dict):
        return {k: bits(v) for k, v in value.items()}
    return value


def random_group(rng: random.Random, G: int, max_new_tokens: int, prompt_id: int) -> Group:
    kind = rng.choice(["ties", "zeros", "binary", "continuous", "rounding"])
    if kind == "ties":
        rewards = [rng.choice([0.25, 1.0, -3.5])] * G
    elif kind == "zeros":
        rewards = [0.0] * G
    elif kind == "binary":
        rewards = [float(rng.random() < 0.3) for _ in range(G)]
    elif kind == "continuous":
        rewards = [rng.gauss(0, 2) for _ in range(G)]
    else:  # values float32 rounds, some of them to the same float
        rewards = [0.1 + rng.choice([0.0, 1e-9, 3e-8]) for _ in range(G)]
    completions = [[rng.randrange(1, 60) for _ in range(rng.randint(1, max_new_tokens))] for _ in range(G)]
    reasons = ["length" if len(c) == max_new_tokens and rng.random() < 0.7 else "stop" for c in completions]
    components = {"r/a": [rng.random() if rng.random() < 0.8 else None for _ in range(G)]} if rng.random() < 0.5 else {}
    failures = {"r/b": sorted(rng.sample(range(G), rng.randint(1, G)))} if rng.random() < 0.3 else {}
    masks = [[rng.randint(0, 1) for _ in c] for c in completions] if rng.random() < 0.3 else None
    order = list(range(G))
    rng.shuffle(order)  # samples in arrival order
    return Group(
        prompt_id,
        3,
        order,
        completions,
        [[-rng.expovariate(1.0) for _ in c] for c in completions],
        rewards,
        reasons,
        components,
        failures,
        masks,
    )


@pytest.mark.parametrize(
    "objective",
    [
        GRPOObjective(),
        GRPOObjective(scale_rewards=False),
        GRPOObjective(advantage="rloo"),
        GRPOObjective(overlong_buffer=3, overlong_penalty=0.5),
    ],
    ids=["grpo", "unscaled", "rloo", "overlong"],
)
@pytest.mark.parametrize("seed", range(8))
def test_accept_bit_identical_to_the_reference(objective, seed):
    rng = random.Random(seed)
    G, max_new_tokens = rng.choice([2, 4, 8, 16]), 6
    acceptor = GroupAcceptor(objective, group_size=G, max_new_tokens=max_new_tokens)
    for prompt_id in range(40):
        group = random_group(rng, G, max_new_tokens, prompt_id)
        request = GroupRequest(prompt_id=prompt_id, prompt_tokens=(5, 6, 7), version=3, seeds=tuple(range(G)))
        got = acceptor.accept(group, {prompt_id: request}, version=3)
        expected = reference_accept(acceptor, group, request)
        assert len(got) == len(expected)
        for new, ref in zip(got, expected):
            for f in dataclasses.fields(Trajectory):
                a, b = getattr(new, f.name), getattr(ref, f.name)
                assert type(a) is type(b) and bits(a) == bits(b), (prompt_id, f.name, a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_advantages_bit_identical_to_the_reference(dtype):
    rng = random.Random(5)
    for objective in (GRPOObjective(), GRPOObjective(scale_rewards=False), GRPOObjective(advantage="rloo")):
        for _ in range(200):
            G = rng.choice([2, 3, 8, 16])
            values = [rng.choice([0.0, 1.0, 0.5, rng.gauss(0, 1)]) for _ in range(G)]
            rewards = torch.tensor(values, dtype=dtype)
            got, expected = objective.advantages(rewards), reference_advantages(objective, rewards)
            assert got.dtype == expected.dtype and torch.equal(got.view(-1), expected.view(-1))
            assert got.view(torch.int8).tolist() == expected.view(torch.int8).tolist()  # -0.0 vs 0.0 too
