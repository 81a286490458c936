"""LoRA training (``GRPOModule(lora=...)``, ``lit_parl.models.lora``): the update against a reference built with
peft's own ``get_peft_model``, what is trained and what is not, θ_0 as the base model, and the merged weights the
pool and the export receive.

The reference is tests/trainer/test_training_step_reference.py's (one unpacked forward per sample, the loss from the
formulas, plain SGD), run on a peft model holding the same initial adapters: it calls neither lit_parl's LoRA code
nor its kernels, so the comparison is not equal by construction.
"""

from __future__ import annotations

import copy
import functools

import peft  # a dev dependency: missing, the suite fails rather than skips
import pytest
import torch
from lightning.pytorch import Callback
from trainer.test_training_step_reference import (
    ATOL,
    RTOL,
    DenseTask,
    MicroBatchRecorder,
    RecordingPool,
    reference_fit,
)
from transformers import AutoModelForCausalLM

from helpers.components import SAMPLING, fit, make_components
from lit_parl import GRPOObjective
from lit_parl.callbacks import HFExport
from lit_parl.callbacks.full_tensors import full_tensors
from lit_parl.models import tiny_qwen2
from lit_parl.models.lora import TRAINED, LoRASettings, adapter_parameters, add_lora
from lit_parl.rollout import HFRolloutPool
from lit_parl.trainer.tri_model import frozen_logprobs

LORA = LoRASettings(rank=4, alpha=8.0)
LR = 0.3
KL_AND_STEPS = {"beta": 0.5, "kl_estimator": "k3", "loss_aggregation": "token-mean", "clip_eps": 0.05}


def peft_twin(base: torch.nn.Module, module) -> torch.nn.Module:
    """``base`` (the initial policy, without adapters) under peft's own ``get_peft_model``, holding the module's
    initial adapter tensors (peft draws its own A at random)."""
    twin = peft.get_peft_model(copy.deepcopy(base), LORA.peft_config())
    mine = dict(adapter_parameters(module.policy, TRAINED))
    with torch.no_grad():
        for name, parameter in twin.named_parameters():
            if "lora_" in name:
                parameter.copy_(mine[name.removeprefix("base_model.model.")])
    return twin


def lora_fit(options: dict, iterations: int = 2, packing: str = "shared_prompt", **shape):
    pool = RecordingPool(HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1))
    base, _ = tiny_qwen2(seed=0)  # the policy make_components builds, before any adapter
    module, datamodule = make_components(
        pool=pool,
        task=DenseTask(seed=0),
        objective=GRPOObjective(**options),
        max_grad_norm=None,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
        lora=LORA,
        datamodule_kwargs={"packing": {"mode": packing}},
        **shape,
    )
    twin = peft_twin(base, module)
    recorder = MicroBatchRecorder()
    trainer = fit(module, datamodule, iterations, callbacks=[recorder])
    return base, module, pool, recorder, twin, trainer


@pytest.mark.parametrize(
    ("packing", "micro_batch_size", "checkpointing"),
    [("shared_prompt", 4, False), ("padded", 4, False), ("shared_prompt", 8, False), ("shared_prompt", 4, True)],
    ids=str,
)
def test_a_lora_fit_equals_a_per_sample_reference_built_with_peft(packing, micro_batch_size, checkpointing):
    """β > 0 (θ_0: the adapters off) and two mini-batches x two passes (θ_k: the adapter snapshot), packed and padded,
    at two micro-batch sizes, and with gradient checkpointing (the frozen base's activations recomputed; the
    layers' inputs need no gradient): every adapter tensor matches the reference's after two iterations."""
    shape = {"mini_batches": 2, "passes": 2, "micro_batch_size": micro_batch_size}
    shape |= {"gradient_checkpointing": True} if checkpointing else {}
    base, module, pool, recorder, twin, _ = lora_fit(KL_AND_STEPS, packing=packing, **shape)
    expected = reference_fit(twin, pool, recorder, KL_AND_STEPS, LR, SAMPLING.temperature)
    got = dict(adapter_parameters(module.policy, TRAINED))
    final = {k.removeprefix("base_model.model."): v for k, v in expected[-1].items() if "lora_" in k}
    initial = {k.removeprefix("base_model.model."): v.detach() for k, v in adapter_parameters(twin, TRAINED)}
    assert set(final) == set(got) == set(initial)
    moved = max(float((final[name] - initial[name]).abs().max()) for name in final)
    assert moved > 1e-3, f"the adapters barely moved ({moved:.2g}): the comparison would prove nothing"
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, final[name], atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")


class FirstBatch(Callback):
    def __init__(self) -> None:
        self.batch = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch = self.batch or batch


def test_only_the_adapters_train_and_the_reference_is_the_base_model(tmp_path):
    base, _ = tiny_qwen2(seed=0)
    module, datamodule = make_components(
        objective=GRPOObjective(beta=0.1), mini_batches=2, micro_batch_size=4, lora=LORA, lr=5e-2
    )
    first, export = FirstBatch(), HFExport(dirpath=str(tmp_path / "export"), merge_lora=True)
    trainer = fit(module, datamodule, 2, callbacks=[first, export])
    assert module.reference is None and module.old is None, "LoRA keeps no copy of the model"
    trained = {id(p) for _, p in adapter_parameters(module.policy, TRAINED)}
    optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert optimized == trained, "the optimizer must hold exactly the trained adapter"
    base_now = {k.replace(".base_layer", ""): v for k, v in module.policy.state_dict().items() if "lora_" not in k}
    for name, tensor in base.state_dict().items():
        assert torch.equal(base_now[name], tensor), f"the frozen base moved: {name}"
    batch = first.batch
    _, reference = frozen_logprobs(module, batch, logp=None)
    with torch.no_grad():
        assert torch.equal(reference, module.completion_logprobs(base, batch)), "θ_0 is not the base model"
        adapted = module.completion_logprobs(module.policy, batch)
    assert not torch.allclose(adapted, reference), "the adapters did not move the policy: the test proves nothing"
    # the export, merge_lora: the merged model, under the base model's names, loadable with transformers alone
    exported = AutoModelForCausalLM.from_pretrained(export.saved_to).eval()
    assert not any("lora_" in name or "base_layer" in name for name in exported.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(module.completion_logprobs(exported, batch), adapted, atol=1e-5, rtol=0)
    # and the adapter alone, as peft saves one: peft loads it onto the base model the run started from
    reloaded = peft.PeftModel.from_pretrained(tiny_qwen2(seed=0)[0], export.saved_to / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(
            module.completion_logprobs(reloaded.get_base_model(), batch), adapted, atol=1e-5, rtol=0
        )


def test_the_pool_loads_the_merged_weights_every_iteration():
    """The on-policy check compares every group's rollout log-probs with θ_k's: it passes only if the pool
    generated with base + (α / r) B A after each push (the adapters move from the first step on)."""
    module, datamodule = make_components(micro_batch_size=4, mini_batches=2, lora=LORA, lr=5e-2)
    fit(module, datamodule, 3)
    assert datamodule.launcher.logprob_tolerance() is not None, "the on-policy check must be on"
    assert [name for name, _ in full_tensors(module.policy)] == [name for name, _ in tiny_qwen2()[0].named_parameters()]


def test_the_export_writes_the_adapter_and_the_merged_model_only_on_request(tmp_path):
    module, datamodule = make_components(micro_batch_size=4, lora=LORA, lr=5e-2)
    export = HFExport(dirpath=str(tmp_path / "export"))
    fit(module, datamodule, 1, callbacks=[export])
    assert (export.saved_to / "adapter" / "adapter_model.safetensors").exists()
    assert (export.saved_to / "adapter" / "adapter_config.json").exists()
    assert not list(export.saved_to.glob("*.safetensors")), "the merged model was written without merge_lora"


def test_lora_on_a_layer_other_than_linear_is_refused():
    """peft's embedding LoRA names its tensors otherwise: the merge would drop that layer's weight, so it is refused."""
    with pytest.raises(ValueError, match=r"LoRA on model.embed_tokens \(Embedding\): .* linear layers only"):
        add_lora(tiny_qwen2()[0], LoRASettings(rank=4, target_modules=("q_proj", "embed_tokens")))


def test_a_lora_layer_whose_adapter_tensors_never_come_is_an_error_not_a_lost_weight():
    from lit_parl.callbacks.full_tensors import lora_layers

    policy = add_lora(tiny_qwen2()[0], LORA)
    name, layer = next(iter(lora_layers(policy).items()))
    del layer.lora_A[TRAINED]  # as an adapter layer of another kind would look to the merge
    with pytest.raises(RuntimeError, match=rf"LoRA layers \['{name}'\] gave no lora_A/lora_B weights to merge"):
        list(full_tensors(policy))
