"""Micro-batch collation (packed and padded), the module's log-probs of a collated batch against a plain forward,
and the datamodule's transfer of a micro-batch to a device."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.sampling_references import completion_logprobs_reference
from lit_parl import GRPOModule, GRPOObjective, IterationShape
from lit_parl.data.micro_batch import Trajectory, collate

SHAPE = IterationShape(prompts=1, group_size=4, micro_batch_size=4)


def _ids(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text).input_ids)


def _trajectories(tok):
    rows = [
        ("3917=", [4, 12, 9, 1], 0.8),
        ("5=", [7, 1], -0.5),
        ("804213=", [3, 3, 3, 5, 6, 8], 0.1),
        ("12=", [1], -0.4),
    ]
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
        torch.testing.assert_close(
            batch.rollout_logprobs[i, : len(t.completion_tokens)], torch.tensor(t.rollout_logprobs)
        )
        assert torch.all(batch.rollout_logprobs[i][~batch.completion_mask[i]] == 0)
    if packing == "padded":
        assert tokens.attention is None and tokens.input_ids.shape[0] == 5
        for i, t in enumerate(ordered):
            row = t.prompt_tokens + t.completion_tokens[:-1]
            assert tokens.input_ids[i, : len(row)].tolist() == row
    else:  # prompt 10 appears once for its two samples
        assert tokens.input_ids.shape[0] == 1
        assert tokens.tokens_computed == sum(len(t.prompt_tokens) for t in trajectories[:4]) + sum(
            len(t.completion_tokens) - 1 for t in ordered
        )
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
        expected = completion_logprobs_reference(model, t.prompt_tokens, t.completion_tokens, temperature)
        torch.testing.assert_close(
            logp[i][batch.completion_mask[i]].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=0
        )


def test_micro_batch_transfer_skips_the_walk_on_its_own_device_and_moves_everything_otherwise(model, tok):
    trajectories = _trajectories(tok)
    batch = collate(trajectories, tok.pad_token_id, sample_offset=0, packing="shared_prompt")
    from helpers.components import make_components

    _, datamodule = make_components()
    assert datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0) is batch
    moved = datamodule.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved.advantages.is_meta and moved.tokens.input_ids.is_meta
    assert moved.tokens.attention.segment_ids.is_meta and moved.tokens.attention.buckets[0].allowed.is_meta
    assert moved.trajectories is batch.trajectories and moved.trajectories  # the logs' records stay on the CPU
