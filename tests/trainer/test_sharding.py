"""FSDP2 sharding for lit_parl's forward, in one process (a mesh of one rank): the log-probs through the root unit
equal the unsharded model's, and the frozen models (θ_k, the reference) are sharded again after each forward
instead of staying whole until a backward that never comes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.models import tiny_qwen2
from lit_parl.trainer.strategies.fsdp2 import shard_for_logprobs


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
        Trajectory(
            prompt_id=p,
            sample_index=k,
            version=0,
            prompt_tokens=[1, 5 + p],
            completion_tokens=[3 + k, 4, 7][: 2 + k],
            rollout_logprobs=[-0.5] * (2 + k),
            reward=float(k),
            advantage=0.0,
            truncated=False,
        )
        for p in (0, 1)
        for k in (0, 1)
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
    assert all(type(p).__name__ == "DTensor" for p in frozen.parameters()), (
        "a frozen model stayed whole after its forward"
    )

    logp = trained(tokens, 1.0, 16, False)
    torch.testing.assert_close(logp.detach(), expected, rtol=1e-6, atol=1e-6)
    logp.sum().backward()
    assert all(type(p).__name__ == "DTensor" for p in policy.parameters())
    head = policy.get_output_embeddings().weight
    assert type(head.grad).__name__ == "DTensor" and float(head.grad.full_tensor().abs().sum()) > 0, (
        "the LM head got no gradient"
    )


def test_the_strategy_settings_lit_parl_cannot_run_under_are_refused_with_the_one_to_use():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from lit_parl.trainer.strategies import adapter_for

    def prepare(strategy, max_grad_norm=1.0):
        adapter_for(strategy).prepare(max_grad_norm, micro_batch_size=4)
        return strategy

    with pytest.raises(ValueError, match=r"use_orig_params=False.*default"):
        prepare(FSDPStrategy(use_orig_params=False))
    with pytest.raises(ValueError, match=r"auto_wrap_policy.*leave auto_wrap_policy unset"):
        prepare(FSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear})))
    with pytest.raises(ValueError, match=r"ZeRO stage 1.*stages 2 and 3"):
        prepare(DeepSpeedStrategy(stage=1))
    with pytest.raises(ValueError, match=r"clips gradients at 0.5.*max_grad_norm=1.0.*remove gradient_clipping"):
        prepare(DeepSpeedStrategy(config={"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}))
    with pytest.raises(ValueError, match=r"check_grad_overflow or zero_optimization.compute_grad_norm"):
        prepare(
            DeepSpeedStrategy(
                config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "check_grad_overflow": False}}
            )
        )
    # FSDP1 under bf16: parameters in bf16, but buffers (RoPE's inv_freq) and the ranks' gradient sums in float32
    from lightning.pytorch.plugins.precision import FSDPPrecision

    mixed = prepare(FSDPStrategy(precision_plugin=FSDPPrecision("bf16-mixed"))).mixed_precision_config
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.buffer_dtype) == (torch.bfloat16, torch.float32, torch.float32)
    config = prepare(DeepSpeedStrategy(stage=3), max_grad_norm=None).config  # the module's settings, given to DeepSpeed
    assert config["gradient_clipping"] == 0.0 and config["train_micro_batch_size_per_gpu"] == 4
    for strategy in (
        FSDPStrategy(),
        DDPStrategy(),
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    ):
        prepare(strategy)


@pytest.mark.parametrize(
    "preset, expected",
    [
        ("fsdp", {"class": "FSDPStrategy", "state_dict_type": "sharded"}),
        ("deepspeed", {"class": "DeepSpeedStrategy", "stage": 2}),
        ("fsdp2", {"class": "ModelParallelStrategy"}),
        ("ddp", {"class": "DDPStrategy"}),
    ],
)
def test_every_strategy_preset_builds_its_strategy_and_passes_the_module_checks(preset, expected):
    """The trainer presets of docs/strategies.md's table compose and build the strategy they name, which the module's
    checks accept (the GPU-only ones are not run here: the 2-process tests build the same strategies)."""
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    from lit_parl.trainer.strategies import adapter_for

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"trainer={preset}"])
    strategy = instantiate(cfg.trainer.strategy)
    assert type(strategy).__name__ == expected["class"]
    if "state_dict_type" in expected:
        assert strategy._state_dict_type == expected["state_dict_type"]
    if "stage" in expected:
        assert strategy.config["zero_optimization"]["stage"] == expected["stage"]
    adapter_for(strategy).prepare(max_grad_norm=1.0, micro_batch_size=4)
