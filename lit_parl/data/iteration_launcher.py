"""IterationLauncher: builds one iteration's batcher from the datamodule's parts and starts it in a thread.

The datamodule owns the parts and their lifecycle; this owns how one iteration is put together from them
(the acceptor for the objective, the on-policy check's bound for the trainer's precision and device) and
started (``HeadStart``: to its first micro-batch, or to its end with prefetch). ``IterationStart`` calls it
when the version gate opens.

In use: ``RolloutDataModule.launcher`` (the README's "Components without the CLI" script runs it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from lightning.pytorch.accelerators import CPUAccelerator

from lit_parl.data.group_acceptor import GroupAcceptor
from lit_parl.data.head_start import HeadStart
from lit_parl.data.iteration_batcher import IterationBatcher
from lit_parl.data.iteration_start import Started
from lit_parl.data.iteration_stats import IterationStats
from lit_parl.errors import OffPolicyError
from lit_parl.rollout.rollout_pool import widened_for_trainer

if TYPE_CHECKING:
    from lit_parl.data.rollout_datamodule import RolloutDataModule


class IterationLauncher:
    """Starts the iteration of a version from ``data``'s parts, as they are when the gate opens.

    Args:
        data: the datamodule whose schedule, pool, scorer, settings, rank share and trainer the iteration uses
            (read at each start: the share and the trainer are set in ``setup``).
    """

    def __init__(self, data: RolloutDataModule) -> None:
        self.data = data

    def __call__(self, version: int) -> Started:
        """The iteration of ``version``, started in a thread, to its first micro-batch (prefetch: to its end)."""
        pool = self.data.pool
        if pool.version != version:
            raise OffPolicyError(f"the gate opened version {version} but the pool holds version {pool.version}")
        stats = IterationStats(version=version, requested_at=time.monotonic())
        batches = self.batcher().micro_batches(version, stats)
        head_start = HeadStart(batches, f"lit_parl-iteration-{version}", to_the_end=self.data.prefetching)
        return Started(version, stats, head_start)

    def batcher(self) -> IterationBatcher:
        """One iteration's batcher: this rank's share of the schedule, scored, accepted and collated."""
        data = self.data
        correct = data.correct_reward
        acceptor = GroupAcceptor(
            data.objective, data.shape.group_size, data.completion_limit, lambda reward: reward >= correct
        )
        return IterationBatcher(
            data.share,
            data.schedule,
            data.pool,
            data.scorer,
            acceptor,
            data.sampling,
            data.packing,
            data.tokenizer.pad_token_id,
            materialize=data.mode == "sync",
            dynamic_sampling=bool(getattr(data.objective, "dynamic_sampling", False)),
            max_sampling_rounds=data.max_sampling_rounds,
            logprob_tolerance=self.logprob_tolerance(),
            open_slots_everywhere=data.slots.everywhere,
            episodes=data.episodes,
        )

    def logprob_tolerance(self) -> float | None:
        """The on-policy check's bound: as configured, or the pool's widened for the trainer's precision and device."""
        configured, pool, trainer = self.data.logprob_tolerance, self.data.pool, self.data.trainer
        if configured != "auto":
            return configured
        if trainer is None:
            return pool.logprob_tolerance()
        on_accelerator = not isinstance(trainer.accelerator, CPUAccelerator)
        return widened_for_trainer(pool.logprob_tolerance(), trainer.precision, on_accelerator)
