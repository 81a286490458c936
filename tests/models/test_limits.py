"""Static limits fail when the objects are built, before any engine process starts (lit_parl/models/limits.py)."""

from __future__ import annotations

import pytest

from lit_parl import GRPOModule, GRPOObjective, IterationShape, RolloutDataModule, tiny_qwen2
from lit_parl.models.limits import micro_batch_bytes
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.records import SamplingParams
from lit_parl.tasks import CopyTask, positional_reward


def _datamodule(pool, max_new_tokens: int) -> RolloutDataModule:
    policy, tokenizer = tiny_qwen2()
    shape = IterationShape(prompts=8, group_size=4, micro_batch_size=8)
    return RolloutDataModule(
        CopyTask(),
        [positional_reward],
        pool,
        tokenizer,
        shape,
        GRPOObjective(),
        policy,
        sampling=SamplingParams(max_new_tokens=max_new_tokens),
    )


def test_a_completion_longer_than_the_context_is_refused_before_the_pool_starts():
    pool = HFRolloutPool()
    context = tiny_qwen2()[0].config.max_position_embeddings
    _datamodule(pool, max_new_tokens=context - 5)  # the longest digit prompt (5 tokens) plus the completion: fits
    with pytest.raises(ValueError, match=r"row \d+: the prompt has 5 tokens, more than the limit of 1"):
        _datamodule(pool, max_new_tokens=context - 1)  # room for one prompt token: each prompt is checked, by row
    with pytest.raises(
        ValueError, match=rf"sampling.max_new_tokens={context} does not fit this model's context of {context} tokens"
    ):
        _datamodule(pool, max_new_tokens=context)
    assert not pool.health().started


def test_the_pool_checks_its_own_capacity_at_construction():
    class SmallPool(HFRolloutPool):
        def check_capacity(self, shape, sampling):
            if sampling.max_new_tokens > 16:
                raise ValueError("this pool's engines hold 16 new tokens")

    _datamodule(SmallPool(), max_new_tokens=16)
    with pytest.raises(ValueError, match="hold 16 new tokens"):
        _datamodule(SmallPool(), max_new_tokens=17)


def test_a_micro_batch_over_the_memory_budget_is_refused_at_construction():
    policy, _ = tiny_qwen2()
    shape = IterationShape(prompts=64, group_size=8, micro_batch_size=64)
    need = micro_batch_bytes(policy.config, 64, 40, 1024) / 2**30
    GRPOModule(policy, GRPOObjective(), shape, memory_budget_gib=need * 1.01, max_sample_tokens=40)
    with pytest.raises(
        ValueError,
        match=r"a micro-batch of 64 samples of up to 40 tokens needs about .* GiB .* lower shape.micro_batch_size",
    ):
        GRPOModule(policy, GRPOObjective(), shape, memory_budget_gib=need * 0.99, max_sample_tokens=40)
    # without max_sample_tokens the model's context is the bound: 512 tokens here, far more memory
    with pytest.raises(ValueError, match="of up to 512 tokens"):
        GRPOModule(policy, GRPOObjective(), shape, memory_budget_gib=need * 1.01)


def test_the_estimate_grows_with_the_micro_batch_and_the_chunk():
    config = tiny_qwen2()[0].config
    one = micro_batch_bytes(config, 8, 32, logprob_chunk_size=1)
    assert micro_batch_bytes(config, 16, 32, logprob_chunk_size=1) > 1.9 * one
    assert micro_batch_bytes(config, 8, 32, logprob_chunk_size=256) > micro_batch_bytes(
        config, 8, 32, logprob_chunk_size=16
    )


def test_the_vllm_pool_checks_its_settings_without_starting_an_engine():
    """Constructor-level: nothing of vLLM is imported or started (this runs in the main environment)."""
    from lit_parl.rollout import VLLMRolloutPool
    from lit_parl.rollout.rollout_pool import BF16_LOGPROB_TOLERANCE, FP32_LOGPROB_TOLERANCE

    _datamodule(VLLMRolloutPool(max_model_len=8), max_new_tokens=7)
    with pytest.raises(
        ValueError, match=r"VLLMRolloutPool\(max_model_len=8\) cannot hold a prompt and sampling.max_new_tokens=8"
    ):
        _datamodule(VLLMRolloutPool(max_model_len=8), max_new_tokens=8)
    with pytest.raises(ValueError, match="the pool sets the log-prob mode itself"):
        VLLMRolloutPool(engine_kwargs={"logprobs_mode": "processed_logprobs"})
    assert VLLMRolloutPool(dtype="float32").logprob_tolerance() == FP32_LOGPROB_TOLERANCE
    assert VLLMRolloutPool(dtype="bfloat16").logprob_tolerance() == BF16_LOGPROB_TOLERANCE
