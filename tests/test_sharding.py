"""FSDP2 sharding for lit_parl's forward, in one process (a mesh of one rank): the log-probs through the root unit
equal the unsharded model's, and the frozen models (θ_k, the reference) are sharded again after each forward
instead of staying whole until a backward that never comes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lit_parl.kernels.forward import completion_logprobs
from lit_parl.model import tiny_qwen2
from lit_parl.sharding import shard_for_logprobs
from lit_parl.trajectory import Trajectory, collate


@pytest.fixture
def mesh():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def batch():
    trajectories = [
        Trajectory(prompt_id=p, sample_index=k, version=0, prompt_tokens=[1, 5 + p], completion_tokens=[3 + k, 4, 7][: 2 + k],
                   rollout_logprobs=[-0.5] * (2 + k), reward=float(k), advantage=0.0, truncated=False)
        for p in (0, 1) for k in (0, 1)
    ]
    return collate(trajectories, pad_id=0, sample_offset=0, packing="padded", group_size=2)


def test_sharded_logprobs_equal_the_models_and_frozen_models_are_resharded(mesh):
    tokens = batch().tokens
    policy, _ = tiny_qwen2(seed=3)
    frozen, _ = tiny_qwen2(seed=3)
    expected = completion_logprobs(policy, tokens, 1.0, 16)

    trained = shard_for_logprobs(policy, mesh)
    snapshot = shard_for_logprobs(frozen, mesh, frozen=True)
    with torch.no_grad():
        torch.testing.assert_close(snapshot(tokens, 1.0, 16, False), expected, rtol=1e-6, atol=1e-6)
    assert all(type(p).__name__ == "DTensor" for p in frozen.parameters()), "a frozen model stayed whole after its forward"

    logp = trained(tokens, 1.0, 16, False)
    torch.testing.assert_close(logp.detach(), expected, rtol=1e-6, atol=1e-6)
    logp.sum().backward()
    assert all(type(p).__name__ == "DTensor" for p in policy.parameters())
    head = policy.get_output_embeddings().weight
    assert type(head.grad).__name__ == "DTensor" and float(head.grad.full_tensor().abs().sum()) > 0, "the LM head got no gradient"


def test_the_strategies_lit_parl_does_not_support_are_refused_with_the_one_to_use():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lit_parl.parallel import check_strategy

    with pytest.raises(ValueError, match=r"use_orig_params=False.*default"):
        check_strategy(FSDPStrategy(use_orig_params=False))
    with pytest.raises(ValueError, match=r"auto_wrap_policy.*leave auto_wrap_policy unset"):
        check_strategy(FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear})))
    check_strategy(FSDPStrategy())
    with pytest.raises(ValueError, match=r"deepspeed.*normaliser.*trainer=fsdp2"):
        check_strategy(DeepSpeedStrategy.__new__(DeepSpeedStrategy))  # built without deepspeed installed
    check_strategy(DDPStrategy())
    check_strategy(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))


def test_a_pool_shared_by_every_rank_is_refused_under_two_ranks():
    from conftest import InProcessPool, make_components

    class SharedPool(InProcessPool):
        shared_across_ranks = True

    _, datamodule = make_components(pool=SharedPool())
    with pytest.raises(ValueError, match="SharedPool is one pool for all ranks.*pool=hf or pool=vllm"):
        datamodule._setup_ranks(2, 0)
