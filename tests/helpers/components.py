"""The tests' tiny job: its components (``make_components``), a fit runner, SGD keywords for exact weight
comparisons, and a recorder of the micro-batches trained."""

from __future__ import annotations

import functools

import lightning
import torch
from lightning.pytorch import Callback

from lit_parl import (
    GRPOModule,
    GRPOObjective,
    IterationShape,
    RolloutDataModule,
    tiny_qwen2,
)
from lit_parl.callbacks import WeightSync
from lit_parl.rewards import Reward
from lit_parl.rollout import HFRolloutPool, RolloutPool
from lit_parl.rollout.records import SamplingParams
from lit_parl.tasks import CopyTask

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)


def make_components(
    mode: str = "async",
    pool: RolloutPool | None = None,
    prompts: int = 8,
    group_size: int = 4,
    micro_batch_size: int = 8,
    task=None,
    rewards=None,
    objective: GRPOObjective | None = None,
    trainer_threads: int | None = 1,
    seed: int = 0,
    mini_batches: int = 1,
    passes: int = 1,
    lr: float | None = None,
    datamodule_kwargs: dict | None = None,
    **module_kwargs,
) -> tuple[GRPOModule, RolloutDataModule]:
    policy, tokenizer = tiny_qwen2(seed=seed)
    shape = IterationShape(prompts, group_size, micro_batch_size, mini_batches, passes)
    objective = objective or GRPOObjective()
    if lr is not None:
        module_kwargs["optimizer"] = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    module = GRPOModule(
        policy, objective, shape, tokenizer=tokenizer, temperature=SAMPLING.temperature, **module_kwargs
    )
    task = task or CopyTask(seed=seed)
    datamodule = RolloutDataModule(
        task,
        rewards or [Reward(task.reward, name="positional")],
        pool or HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=policy,
        **{
            "mode": mode,
            "sampling": SAMPLING,
            "seed": seed,
            "trainer_threads": trainer_threads,
            "gate_timeout_s": 60,
            **(datamodule_kwargs or {}),
        },
    )
    return module, datamodule


def fit(
    module, datamodule, iterations: int, callbacks=(), weight_sync: WeightSync | None = None, **trainer_kwargs
) -> lightning.Trainer:
    """A CPU fit of ``iterations`` epochs with ``weight_sync`` (default: a plain ``WeightSync()``) first."""
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=iterations,
        callbacks=[weight_sync or WeightSync(), *callbacks],
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


def sgd(lr: float, momentum: float = 0.0) -> dict:
    """``make_components`` keywords for plain SGD without clipping: the update is exactly -lr x gradient, so a
    wrong gradient scale shows in the weights (AdamW's normalised step and norm clipping would hide it).
    ``momentum`` keeps that linearity and gives the optimizer a state that a resume must restore."""
    return {"optimizer": functools.partial(torch.optim.SGD, lr=lr, momentum=momentum), "max_grad_norm": None}


class BatchRecorder(Callback):
    """Records every micro-batch the trainer starts training, with its epoch (= the iteration)."""

    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch))

    def samples(self) -> list[tuple[int, int, int]]:
        """``(iteration, prompt_id, sample_index)`` of every trained sample, in training order (first pass only)."""
        return [
            (epoch, prompt_id, sample)
            for epoch, batch in self.batches
            if batch.pass_index == 0
            for prompt_id, sample in zip(batch.prompt_ids, batch.sample_indices)
        ]
