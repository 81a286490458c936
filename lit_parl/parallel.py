"""What the update does differently under each Lightning strategy, in one place.

The module touches its parameters directly in three places: the θ_k snapshot (``copy_weights``), the
optimizer step (``clip_gradients``; under DeepSpeed ``deepspeed_step``), and, before a fit, the strategy's
settings (``prepare_strategy``). Each works on what a rank holds:

- one device or DDP: whole parameters, replicated;
- FSDP2 (``ModelParallelStrategy``): a DTensor shard of every parameter;
- FSDP1 (``FSDPStrategy``, ``use_orig_params=True``): views into each unit's flat shard, the units laid out
  by ``lit_parl.sharding.wrap_for_fsdp1`` (each model a root unit, each decoder layer a unit inside it);
- DeepSpeed (``DeepSpeedStrategy``): ZeRO-2 keeps parameters whole and partitions the gradient in the
  engine's buffers (``p.grad`` stays ``None``); ZeRO-3 also partitions every parameter (``ds_tensor``).
  The engine takes the step's gradient sum at the backward it is told ends the step
  (``set_gradient_accumulation_boundary``, set from each micro-batch's ``ends_step``: a step spans as many
  backwards as its mini-batch has micro-batches), and scales, clips and steps it itself (``deepspeed_step``).

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

__all__ = ["clip_gradients", "copy_weights", "deepspeed_engine", "deepspeed_step", "is_zero3", "prepare_strategy"]


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
    in the next forward without gathering, so its shards alone must not be written. Under ZeRO-3, parameter
    by parameter and gathered, for the same reason: ZeRO-3 keeps small parameters whole after their first
    use (``stage3_param_persistence_threshold``), so their pieces alone must not be written either.
    """
    with torch.no_grad():
        if is_zero3(next(source.parameters())):  # one parameter of each at a time, gathered; rank 0's copy kept
            import deepspeed
            import torch.distributed as dist

            for (_, s), (_, t) in zip(source.named_parameters(), target.named_parameters(), strict=True):
                with deepspeed.zero.GatheredParameters([s], modifier_rank=None), deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                    if dist.get_rank() == 0:  # rank 0's copy is what every rank keeps its partition of
                        t.data.copy_(s.data)
            return
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


def prepare_strategy(strategy, max_grad_norm: float | None, micro_batch_size: int) -> None:
    """Refuse, before the strategy wraps the module, what the update cannot run under, naming the setting to
    use; give DeepSpeed's config what the module decides (its gradient clipping, its micro-batch size)."""
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
        _keep_float32_buffers_and_reductions(strategy)
    if isinstance(strategy, DeepSpeedStrategy):
        config = strategy.config
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (2, 3):
            raise ValueError(
                f"DeepSpeedStrategy with ZeRO stage {stage}: lit_parl runs under stages 2 and 3 (strategy=deepspeed_stage_2 "
                "or deepspeed_stage_3); without ZeRO use trainer=ddp"
            )
        clipping = max_grad_norm or 0.0
        if config.get("gradient_clipping", clipping) != clipping:
            raise ValueError(
                f"the DeepSpeed config clips gradients at {config['gradient_clipping']} but GRPOModule(max_grad_norm="
                f"{max_grad_norm}): the module's setting is the one to use; remove gradient_clipping from the config"
            )
        config["gradient_clipping"] = clipping  # DeepSpeed clips at its step, after the normaliser is applied
        if (config.get("bf16") or {}).get("check_grad_overflow", True) is False or config["zero_optimization"].get("compute_grad_norm", True) is False:
            raise ValueError(
                "the DeepSpeed config turns off bf16.check_grad_overflow or zero_optimization.compute_grad_norm: lit_parl "
                "relies on DeepSpeed's gradient norm to skip a non-finite step and to log it; remove those settings"
            )
        config.setdefault("train_micro_batch_size_per_gpu", micro_batch_size)  # DeepSpeed's logs; Lightning would read a loader for it


def _keep_float32_buffers_and_reductions(strategy) -> None:
    """Under bf16 mixed precision Lightning gives FSDP1 ``buffer_dtype=bfloat16``, which casts the rotary
    embedding's ``inv_freq`` (and so every position's angle) to bfloat16, and ``reduce_dtype=bfloat16``, which
    sums the ranks' gradients in bfloat16 where DDP and FSDP2 sum in float32: keep both in float32."""
    from torch.distributed.fsdp import MixedPrecision

    mixed = strategy.mixed_precision_config
    if strategy.mixed_precision is None and mixed is not None and mixed.param_dtype is not None:
        strategy.mixed_precision = MixedPrecision(param_dtype=mixed.param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32)


# -- DeepSpeed ---------------------------------------------------------------------------------------------
def deepspeed_engine(trainer) -> object | None:
    """The DeepSpeed engine when ``trainer`` runs Lightning's ``DeepSpeedStrategy`` (else ``None``)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = trainer.strategy if trainer is not None else None
    return strategy.deepspeed_engine if isinstance(strategy, DeepSpeedStrategy) else None


def is_zero3(parameter: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitions ``parameter`` (each rank keeps a piece of it in ``ds_tensor``)."""
    return hasattr(parameter, "ds_id")


def deepspeed_step(engine, optimizer, scale: float) -> torch.Tensor:
    """One optimizer step on ``scale`` x the accumulated gradient, clipped as DeepSpeed's config says
    (``gradient_clipping``). Returns the global norm of the scaled gradient before clipping: infinite or NaN
    where DeepSpeed found it non-finite and skipped the step itself.

    DeepSpeed divides the gradient by its loss scale at the step, before clipping, whatever the stage: for
    this one step the loss scale is ``1 / scale`` (1 otherwise, as in float32 and bfloat16). A NaN ``scale``
    makes DeepSpeed skip the step, on every rank.
    """
    zero = engine.optimizer
    zero.override_loss_scale(1.0 / scale)
    try:
        optimizer.step()
    finally:
        zero.override_loss_scale(1.0)
    return torch.tensor(float(engine.get_global_grad_norm()))
