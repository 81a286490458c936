"""What the update does differently under each Lightning strategy, in one place.

The module touches its parameters directly in three places: the θ_k snapshot (``copy_weights``), the
gradient's global norm and clipping (``clip_gradients``), and, before a fit, the strategy's settings
(``check_strategy``). Each works on what a rank holds:

- one device or DDP: whole parameters, replicated;
- FSDP2 (``ModelParallelStrategy``): a DTensor shard of every parameter;
- FSDP1 (``FSDPStrategy``, ``use_orig_params=True``): views into each unit's flat shard, the units laid out
  by ``lit_parl.sharding.wrap_for_fsdp1`` (each model a root unit, each decoder layer a unit inside it).

Example::

    >>> import torch
    >>> source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> copy_weights(source, target)
    >>> torch.equal(source.weight, target.weight)
    True
"""

from __future__ import annotations

import math

import torch

from lit_parl.callbacks.full_tensors import fsdp1_units

__all__ = ["check_strategy", "clip_gradients", "copy_weights"]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The piece of ``tensor`` this rank holds (a DTensor's local shard; FSDP1's views are pieces already)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _copy(source: list[tuple[str, torch.Tensor]], target: list[tuple[str, torch.Tensor]]) -> None:
    if [name for name, _ in source] != [name for name, _ in target]:
        raise RuntimeError("copy_weights: the two models have different parameters; θ_k must be a copy of the policy")
    for (name, s), (_, t) in zip(source, target):
        s, t = _local(s), _local(t)
        if s.shape != t.shape:
            raise RuntimeError(f"{name} is sharded differently in the two models on this rank ({tuple(s.shape)} and {tuple(t.shape)})")
        t.copy_(s)


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target ← source``, parameter by parameter, each rank on what it holds (never a second whole model).

    Under FSDP1, unit by unit and gathered: a frozen model's root unit keeps its gathered parameters after a
    forward (FSDP1 never frees a root's before a backward, which a frozen model has none of) and reuses them
    in the next forward without gathering, so its shards alone must not be written.
    """
    with torch.no_grad():
        if not _is_fsdp1_root(source):
            _copy(list(source.named_parameters()), list(target.named_parameters()))
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for (source_unit, s), (target_unit, t) in zip(fsdp1_units(source), fsdp1_units(target), strict=True):
            with FSDP.summon_full_params(source_unit, recurse=False, writeback=False), \
                    FSDP.summon_full_params(target_unit, recurse=False, writeback=True):
                _copy(s, t)


def _is_fsdp1_root(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP1 unit (lit_parl wraps each model as one)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def clip_gradients(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip the global norm of ``model``'s gradient to ``max_norm`` (``None``: no clipping) and return that norm,
    the same on every rank: under FSDP1 through the model's root unit (each rank holds a disjoint piece of
    the gradient), under FSDP2 over the DTensor shards, else over the whole (replicated) gradients."""
    limit = max_norm if max_norm else math.inf
    if _is_fsdp1_root(model):
        return model.clip_grad_norm_(limit)
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def check_strategy(strategy) -> None:
    """Refuse, before the strategy wraps the module, what the update cannot run under, naming the setting to use."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        if not strategy.kwargs.get("use_orig_params", True):
            raise ValueError(
                "FSDPStrategy(use_orig_params=False) is not supported: lit_parl's optimizer, θ_k copy and weight sync read "
                "the model's own parameters. Leave use_orig_params at its default (True)."
            )
        if "auto_wrap_policy" in strategy.kwargs:
            raise ValueError(
                "FSDPStrategy(auto_wrap_policy=...): lit_parl lays out the units itself (each model a unit, each decoder "
                "layer a unit inside it, the layout its forward and θ_k copy rely on): leave auto_wrap_policy unset"
            )
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "Trainer(strategy='deepspeed') is not supported: lit_parl divides each mini-batch's gradient by a normaliser "
            "known only once all its streamed micro-batches are in, and ZeRO keeps gradients in partitioned buffers the "
            "module cannot scale. Use trainer=fsdp2 (sharded), trainer=fsdp or trainer=ddp."
        )
