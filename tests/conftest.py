"""Shared helpers: a fast tiny configuration, a fit runner, and a pool wrapper for fault injection."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import lightning
import pytest
import torch

from lit_parl import GRPOModule, GRPOObjective, IterationShape, RolloutDataModule, tiny_qwen2
from lit_parl.callbacks import WeightSync
from lit_parl.rollout import HFRolloutPool, RolloutPool
from lit_parl.tasks import CopyTask
from lit_parl.trajectory import GroupCompletions, GroupRequest, SamplingParams

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)


def make_components(
    mode: str = "async",
    pool: RolloutPool | None = None,
    prompts: int = 8,
    group_size: int = 4,
    micro_batch_size: int = 8,
    task=None,
    objective: GRPOObjective | None = None,
    trainer_threads: int | None = 1,
    seed: int = 0,
    mini_batches: int = 1,
    passes: int = 1,
    lr: float | None = None,
    **module_kwargs,
) -> tuple[GRPOModule, RolloutDataModule]:
    policy, tokenizer = tiny_qwen2(seed=seed)
    shape = IterationShape(prompts, group_size, micro_batch_size, mini_batches, passes)
    objective = objective or GRPOObjective()
    if lr is not None:
        module_kwargs["optimizer"] = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    module = GRPOModule(policy, objective, shape, tokenizer=tokenizer, temperature=SAMPLING.temperature, **module_kwargs)
    datamodule = RolloutDataModule(
        task or CopyTask(seed=seed),
        pool or HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=policy,
        mode=mode,
        sampling=SAMPLING,
        seed=seed,
        trainer_threads=trainer_threads,
        gate_timeout_s=60,
    )
    return module, datamodule


def fit(module, datamodule, iterations: int, callbacks=(), **trainer_kwargs) -> lightning.Trainer:
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=iterations,
        callbacks=[WeightSync(), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer


def policy_state(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


class WrappedPool(RolloutPool):
    """Delegates to a real pool; subclasses override ``transform`` to reorder, delay or corrupt groups."""

    backend = "wrapped"

    def __init__(self, inner: RolloutPool) -> None:
        super().__init__()
        self.inner = inner
        self.returned: list[GroupCompletions] = []

    def _start(self, spec) -> None:
        self.inner.start(spec)

    def _sync_weights(self, buckets, version: int) -> None:
        self.inner.sync_weights(buckets, version)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        for group in self.transform(self.inner.generate(requests, sampling)):
            self.returned.append(copy.deepcopy(group))
            yield group

    def transform(self, groups: Iterator[GroupCompletions]) -> Iterator[GroupCompletions]:
        yield from groups

    def _worker_counts(self) -> tuple[int, int]:
        health = self.inner.health()
        return health.workers, health.alive

    def _close(self) -> None:
        self.inner.close()

    def reserved_cpus(self, colocated: bool) -> int:
        return self.inner.reserved_cpus(colocated)

    def _busy_intervals(self):
        return self.inner.busy_intervals()


@pytest.fixture
def hf_pool():
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)
    yield pool
    pool.close()
