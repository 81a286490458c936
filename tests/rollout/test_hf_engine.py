"""The hf worker's engine takes synced weights without a copy of its own: its parameters become the pool's
shared tensors at the first sync (where the dtype matches), so every later sync is the pool's one copy."""

from __future__ import annotations

import torch

from lit_parl.models import tiny_qwen2
from lit_parl.rollout.hf_pool import HFEngine
from lit_parl.rollout.records import GroupRequest, SamplingParams
from lit_parl.rollout.sampling import sample_groups


def _engine_and_policy(directory):
    policy, tokenizer = tiny_qwen2(seed=3)
    policy.save_pretrained(directory)
    return HFEngine(directory, tokenizer.eos_token_id, tokenizer.pad_token_id, threads=1), policy, tokenizer


def _shared(policy, dtype=None) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(dtype or p.dtype, copy=True).share_memory_() for name, p in policy.named_parameters()}


def test_the_engine_holds_the_shared_tensors_so_a_later_sync_is_the_pools_copy_alone(tmp_path):
    engine, policy, tokenizer = _engine_and_policy(tmp_path)
    shared = _shared(policy)
    engine.load(shared, version=0)
    parameters = dict(engine.model.named_parameters())
    assert all(parameters[name].data_ptr() == tensor.data_ptr() for name, tensor in shared.items())
    # the pool's next sync writes the shared tensors; the engine samples with them once it is told
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            parameter.mul_(1.5)
            shared[name].copy_(parameter)
    engine.load(shared, version=1)
    # still, for the next
    assert all(parameters[name].data_ptr() == tensor.data_ptr() for name, tensor in shared.items())
    request = GroupRequest(prompt_id=0, prompt_tokens=(4, 5, 41), version=1, seeds=(7, 8))
    sampling = SamplingParams(max_new_tokens=4)
    ids = tokenizer.eos_token_id, tokenizer.pad_token_id
    [ours] = list(sample_groups(engine.model, [request], sampling, *ids))
    [reference] = list(sample_groups(policy.eval(), [request], sampling, *ids))
    assert ours.completions == reference.completions and ours.logprobs == reference.logprobs


def test_a_policy_of_another_dtype_is_copied_into_the_engines_own_weights(tmp_path):
    engine, policy, _ = _engine_and_policy(tmp_path)
    shared = _shared(policy, torch.bfloat16)
    engine.load(shared, version=0)
    for name, parameter in engine.model.named_parameters():
        assert parameter.dtype == torch.float32 and parameter.data_ptr() != shared[name].data_ptr()
        torch.testing.assert_close(parameter, shared[name].float(), rtol=0, atol=0)
