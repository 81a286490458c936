"""RunSummary: per-iteration throughput on the progress bar, and one JSON summary line at the end.

Reads the datamodule's iteration history (rollout side) and the module's ``train_intervals`` (trainer
side). Writes ``summary.json`` to ``dirpath`` and prints ``lit_parl summary: {json}``.

Example::

    summary = RunSummary()
    lightning.Trainer(callbacks=[WeightSync(), summary]).fit(module, datamodule=data)
    summary.summary["reward_last10"]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


class RunSummary(Callback):
    def __init__(self, dirpath: str | None = None, last_n: int = 10) -> None:
        self.dirpath = dirpath  # None: trainer.default_root_dir
        self.last_n = last_n
        self.rewards: list[float] = []
        self.completions = 0
        self.tokens = 0
        self.gen_busy_s = 0.0
        self.train_busy_s = 0.0
        self.wall_s = 0.0
        self.summary: dict = {}
        self._fit_start = 0.0
        self._epoch_start = 0.0

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.monotonic()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = time.monotonic()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        datamodule = trainer.datamodule
        if not getattr(datamodule, "history", None):
            return
        stats = datamodule.history[-1]
        wall = time.monotonic() - self._epoch_start
        train_busy = sum(end - start for start, end in getattr(pl_module, "train_intervals", []))
        self.rewards.append(stats.reward_mean)  # the iteration's rollouts, before any reward shaping
        self.completions += stats.completions
        self.tokens += stats.completion_tokens
        self.gen_busy_s += stats.gen_busy_s
        self.train_busy_s += train_busy
        pl_module.log("completions_per_s", stats.completions / max(wall, 1e-9), prog_bar=True, on_epoch=True)
        pl_module.log("tokens_per_s", stats.completion_tokens / max(wall, 1e-9), on_epoch=True)
        pl_module.log("gen_busy_s", stats.gen_busy_s, on_epoch=True)
        pl_module.log("train_busy_s", train_busy, on_epoch=True)
        pl_module.log("dropped_groups", float(stats.dropped_groups), on_epoch=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.wall_s += time.monotonic() - self._fit_start
        run_dir = Path(self.dirpath or trainer.default_root_dir)
        last = self.rewards[-self.last_n :]
        self.summary = {
            "iterations": len(self.rewards),
            "mode": getattr(trainer.datamodule, "mode", None),
            "reward_first": self.rewards[0] if self.rewards else None,
            "reward_last10": sum(last) / len(last) if last else None,
            "wall_s": round(self.wall_s, 3),
            "completions": self.completions,
            "completions_per_s": round(self.completions / max(self.wall_s, 1e-9), 2),
            "tokens_per_s": round(self.tokens / max(self.wall_s, 1e-9), 2),
            "gen_busy_s": round(self.gen_busy_s, 3),
            "train_busy_s": round(self.train_busy_s, 3),
            "run_dir": str(run_dir.resolve()),
        }
        if trainer.is_global_zero:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
            print(f"lit_parl summary: {json.dumps(self.summary)}", flush=True)

    def state_dict(self) -> dict:
        keys = ("rewards", "completions", "tokens", "gen_busy_s", "train_busy_s", "wall_s")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state_dict: dict) -> None:
        for key, value in state_dict.items():
            setattr(self, key, value)
