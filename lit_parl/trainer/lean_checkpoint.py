"""Lean checkpoints: the frozen models the module can rebuild are left out of its checkpoints.

- ``reference`` (θ_0) is the initial policy, which the module is built from again when a run resumes; the
  checkpoint keeps a fingerprint of it instead (per parameter, the float64 sum and sum of squares), and a
  resume from a module built from other weights is refused.
- ``old`` (θ_k) is the policy at the start of the current iteration: between iterations that is the policy
  itself; only a checkpoint written inside an iteration (after some of its optimizer steps) keeps it.
- With LoRA adapters (``lit_parl.models.lora``) the policy's frozen base is θ_0: it is left out and checked the
  same way, so a checkpoint holds the adapters (and the optimizer's state of them) only; θ_k's adapter is left
  out between iterations (it is the trained adapter then).

Under a sharding strategy (FSDP2, FSDP1, DeepSpeed) everything stays in: the strategy writes the module's state
itself (each rank its own shards, never a whole copy), and its loader reads every key of it.

Example::

    >>> import torch
    >>> state = {"policy.w": torch.ones(2), "reference.w": torch.ones(2), "old.w": torch.zeros(2)}
    >>> checkpoint = {"state_dict": dict(state)}
    >>> leave_out(checkpoint, fingerprint(torch.nn.ParameterDict({"w": torch.ones(2)})), inside_iteration=False)
    >>> sorted(checkpoint["state_dict"])
    ['policy.w']
    >>> put_back(checkpoint, reference=torch.nn.ParameterDict({"w": torch.ones(2)}), has_old=True)
    >>> sorted(checkpoint["state_dict"]), checkpoint["state_dict"]["old.w"].tolist()
    (['old.w', 'policy.w', 'reference.w'], [1.0, 1.0])
"""

from __future__ import annotations

import torch

from lit_parl.callbacks.full_tensors import is_adapter_tensor
from lit_parl.models.lora import SNAPSHOT, TRAINED

Fingerprint = list[tuple[str, float, float]]


def fingerprint(model: torch.nn.Module) -> Fingerprint:
    """Per parameter but the LoRA adapters', the sum and the sum of squares in float64: tells a rebuilt θ_0 (the
    reference, or a LoRA policy's frozen base) from other weights."""
    with torch.no_grad():
        return [
            (name, float(p.double().sum()), float(p.double().square().sum()))
            for name, p in model.named_parameters()
            if not is_adapter_tensor(name)
        ]


def _rebuilt(name: str, inside_iteration: bool, lora: bool) -> bool:
    """Whether the module rebuilds state ``name`` when it resumes (so a checkpoint need not hold it)."""
    if name.startswith("reference."):
        return True
    if name.startswith("old."):
        return not inside_iteration
    if lora and name.startswith("policy."):
        return not is_adapter_tensor(name) or (f".{SNAPSHOT}." in name and not inside_iteration)
    return False


def same_fingerprint(saved: Fingerprint, rebuilt: Fingerprint, rtol: float = 1e-9) -> bool:
    if [name for name, *_ in saved] != [name for name, *_ in rebuilt]:
        return False
    return all(
        abs(a - b) <= rtol * max(abs(a), abs(b), 1.0) for (_, *x), (_, *y) in zip(saved, rebuilt) for a, b in zip(x, y)
    )


def _is_sharded(state: dict) -> bool:
    return any(hasattr(value, "full_tensor") for value in state.values())


def leave_out(
    checkpoint: dict,
    reference_fingerprint: Fingerprint | None,
    inside_iteration: bool,
    keep_all: bool = False,
    lora: bool = False,
) -> None:
    """Drop ``reference.*`` (θ_0) and, between iterations, ``old.*`` (θ_k) from ``checkpoint["state_dict"]``; with
    ``lora``, the policy's frozen base and, between iterations, θ_k's adapter. ``reference_fingerprint``: θ_0's.

    ``keep_all``: drop nothing (a strategy whose loader fills the module's state before the module's hooks run).
    """
    state = checkpoint["state_dict"]
    checkpoint["lit_parl_reference"] = reference_fingerprint
    if keep_all or _is_sharded(state):
        return
    for name in [name for name in state if _rebuilt(name, inside_iteration, lora)]:
        del state[name]


def put_back(
    checkpoint: dict, reference: torch.nn.Module | None, has_old: bool, lora_policy: torch.nn.Module | None = None
) -> None:
    """Fill in what ``leave_out`` dropped: θ_0 from the rebuilt ``reference`` (checked first), θ_k from the policy
    (``has_old``: the module keeps a θ_k). ``lora_policy``: the rebuilt policy with LoRA adapters, whose frozen
    base (checked first) fills the base, and whose trained adapter's saved tensors fill θ_k's adapter."""
    state = checkpoint.get("state_dict")
    if state is None:  # a sharded checkpoint: the strategy loaded the module in place, every key included
        return
    if reference is not None and not any(name.startswith("reference.") for name in state):
        _check(checkpoint, reference)
        state.update({f"reference.{name}": tensor for name, tensor in reference.state_dict().items()})
    if has_old and not any(name.startswith("old.") for name in state):
        state.update(
            {f"old.{name[len('policy.') :]}": tensor for name, tensor in state.items() if name.startswith("policy.")}
        )
    left_out = lora_policy is not None and any(f"policy.{n}" not in state for n, _ in lora_policy.named_parameters())
    if left_out:  # the rebuilt policy's state is read (under a sharding strategy: gathered) only when needed
        rebuilt = {f"policy.{name}": tensor for name, tensor in lora_policy.state_dict().items()}
        base = {name: tensor for name, tensor in rebuilt.items() if not is_adapter_tensor(name) and name not in state}
        if base:
            _check(checkpoint, lora_policy)
            state.update(base)
        for name in rebuilt:  # θ_k's adapter, left out between iterations: the trained one's saved tensors
            if f".{SNAPSHOT}." in name and name not in state:
                state[name] = state[name.replace(f".{SNAPSHOT}.", f".{TRAINED}.")]


def _check(checkpoint: dict, rebuilt: torch.nn.Module) -> None:
    saved = checkpoint.get("lit_parl_reference")
    if saved is not None and not same_fingerprint(saved, fingerprint(rebuilt)):
        raise ValueError(
            "this checkpoint was trained against another reference model (θ_0) than the one this GRPOModule was "
            "built from: build the module from the same initial policy as the run that wrote it"
        )
