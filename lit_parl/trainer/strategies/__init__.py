"""One adapter per Lightning strategy: what the update does differently under each (``StrategyAdapter``).

``adapter_for`` is the one place that tells the strategies apart; ``GRPOModule`` calls its adapter only.
"""

from __future__ import annotations

from lit_parl.trainer.strategies.strategy_adapter import StrategyAdapter


def adapter_for(strategy, current: StrategyAdapter | None = None) -> StrategyAdapter:
    """The adapter for ``strategy``; ``current`` when it is already of the right kind (a second fit keeps the
    layout the first one made)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    from lit_parl.trainer.strategies.deepspeed_zero import DeepSpeedAdapter
    from lit_parl.trainer.strategies.fsdp1 import FSDP1Adapter
    from lit_parl.trainer.strategies.fsdp2 import FSDP2Adapter

    kinds = ((DeepSpeedStrategy, DeepSpeedAdapter), (FSDPStrategy, FSDP1Adapter), (ModelParallelStrategy, FSDP2Adapter))
    kind = next((adapter for strategy_type, adapter in kinds if isinstance(strategy, strategy_type)), StrategyAdapter)
    if type(current) is not kind:
        return kind(strategy)
    current.strategy = strategy
    return current


__all__ = ["StrategyAdapter", "adapter_for"]
