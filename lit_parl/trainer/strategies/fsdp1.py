"""FSDP1Adapter: the update under Lightning's ``FSDPStrategy`` (``FullyShardedDataParallel``, ``use_orig_params=True``).

The units are laid out like FSDP2's (``lit_parl.trainer.strategies.fsdp2``): ``wrap_for_fsdp1`` wraps each
decoder layer and then the model itself (the root unit, which keeps the model's names in state dicts), and the
log-prob computation runs as that root's forward (``forward_through``), so FSDP1 gathers what it reads. The
LightningModule stays unwrapped, so a backward never runs inside a unit's forward. A rank holds views into
each unit's flat shard: θ_k is copied unit by unit, gathered, and the gradient's norm comes from the root.
"""

from __future__ import annotations

import functools

import torch
from transformers import PreTrainedModel

from lit_parl.callbacks.full_tensors import fsdp1_units, is_sharded
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.trainer.strategies.strategy_adapter import (
    StrategyAdapter,
    adapter_pairs,
    copy_local,
    decoder_layers,
    forward_through,
)


def wrap_for_fsdp1(model: PreTrainedModel, sharding_strategy=None, frozen: bool = False) -> torch.nn.Module:
    """Wrap ``model`` with FSDP1: each decoder layer a unit, the model the root unit. Call it inside Lightning's
    ``configure_model`` under ``FSDPStrategy``, whose wrapping context supplies the strategy's settings.

    ``frozen``: a model only run without gradients (θ_k, the reference). Where the strategy's
    ``sharding_strategy`` keeps a unit's parameters gathered from its forward to its backward
    (``SHARD_GRAD_OP``), such a model would stay whole on every rank, having no backward: its units are
    sharded again after each forward instead.
    """
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, wrap

    resharded = {
        ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy.FULL_SHARD,
        ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.HYBRID_SHARD,
    }
    overrides = {"sharding_strategy": resharded[sharding_strategy]} if frozen and sharding_strategy in resharded else {}
    return wrap(model, auto_wrap_policy=ModuleWrapPolicy({type(layer) for layer in decoder_layers(model)}), **overrides)


class FSDP1Adapter(StrategyAdapter):
    """Each model an FSDP1 root unit, each decoder layer a unit inside it."""

    def prepare(self, max_grad_norm, micro_batch_size) -> None:
        strategy = self.strategy
        if not strategy.kwargs.get("use_orig_params", True):
            raise ValueError(
                "FSDPStrategy(use_orig_params=False) is not supported: "
                "lit_parl's optimizer, θ_k copy and weight sync read the model's own parameters. "
                "Leave use_orig_params at its default (True)."
            )
        if "auto_wrap_policy" in strategy.kwargs:
            raise ValueError(
                "FSDPStrategy(auto_wrap_policy=...): lit_parl lays out the units itself (each model a unit, "
                "each decoder layer a unit inside it, the layout its forward and θ_k copy rely on): "
                "leave auto_wrap_policy unset"
            )
        self._keep_float32_buffers_and_reductions()

    def _keep_float32_buffers_and_reductions(self) -> None:
        """Under bf16 mixed precision Lightning gives FSDP1 ``buffer_dtype=bfloat16``, which casts the rotary
        embedding's ``inv_freq`` (and so every position's angle) to bfloat16, and ``reduce_dtype=bfloat16``, which
        sums the ranks' gradients in bfloat16 where DDP and FSDP2 sum in float32: keep both in float32."""
        from torch.distributed.fsdp import MixedPrecision

        strategy = self.strategy
        mixed = strategy.mixed_precision_config
        if strategy.mixed_precision is None and mixed is not None and mixed.param_dtype is not None:
            strategy.mixed_precision = MixedPrecision(
                param_dtype=mixed.param_dtype, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            )

    def configure_model(self, module) -> None:
        if is_sharded(module.policy):  # a second fit: wrapped already
            return
        sharding = self.strategy.sharding_strategy
        module.policy = wrap_for_fsdp1(module.policy, sharding)
        module.old = wrap_for_fsdp1(module.old, sharding, frozen=True) if module.old is not None else None
        module.reference = (
            wrap_for_fsdp1(module.reference, sharding, frozen=True) if module.reference is not None else None
        )

    def logprobs(self, model, tokens, temperature, chunk_size, with_entropy):
        compute = functools.partial(completion_logprobs, model.module, tokens, temperature, chunk_size, with_entropy)
        return forward_through(model, compute)

    def copy_weights(self, source, target) -> None:
        """Unit by unit and gathered: a frozen model's root unit keeps its gathered parameters after a forward
        (FSDP1 never frees a root's before a backward, which a frozen model has none of) and reuses them in the
        next forward without gathering, so its shards alone must not be written."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with torch.no_grad():
            for (source_unit, s), (target_unit, t) in zip(fsdp1_units(source), fsdp1_units(target), strict=True):
                with (
                    FSDP.summon_full_params(source_unit, recurse=False, writeback=False),
                    FSDP.summon_full_params(target_unit, recurse=False, writeback=True),
                ):
                    copy_local(s, t)

    def copy_adapter(self, model, source, target) -> None:
        """Unit by unit, gathered (each adapter's A and B are in their layer's unit, flattened at other offsets, so
        a rank's pieces of the two do not line up)."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with torch.no_grad():
            for unit, named in fsdp1_units(model):
                pairs = adapter_pairs(named, source, target)
                if pairs[0]:
                    with FSDP.summon_full_params(unit, recurse=False, writeback=True):
                        copy_local(*pairs)

    def clip_gradients(self, model, max_norm):
        """Through the model's root unit: each rank holds a disjoint piece of the gradient."""
        return model.clip_grad_norm_(max_norm if max_norm else float("inf"))
