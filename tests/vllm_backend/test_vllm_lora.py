"""vLLM (the pinned CPU build) serving a LoRA policy as base + adapter (``VLLMRolloutPool(lora="adapter")``): the
real engine loads each version's adapter (peft's names and config, written as peft writes an adapter directory)
with its own ``LoRARequest``, every sample runs with it, and the log-probs are the trainer's of the merged
policy, version after version, also from a worker that replaced a killed one.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import signal
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here; `make test-vllm` runs these tests", allow_module_level=True)

from lit_parl.callbacks.full_tensors import (  # noqa: E402
    base_tensors,
    full_tensors,
    lora_adapter_config,
    lora_adapter_tensors,
)
from lit_parl.models.lora import LoRASettings, add_lora  # noqa: E402
from lit_parl.rollout import VLLMRolloutPool  # noqa: E402
from lit_parl.rollout.records import SamplingParams  # noqa: E402
from vllm_backend.test_vllm_backend import (  # noqa: E402
    KV_CACHE,
    group_requests,
    logprob_mismatches,
    max_logprob_gap,
    save_spec,
    tiny,
    vllm_job,
)

SAMPLING = SamplingParams(max_new_tokens=6, temperature=0.8)


def draw_adapter(policy, seed: int) -> None:
    """Give the adapters' B (zero at the start) values, so that the adapter moves the model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def merged_model(policy, like):
    """A plain model holding ``policy``'s merged weights (what the trainer's θ_k computes)."""
    merged, full = copy.deepcopy(like), dict(full_tensors(policy))
    with torch.no_grad():
        for name, parameter in merged.named_parameters():  # a tied head is the embedding's parameter
            parameter.copy_(full[name])
    return merged.eval()


def tiny_llama():
    """The tiny model's sizes as a Llama (SmolLM2's architecture): vLLM's LoRA then wraps its logits processor
    too (Llama lists lm_head among its LoRA modules), under which the pool folds the temperature."""
    from transformers import LlamaConfig, LlamaForCausalLM

    qwen, tokenizer = tiny()
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = LlamaConfig(
        **{key: getattr(qwen.config, key) for key in keys},
        num_key_value_heads=qwen.config.num_key_value_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def adapted(request, tmp_path_factory):
    model, tokenizer = tiny() if request.param == "qwen2" else tiny_llama()
    pool = VLLMRolloutPool(kv_cache_memory_bytes=KV_CACHE, lora="adapter", max_lora_rank=8)
    shared_memory = set(os.listdir("/dev/shm"))
    pool.start(save_spec(model, tokenizer, tmp_path_factory.mktemp("spec") / "model"))
    yield pool, model, tokenizer
    made = [n for n in set(os.listdir("/dev/shm")) - shared_memory if n.startswith("lit_parl_vllm_")]
    written = [v for n in made for v in os.listdir(f"/dev/shm/{n}")]
    pool.close()
    # each version's adapter was written in the pool's one scratch directory, in memory, which close removes
    assert len(made) == 1 and written, (made, written)
    assert not os.path.exists(f"/dev/shm/{made[0]}"), "close left the pool's scratch directory"


def test_each_versions_adapter_is_served_and_the_logprobs_are_the_merged_policys(adapted):
    pool, model, tokenizer = adapted
    policy = add_lora(copy.deepcopy(model), LoRASettings(rank=4, alpha=8.0))
    pool.sync_weights([list(base_tensors(policy))], version=0)  # the base, once, as WeightSync sends it
    for version, seed in ((0, 1), (1, 2)):
        draw_adapter(policy, seed)
        pool.sync_adapter([list(lora_adapter_tensors(policy))], lora_adapter_config(policy), version)
        requests = group_requests(tokenizer, version, range(4))
        groups = list(pool.generate(requests, SAMPLING))
        assert {g.version for g in groups} == {version}
        merged = merged_model(policy, model)
        assert max_logprob_gap(merged, requests, groups, SAMPLING.temperature) < 1e-4
        assert max_logprob_gap(model, requests, groups, SAMPLING.temperature) > 1e-2, "the base alone sampled them"
    # a worker killed now is replaced by one that loads the base, then the adapter it held
    killed = pool.pids()[0]
    os.kill(killed, signal.SIGKILL)
    requests = group_requests(tokenizer, 1, range(4, 8))
    groups = list(pool.generate(requests, SAMPLING))
    assert pool.health().details["restarts"] == 1 and pool.pids()[0] != killed
    assert max_logprob_gap(merged_model(policy, model), requests, groups, SAMPLING.temperature) < 1e-4


def test_an_adapter_above_the_engines_rank_is_refused_before_it_is_sent(adapted):
    pool, model, _ = adapted
    policy = add_lora(copy.deepcopy(model), LoRASettings(rank=16, alpha=32.0))
    with pytest.raises(ValueError, match=r"rank 16 is above the engines' max_lora_rank 8: set pool.max_lora_rank=16"):
        pool.sync_adapter([list(lora_adapter_tensors(policy))], lora_adapter_config(policy), 5)


def test_a_pool_that_merges_refuses_an_adapter():
    with pytest.raises(RuntimeError, match="was not set up to load LoRA adapters"):
        VLLMRolloutPool().sync_adapter([], {}, 0)


def test_the_adapter_directory_is_what_vllms_own_loader_reads(tmp_path):
    """The directory ``write_adapter`` leaves, read by vLLM's ``PEFTHelper`` and ``LoRAModel`` as ``add_lora`` does."""
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from lit_parl.rollout.vllm_engine import write_adapter

    model, _ = tiny()
    policy = add_lora(copy.deepcopy(model), LoRASettings(rank=4, alpha=8.0))
    draw_adapter(policy, 0)
    tensors = dict(lora_adapter_tensors(policy))
    directory = write_adapter(tensors, lora_adapter_config(policy), 3, str(tmp_path))
    helper = PEFTHelper.from_local_dir(str(directory), max_position_embeddings=None)
    helper.validate_legal(LoRAConfig(max_lora_rank=8))
    assert (helper.r, helper.lora_alpha, helper.vllm_lora_scaling_factor) == (4, 8.0, 2.0)
    layers = {name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for name in tensors}
    supported = {layer.rsplit(".", 1)[1] for layer in layers}  # what the engine passes: the model's module names
    loaded = LoRAModel.from_local_checkpoint(str(directory), supported, helper, lora_model_id=4, device="cpu")
    assert set(loaded.loras) == layers
    for module, weights in loaded.loras.items():  # each layer's A as sent (B carries the scale in vLLM)
        a = tensors[f"base_model.model.{module}.lora_A.weight"]
        assert torch.equal(weights.lora_a, a), module
    assert Path(directory).parent == tmp_path


def test_a_lora_fit_through_the_cli_sends_the_adapters_alone_and_stays_on_policy(tmp_path):
    """``lit-parl lora=r16 pool=vllm pool.lora=adapter``: three iterations with the on-policy check at the float32
    bound, the base pushed once and an adapter each iteration (the workers' version follows), the adapters moved."""
    module, datamodule, trainer = vllm_job(tmp_path, "lora=r16", "pool.lora=adapter", "optimizer.lr=5e-2")
    pool = datamodule.pool
    pushes = []
    sync_weights, sync_adapter = pool.sync_weights, pool.sync_adapter
    pool.sync_weights = lambda buckets, version: (pushes.append(("base", version)), sync_weights(buckets, version))
    pool.sync_adapter = lambda buckets, config, version: (
        pushes.append(("adapter", version)),
        sync_adapter(buckets, config, version),
    )
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        pool.close()
    assert pushes == [("base", 0), ("adapter", 0), ("adapter", 1), ("adapter", 2)]
    assert [s.version for s in datamodule.history] == [0, 1, 2]
    mismatch = logprob_mismatches(tmp_path)
    assert len(mismatch) == 3 and max(mismatch) < 1e-4, f"rollout vs trainer log-probs: {mismatch}"
    moved = max(float(p.detach().abs().max()) for n, p in module.policy.named_parameters() if ".lora_B." in n)
    assert moved > 1e-3, "the adapters did not move: the later iterations' check proves nothing"
