"""WeightSync: push the policy to the rollout pool at the start of every iteration, then open the gate.

Iteration k (Lightning epoch) pushes θ_k as version k, waits until every worker confirmed it, and only
then lets the datamodule send the iteration's requests: every rollout of the iteration comes from θ_k.

Works with any LightningModule whose policy weights it can read: override ``policy_tensors`` for
models that keep the policy elsewhere, or sharded strategies that must gather full tensors first.
The datamodule must expose ``pool`` (a ``lit_parl.rollout.RolloutPool``) and ``open_iteration(version)``.

Example::

    from lit_parl.callbacks import WeightSync
    trainer = lightning.Trainer(max_epochs=10, callbacks=[WeightSync()])
    trainer.fit(module, datamodule=rollout_datamodule)
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class WeightSync(Callback):
    def __init__(self) -> None:
        self.version = 0  # iterations completed = version of the weights pushed next
        self.sync_intervals: list[tuple[float, float]] = []  # (start, end) monotonic, one per iteration

    def policy_tensors(self, trainer: Trainer, pl_module: LightningModule) -> Iterable[tuple[str, torch.Tensor]]:
        """The named tensors the pool loads. Override for other module layouts or sharded strategies."""
        return pl_module.policy.named_parameters()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "open_iteration"):
            raise TypeError("WeightSync needs a datamodule with a rollout `pool` and `open_iteration` (lit_parl.RolloutDataModule)")
        start = time.monotonic()
        datamodule.pool.sync_weights(self.policy_tensors(trainer, pl_module), self.version)
        datamodule.open_iteration(self.version)
        self.sync_intervals.append((start, time.monotonic()))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.version += 1

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state_dict: dict) -> None:
        self.version = state_dict["version"]
