"""Training precision and memory: bf16-mixed (float32 master weights, bfloat16 compute), the attention backend chosen
for the compute dtype, and gradient checkpointing of the policy's decoder layers, all on the CPU.

- Lightning's ``bf16-mixed`` runs the forward under CPU autocast in bfloat16, as it runs CUDA autocast on a GPU: a
  short fit shows the policy, θ_k and the reference stay float32, attention computes in bfloat16, and the optimizer's
  small updates (~4e-5 of a weight) are kept. The same fit with bfloat16 weights (``bf16-true``) loses them, and is
  warned about.
- Gradient checkpointing gives the gradient of the plain forward bit for bit (packed shared-prompt and padded
  micro-batches, float32 and under autocast, under FSDP2's and FSDP1's wrapping on one rank), recomputes each
  layer once in the backward, keeps far fewer tensors for it, and a short SGD fit ends with the same weights.
"""

from __future__ import annotations

import copy
import functools
import importlib.machinery
import random
import socket
import sys
import types

import pytest
import torch

from helpers.components import fit, make_components, policy_state, sgd
from helpers.pools import InProcessPool
from lit_parl import GRPOModule, GRPOObjective, IterationShape
from lit_parl.data.micro_batch import Packing
from lit_parl.kernels import attention as attention_module
from lit_parl.kernels import backends as backends_module
from lit_parl.kernels.backends import resolve_backend
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import pack
from lit_parl.models import tiny_qwen2
from lit_parl.trainer.precision import enable_checkpointing


# ------------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------------
def compose(*overrides: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def test_the_gpu_preset_is_bf16_mixed_and_every_strategy_preset_takes_it():
    """``trainer=gpu``: one GPU in bf16-mixed. The strategy presets take ``trainer.accelerator=gpu
    trainer.precision=bf16-mixed`` as plain overrides (the CPU preset they build on names ``precision``)."""
    trainer = compose("trainer=gpu").trainer
    assert (trainer.accelerator, trainer.devices, trainer.precision) == ("gpu", 1, "bf16-mixed")
    assert compose().trainer.precision == "32-true"
    for preset in ("ddp", "fsdp2", "fsdp", "deepspeed"):
        trainer = compose(f"trainer={preset}", "trainer.accelerator=gpu", "trainer.precision=bf16-mixed").trainer
        assert (trainer.accelerator, trainer.precision) == ("gpu", "bf16-mixed"), preset
    assert compose("module.gradient_checkpointing=true").module.gradient_checkpointing is True


# ------------------------------------------------------------------------------------------------------
# bf16-mixed: float32 master weights, bfloat16 compute
# ------------------------------------------------------------------------------------------------------
def short_fit(precision: str, monkeypatch, **module_kwargs):
    """Two iterations of 2 optimizer steps (θ_k kept), β > 0 (the reference kept), packed micro-batches, plain SGD
    at lr 1e-3 (updates of ~4e-5 of a weight); returns the module, the weights before, and the dtypes attention saw."""
    seen = []
    sdpa = attention_module._KERNELS["sdpa"]

    def spy(query, key, value, *args):
        seen.append((query.dtype, key.dtype, value.dtype))
        return sdpa(query, key, value, *args)

    monkeypatch.setitem(attention_module._KERNELS, "sdpa", spy)
    module, data = make_components(
        pool=InProcessPool(),
        objective=GRPOObjective(beta=0.04),
        mini_batches=2,
        datamodule_kwargs={"packing": Packing("shared_prompt")},
        **sgd(1e-3),
        **module_kwargs,
    )
    before = policy_state(module)
    trainer = fit(module, data, iterations=2, precision=precision)
    assert trainer.global_step == 4 and module._backend == "sdpa"
    return module, before, seen


def changed_share(before: dict, after: dict, dtype=None) -> float:
    """The share of weights that differ, compared in ``dtype`` (``None``: as stored)."""
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    changed = [(cast(after[name]) != cast(before[name].to(after[name].dtype))).flatten() for name in before]
    return float(torch.cat(changed).float().mean())


def test_a_bf16_mixed_fit_keeps_float32_weights_and_their_small_updates(monkeypatch):
    module, before, seen = short_fit("bf16-mixed", monkeypatch)
    # the forward of all three models computed attention in bfloat16 (3 models x 2 layers x 8 micro-batches)
    assert len(seen) == 3 * 2 * 8 and set(seen) == {(torch.bfloat16,) * 3}
    for model in (module.policy, module.old, module.reference):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    after = policy_state(module)
    relative = torch.cat([((after[n] - before[n]).abs() / before[n].abs().clamp(min=1e-30)).flatten() for n in before])
    assert float(relative.median()) < 2**-9  # below half a bfloat16 step: bfloat16 weights could not hold them
    assert changed_share(before, after) > 0.9  # float32 kept (nearly) every one
    assert changed_share(before, after, torch.bfloat16) < 0.2  # rounded to bfloat16, most are gone


def test_under_autocast_the_heads_backward_differentiates_the_logits_its_forward_computed():
    """The chunked LM-head kernel recomputes its logits in the backward, outside autocast: it must get them in the
    forward's bfloat16, not in float32. Against autograd through the same bfloat16 logits (temperature 0.1
    magnifies their rounding), every gradient below the head is equal to float32 rounding; the tied head's own
    weight gets a bfloat16 gradient (rounded once more)."""
    import torch.nn.functional as F

    model = tiny_qwen2(seed=0)[0]
    tokens, temperature = micro_batch(False), 0.1
    weights = (
        torch.randn(tokens.completion_mask.shape, generator=torch.Generator().manual_seed(1)) * tokens.completion_mask
    )

    def reference():
        hidden = model.get_decoder()(input_ids=tokens.input_ids, use_cache=False).last_hidden_state
        selected = hidden.reshape(-1, hidden.shape[-1])[tokens.label_positions]
        logits = F.linear(selected.bfloat16(), model.get_output_embeddings().weight.bfloat16())
        logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens.label_targets[:, None])[:, 0]
        return (
            logp.new_zeros(tokens.completion_mask.numel())
            .scatter(0, tokens.label_slots, logp)
            .view(tokens.completion_mask.shape)
        )

    results = []
    for compute in (lambda: completion_logprobs(model, tokens, temperature), reference):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = compute()
        (logp * weights).sum().backward()
        results.append((logp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (logp, grads), (expected_logp, expected) = results
    torch.testing.assert_close(logp, expected_logp, rtol=0, atol=1e-6)
    head = "model.embed_tokens.weight"  # tied: the head's weight
    for name, grad in grads.items():
        scale = float(expected[name].abs().max())
        if name == head:
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=2e-2 * scale, msg=name)
        else:
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6 * scale, msg=name)


def test_bfloat16_weights_lose_the_small_updates_and_are_warned_about(monkeypatch):
    with pytest.warns(
        UserWarning, match=r"trained in half precision.*precision='bf16-true'.*updates smaller than about 2\^-8"
    ):
        module, before, seen = short_fit("bf16-true", monkeypatch)
    assert {p.dtype for p in module.policy.parameters()} == {torch.bfloat16}
    assert changed_share(before, policy_state(module)) < 0.1  # the same steps as above, almost all rounded away


def test_a_policy_loaded_in_bfloat16_is_warned_about_and_the_compute_dtype_follows_the_precision():
    from types import SimpleNamespace

    policy, _ = tiny_qwen2()
    module = GRPOModule(
        policy.to(torch.bfloat16), GRPOObjective(), IterationShape(prompts=2, group_size=2, micro_batch_size=4)
    )
    module._trainer = SimpleNamespace(precision="bf16-mixed", strategy=None)
    with pytest.warns(
        UserWarning, match=r"half precision \(the policy was loaded in torch.bfloat16\).*model.dtype=float32"
    ):
        module.setup("fit")
    float32 = GRPOModule(tiny_qwen2()[0], GRPOObjective(), IterationShape(prompts=2, group_size=2, micro_batch_size=4))
    assert float32.compute_dtype("bf16-mixed") == float32.compute_dtype("bf16-true") == torch.bfloat16
    assert float32.compute_dtype("32-true") == torch.float32 and module.compute_dtype("32-true") == torch.bfloat16


def test_auto_attention_for_the_trainers_precision_on_cuda(monkeypatch):
    """With flash-attn installed (a stand-in: only its presence matters here), ``auto`` on CUDA picks flash for
    bf16-mixed and flex for 32-true, and so does the module at fit start; an explicit flash under 32-true is
    refused naming the fix."""
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    module = GRPOModule(tiny_qwen2()[0], GRPOObjective(), IterationShape(prompts=2, group_size=2, micro_batch_size=4))
    assert resolve_backend("auto", "cuda", module.compute_dtype("bf16-mixed")) == "flash"
    assert resolve_backend("auto", "cuda", module.compute_dtype("32-true")) == "flex"
    with pytest.raises(ValueError, match=r"'flash' computes in float16/bfloat16 only.*trainer=gpu"):
        resolve_backend("flash", "cuda", module.compute_dtype("32-true"))
    # the module resolves at fit start for its trainer's precision (the device's backends as on CUDA with flash-attn)
    from types import SimpleNamespace

    monkeypatch.setattr(backends_module, "available_backends", lambda device: ["sdpa", "dense", "flex", "flash"])
    for precision, expected in (("bf16-mixed", "flash"), ("32-true", "flex")):
        module._trainer = SimpleNamespace(precision=precision)
        module.on_fit_start()
        assert module._backend == expected, precision


# ------------------------------------------------------------------------------------------------------
# gradient checkpointing
# ------------------------------------------------------------------------------------------------------
def micro_batch(shared_prompt: bool):
    rng = random.Random(0)
    groups = [
        (
            [rng.randrange(3, 14) for _ in range(P)],
            [[rng.randrange(3, 14) for _ in range(rng.randint(1, 6))] for _ in range(G)],
        )
        for P, G in ((5, 4), (1, 3), (9, 4))
    ]
    tokens = pack(groups, 0, shared_prompt=shared_prompt, max_row_tokens=24 if shared_prompt else None)
    if shared_prompt:
        tokens.attention.backend = "sdpa"
    return tokens


def count_layer_forwards(model) -> list[int]:
    """Counts entries into the first decoder layer's MLP (a recomputation stops once it has what the backward
    needs, before the MLP returns, so its forward hooks would not see it)."""
    calls = [0]
    mlp = model.get_decoder().layers[0].mlp
    forward = mlp.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)

    mlp.forward = counted
    return calls


def logprobs_and_gradients(model, tokens, compute=None):
    """Log-probs and every parameter's gradient of a weighted sum of them, with the bytes autograd saved."""
    compute = compute or functools.partial(completion_logprobs, model, tokens, 0.7)
    weights = (
        torch.randn(tokens.completion_mask.shape, generator=torch.Generator().manual_seed(1)) * tokens.completion_mask
    )
    saved = [0]

    def keep(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        logp = compute()
    (logp * weights).sum().backward()
    return logp.detach(), [p.grad.clone() for p in model.parameters()], saved[0]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-mixed"])
@pytest.mark.parametrize("shared_prompt", [True, False], ids=["packed", "padded"])
def test_checkpointing_gives_the_plain_gradient_bit_for_bit_and_recomputes_each_layer(shared_prompt, autocast):
    """The packed rows carry the shared-prompt layout to the attention of every layer, in the forward and in the
    recomputation (which runs after ``use_shared_prompt_attention`` has ended)."""
    plain = tiny_qwen2(seed=0)[0].train()
    checkpointed = copy.deepcopy(plain)
    enable_checkpointing(checkpointed)
    tokens = micro_batch(shared_prompt)
    results = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        calls = count_layer_forwards(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            results[name] = (*logprobs_and_gradients(model, tokens), calls[0])
    (logp, grads, saved, calls), (logp_c, grads_c, saved_c, calls_c) = results["plain"], results["checkpointed"]
    assert torch.equal(logp, logp_c)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    assert (calls, calls_c) == (1, 2)  # the layer ran again in the backward
    assert saved_c < saved / 4, (saved, saved_c)  # what the backward keeps: each layer's input, not its activations


def test_checkpointing_composes_with_fsdp2_and_fsdp1_wrapping_on_one_rank():
    """lit_parl's FSDP2 layout (each layer a unit, the log-prob computation the root's forward) and its FSDP1 layout
    (each layer a unit inside the model's unit, run through ``forward_through``), on one CPU rank: the checkpointed
    layer is recomputed inside its unit and the gradient is the plain one. Several ranks (where the recomputation
    needs the layer's parameters gathered again) are not run here."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import enable_wrap

    from lit_parl.trainer.strategies.fsdp1 import wrap_for_fsdp1
    from lit_parl.trainer.strategies.fsdp2 import shard_for_logprobs
    from lit_parl.trainer.strategies.strategy_adapter import forward_through

    tokens = micro_batch(True)
    expected_logp, expected, _ = logprobs_and_gradients(tiny_qwen2(seed=0)[0].train(), tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for layout in ("fsdp2", "fsdp1"):
            policy = tiny_qwen2(seed=0)[0].train()
            enable_checkpointing(policy)
            calls = count_layer_forwards(policy)
            if layout == "fsdp2":
                root = shard_for_logprobs(policy, init_device_mesh("cpu", (1,)))
                logp, grads, _ = logprobs_and_gradients(policy, tokens, lambda: root(tokens, 0.7, 1024, False))
                grads = [g.full_tensor() for g in grads]
            else:
                with enable_wrap(
                    wrapper_cls=FullyShardedDataParallel, device_id=torch.device("cpu"), use_orig_params=True
                ):
                    unit = wrap_for_fsdp1(policy)
                compute = functools.partial(completion_logprobs, unit.module, tokens, 0.7, 1024, False)
                logp, _, _ = logprobs_and_gradients(unit, tokens, lambda: forward_through(unit, compute))
                with FullyShardedDataParallel.summon_full_params(unit, with_grads=True):
                    grads = [p.grad.clone() for p in unit.parameters()]
            assert torch.equal(logp, expected_logp), layout
            assert len(grads) == len(expected) and all(torch.equal(a, b) for a, b in zip(grads, expected)), layout
            assert calls[0] == 2, layout
    finally:
        dist.destroy_process_group()


def layer_flags(model) -> set[bool]:
    return {layer.gradient_checkpointing for layer in model.get_decoder().layers}


@pytest.mark.parametrize("packing", ["shared_prompt", "padded"])
def test_the_modules_option_checkpoints_the_policy_only_and_trains_the_same_weights(packing):
    """``GRPOModule(gradient_checkpointing=True)``: the policy's layers are checkpointed, θ_k's and the reference's
    are not (they run without gradients). A short fit with plain SGD (whose update is -lr x gradient, so any change
    of the gradient shows) ends with the same weights as without, and ran the policy's layers twice per step."""
    results = {}
    for flag in (False, True):
        module, data = make_components(
            pool=InProcessPool(),
            objective=GRPOObjective(beta=0.04),
            mini_batches=2,
            datamodule_kwargs={"packing": Packing(packing)},
            gradient_checkpointing=flag,
            **sgd(0.5),
        )
        assert module.gradient_checkpointing is flag
        assert layer_flags(module.policy) == {flag} and layer_flags(module.old) == layer_flags(module.reference) == {
            False
        }
        calls = count_layer_forwards(module.policy)
        fit(module, data, iterations=2)
        results[flag] = (policy_state(module), calls[0])
    (plain, calls), (checkpointed, calls_c) = results[False], results[True]
    assert calls == 8 and calls_c == 16  # 8 micro-batches: one policy forward each, and one recomputation each
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(plain[n], tiny_qwen2(seed=0)[0].state_dict()[n]) for n in plain)  # it did train
