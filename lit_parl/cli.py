"""The Hydra entry point: ``lit-parl`` or ``python -m lit_parl`` (configs in ``conf/``).

``build(cfg)`` turns a config into (module, datamodule, trainer) without starting any process, so a bad
configuration fails before the pool is launched; ``run(cfg)`` fits and returns the summary.
"""

from __future__ import annotations

import signal
from pathlib import Path

import hydra
import lightning
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lit_parl.callbacks import HFExport, PipelineTimeline, RunSummary, WeightSync
from lit_parl.datamodule import RolloutDataModule, check_mini_batches
from lit_parl.kernels.attention import resolve_backend
from lit_parl.module import GRPOModule
from lit_parl.trajectory import SamplingParams


def build(cfg: DictConfig) -> tuple[GRPOModule, RolloutDataModule, lightning.Trainer]:
    lightning.seed_everything(cfg.seed, workers=True, verbose=False)
    run_dir = Path(cfg.run_dir)
    rollout, algorithm = cfg.rollout, cfg.algorithm
    sampling = SamplingParams(**OmegaConf.to_container(rollout.sampling))
    task = instantiate(cfg.task)
    objective = instantiate(algorithm.objective)
    pool = instantiate(rollout.pool)
    policy, tokenizer = instantiate(cfg.model)
    module = GRPOModule(
        policy,
        objective,
        tokenizer=tokenizer,
        lr=algorithm.lr,
        weight_decay=algorithm.weight_decay,
        max_grad_norm=algorithm.max_grad_norm,
        mini_batches=algorithm.mini_batches,
        passes=algorithm.passes,
        temperature=sampling.temperature,
        attention_backend=algorithm.attention_backend,
        logprob_chunk_size=algorithm.logprob_chunk_size,
    )
    datamodule = RolloutDataModule(
        task,
        pool,
        tokenizer,
        prompts_per_iteration=rollout.prompts_per_iteration,
        group_size=rollout.group_size,
        micro_batch_size=rollout.micro_batch_size,
        mode=rollout.mode,
        sampling=sampling,
        seed=cfg.seed,
        trainer_threads=rollout.trainer_threads,
        gate_timeout_s=rollout.gate_timeout_s,
        packing=rollout.packing,
        min_packing_gain=rollout.min_packing_gain,
        max_row_tokens=rollout.max_row_tokens,
        max_sampling_rounds=rollout.max_sampling_rounds,
        prefetch=rollout.prefetch,
    )
    check_mini_batches(rollout.prompts_per_iteration, rollout.group_size, rollout.micro_batch_size, algorithm.mini_batches)
    if objective.kl_in_reward and rollout.micro_batch_size % rollout.group_size:
        raise ValueError("algorithm.objective.kl_in_reward needs whole groups per micro-batch: make rollout.micro_batch_size a multiple of group_size")
    callbacks = [
        WeightSync(),
        RunSummary(dirpath=str(run_dir)),
        PipelineTimeline(dirpath=str(run_dir)),
        HFExport(dirpath=str(run_dir / "policy")),
    ]
    if cfg.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "checkpoints", every_n_epochs=cfg.checkpoint_every, save_last=True, save_top_k=-1))
    trainer = instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=CSVLogger(save_dir=run_dir, name="", version=""),
        default_root_dir=str(run_dir),
        enable_checkpointing=bool(cfg.checkpoint_every),
    )
    resolve_backend(algorithm.attention_backend, trainer.strategy.root_device)  # fail before any process starts
    return module, datamodule, trainer


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt(f"received signal {signum}")


def run(cfg: DictConfig) -> dict:
    module, datamodule, trainer = build(cfg)
    # SIGTERM unwinds like Ctrl-C, so Lightning's teardown and our finally close the pool
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.resume)
    finally:
        datamodule.pool.close()
        signal.signal(signal.SIGTERM, previous)
    summary = next(c for c in trainer.callbacks if isinstance(c, RunSummary))
    return summary.summary


@hydra.main(config_path="pkg://lit_parl.conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)
