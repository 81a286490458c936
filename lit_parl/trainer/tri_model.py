"""The tri-model's two frozen views beside the trained policy: θ_k (``old``) and θ_0 (``reference``).

Full-weight training keeps each as a frozen copy of the policy, and only when it is needed: θ_k when an
iteration has several optimizer steps (with one, the old log-probs are the policy's, detached), θ_0 when β > 0.
LoRA training (``lit_parl.models.lora``) keeps neither copy: θ_0 is the policy with its adapters switched off,
and θ_k a second adapter beside the trained one. ``GRPOModule`` asks this module for the views, for their
log-probs on a micro-batch, and for the snapshot at each iteration's start.

Example (full weights, one optimizer step per iteration, β > 0: the reference is a copy, θ_k is not kept)::

    >>> from lit_parl.data.iteration_shape import IterationShape
    >>> from lit_parl.models import tiny_qwen2
    >>> from lit_parl.trainer.grpo_objective import GRPOObjective
    >>> policy, _ = tiny_qwen2()
    >>> reference, old = frozen_views(policy, GRPOObjective(beta=0.04), IterationShape(8, 4, 8), None)
    >>> reference is not policy, reference.training, old
    (True, False, None)
"""

from __future__ import annotations

import copy

import torch

from lit_parl.models.lora import SNAPSHOT, TRAINED, LoRASettings, adapter_active, adapters_off, add_lora


def _frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    clone = copy.deepcopy(model).eval()
    clone.requires_grad_(False)
    return clone


def frozen_views(policy, objective, shape, lora: LoRASettings | None):
    """``(reference, old)``: the frozen copies full-weight training needs (``None`` where none is needed). With
    ``lora``, the adapters are injected into ``policy`` (θ_k's too, with several steps) and no copy is made."""
    if lora is not None:
        add_lora(policy, lora, with_snapshot=shape.optimizer_steps > 1)
        return None, None
    reference = _frozen_copy(policy) if objective.needs_reference else None
    old = _frozen_copy(policy) if shape.optimizer_steps > 1 else None
    return reference, old


def frozen_logprobs(module, batch, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(old, reference)`` log-probs of ``batch`` under θ_k and θ_0, without gradients (``reference``: ``None``
    when the objective needs none). ``logp``: the policy's, which are θ_k's with one optimizer step."""
    policy, lora = module.policy, module.lora
    with torch.no_grad():
        if module.old is not None:
            old_logp = module.completion_logprobs(module.old, batch)
        elif lora is not None and module.shape.optimizer_steps > 1:
            with adapter_active(policy, SNAPSHOT):
                old_logp = module.completion_logprobs(policy, batch)
        else:
            old_logp = logp.detach()
        ref_logp = None
        if module.reference is not None:
            ref_logp = module.completion_logprobs(module.reference, batch)
        elif lora is not None and module.objective.needs_reference:
            with adapters_off(policy):
                ref_logp = module.completion_logprobs(policy, batch)
    return old_logp, ref_logp


def take_snapshot(module) -> None:
    """θ_k ← the policy, at the iteration's start: the weights the pool generates this iteration with."""
    if module.old is not None:
        module.strategy_adapter.copy_weights(module.policy, module.old)
    elif module.lora is not None and module.shape.optimizer_steps > 1:
        module.strategy_adapter.copy_adapter(module.policy, TRAINED, SNAPSHOT)


def theta_k_in_policy(module):
    """A context in which ``module.policy`` computes θ_k, or ``None`` when θ_k is ``module.old`` (or the policy itself,
    with one optimizer step): with LoRA and several steps, the snapshot adapter switched on (``WeightSync`` reads
    θ_k through it when a fit resumes inside an iteration)."""
    if module.lora is not None and module.shape.optimizer_steps > 1:
        return adapter_active(module.policy, SNAPSHOT)
    return None
