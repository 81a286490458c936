"""RunSummary: per-iteration throughput on the progress bar, and one JSON summary of the run at the end."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from .contracts import IterationHistory, TrainIntervals, require
from .fit_end import EpochEndLogs, ends_iteration, new_record


class RunSummary(Callback):
    r"""Log each iteration's throughput and write ``summary.json`` (and print it on one line) when fit ends.

    After each iteration's last batch it reads the iteration's record, the last of ``trainer.datamodule.history``
    (:class:`~lit_parl.callbacks.IterationHistory`: completions, tokens, rewards, generation time), and the
    module's ``train_intervals`` (:class:`~lit_parl.callbacks.TrainIntervals`), and at the epoch's end (after
    ``WeightSync``'s push when listed after it) logs ``completions_per_s`` (on the progress bar), ``tokens_per_s``,
    ``gen_busy_s``, ``train_busy_s`` and ``dropped_groups``. At the end of fit it writes the totals to
    ``<dirpath>/summary.json`` and prints ``lit_parl summary: {...}``; ``self.summary`` holds the same dict.
    Totals survive a checkpoint, also one written after an iteration's last batch, whose epoch end a resume
    skips; an iteration that a stop (``max_time``) cuts short is left out (``lit_parl.callbacks.fit_end``).

    Override ``make_summary(trainer)`` to add or change fields.

    Args:
        dirpath: where ``summary.json`` goes. ``None``: ``trainer.default_root_dir``.
        last_n: ``reward_last<last_n>`` (``reward_last10`` by default) is the mean reward of the last
            ``last_n`` iterations.

    Raises:
        TypeError: at fit start, when the datamodule has no ``history`` of records or the LightningModule no
            ``train_intervals``.

    Example (a datamodule that books one record per epoch, as ``lit_parl.RolloutDataModule`` does)::

        >>> import lightning, tempfile, time
        >>> from types import SimpleNamespace
        >>> from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
        >>> class Data(BoringDataModule):
        ...     history = []
        >>> class Model(BoringModel):
        ...     train_intervals = []
        ...     def on_train_epoch_start(self):
        ...         now = time.monotonic()
        ...         self.trainer.datamodule.history.append(SimpleNamespace(version=self.current_epoch,
        ...             requested_at=now, completed_at=now, completions=8, completion_tokens=80, reward_sum=4.0,
        ...             prompts_drawn=2, dropped_groups=0, gen_intervals=[], reward_mean=0.5, gen_busy_s=0.0))
        >>> folder = tempfile.TemporaryDirectory()
        >>> summary = RunSummary(dirpath=folder.name)
        >>> trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=0,
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ...     callbacks=[summary])
        >>> trainer.fit(Model(), datamodule=Data())  # doctest: +ELLIPSIS
        lit_parl summary: {"iterations": 2, "mode": null, "reward_first": 0.5, "reward_last10": 0.5, ...}
        >>> summary.summary["completions"], (Path(summary.dirpath) / "summary.json").exists()
        (16, True)
        >>> folder.cleanup()
    """

    def __init__(self, dirpath: str | None = None, last_n: int = 10) -> None:
        self.dirpath = dirpath
        self.last_n = last_n
        # the run's totals: checkpointed, so a resumed run's summary covers the whole run. Of the rewards,
        # only the first and the last `last_n`: a run of any length holds the same.
        self.iterations = 0
        self.reward_first: float | None = None
        self.rewards: deque[float] = deque(maxlen=last_n)
        self.completions = 0
        self.tokens = 0
        self.gen_busy_s = 0.0
        self.train_busy_s = 0.0
        self.wall_s = 0.0  # of earlier fits (a resumed run); this fit's time is added from _fit_start
        self.summary: dict[str, Any] = {}
        self._fit_start: float | None = None
        self._epoch_start = 0.0
        self._last_record: Any = None
        self._logs = EpochEndLogs()  # this iteration's values, logged after the push

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require(
            trainer.datamodule,
            IterationHistory,
            owner="RunSummary",
            role="the datamodule",
            fix="Give the datamodule a `history` list and append one record per iteration (fields of "
            "lit_parl.callbacks.IterationRecord), as lit_parl.RolloutDataModule does.",
        )
        require(
            pl_module,
            TrainIntervals,
            owner="RunSummary",
            role="the LightningModule",
            fix="Set `self.train_intervals = []` at each epoch start and append (start, end) time.monotonic() "
            "pairs around each training step, as lit_parl.GRPOModule does.",
        )
        self._fit_start = time.monotonic()
        self._last_record = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = time.monotonic()  # a fit resumed inside an epoch starts it without on_train_epoch_start

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not ends_iteration(trainer):  # booked here, not at the epoch's end: see lit_parl.callbacks.fit_end
            return
        record = new_record(trainer, self._last_record, owner="RunSummary", left_out_of="summary")
        if record is None:
            return
        self._last_record = record
        wall = max(time.monotonic() - self._epoch_start, 1e-9)
        train_busy = sum(end - start for start, end in pl_module.train_intervals)
        # Under several ranks each record holds its rank's share: counts are summed over the ranks, busy times
        # averaged (the ranks generate and train side by side). One reduction; on one device it changes nothing.
        local = torch.tensor(
            [
                record.completions,
                record.completion_tokens,
                record.reward_sum,
                record.dropped_groups,
                record.gen_busy_s,
                train_busy,
            ],
            dtype=torch.float64,
            device=pl_module.device,
        )
        completions, tokens, reward_sum, dropped, gen_busy, train_busy = trainer.strategy.reduce(
            local, reduce_op="sum"
        ).tolist()
        gen_busy, train_busy = gen_busy / trainer.world_size, train_busy / trainer.world_size
        reward = reward_sum / max(completions, 1)  # the iteration's rollouts, before any reward shaping
        self.reward_first = reward if self.iterations == 0 else self.reward_first
        self.rewards.append(reward)
        self.iterations += 1
        self.completions += int(completions)
        self.tokens += int(tokens)
        self.gen_busy_s += gen_busy
        self.train_busy_s += train_busy
        self._logs.book("completions_per_s", completions / wall, prog_bar=True)
        self._logs.book("tokens_per_s", tokens / wall)
        self._logs.book("gen_busy_s", gen_busy)
        self._logs.book("train_busy_s", train_busy)
        self._logs.book("dropped_groups", dropped)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logs.log(pl_module)  # after WeightSync's push (lit_parl.callbacks.fit_end.EpochEndLogs)

    def make_summary(self, trainer: Trainer) -> dict[str, Any]:
        """The summary of the run so far (what ``summary.json`` holds)."""
        wall = self._total_wall_s()
        return {
            "iterations": self.iterations,
            "mode": getattr(trainer.datamodule, "mode", None),  # optional: lit_parl's "async" / "sync"
            "reward_first": self.reward_first,
            f"reward_last{self.last_n}": sum(self.rewards) / len(self.rewards) if self.rewards else None,
            "wall_s": round(wall, 3),
            "completions": self.completions,
            "completions_per_s": round(self.completions / max(wall, 1e-9), 2),
            "tokens_per_s": round(self.tokens / max(wall, 1e-9), 2),
            "gen_busy_s": round(self.gen_busy_s, 3),
            "train_busy_s": round(self.train_busy_s, 3),
            "run_dir": str(self._run_dir(trainer).resolve()),
        }

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.wall_s, self._fit_start = self._total_wall_s(), None  # first: the summary reads the final wall time
        self.summary = self.make_summary(trainer)
        if trainer.is_global_zero:
            run_dir = self._run_dir(trainer)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
            print(f"lit_parl summary: {json.dumps(self.summary)}", flush=True)

    def _run_dir(self, trainer: Trainer) -> Path:
        return Path(self.dirpath or trainer.default_root_dir)

    def _total_wall_s(self) -> float:
        return self.wall_s + (time.monotonic() - self._fit_start if self._fit_start is not None else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {
            "iterations": self.iterations,
            "reward_first": self.reward_first,
            "rewards": list(self.rewards),
            "completions": self.completions,
            "tokens": self.tokens,
            "gen_busy_s": self.gen_busy_s,
            "train_busy_s": self.train_busy_s,
            "wall_s": self._total_wall_s(),  # a checkpoint taken mid-fit counts this fit's time so far
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        rewards = state_dict["rewards"]  # checkpoints before the bounded record held every iteration's
        self.iterations = state_dict.get("iterations", len(rewards))
        self.reward_first = state_dict.get("reward_first", rewards[0] if rewards else None)
        self.rewards = deque(rewards, maxlen=self.last_n)
        self.completions = state_dict["completions"]
        self.tokens = state_dict["tokens"]
        self.gen_busy_s = state_dict["gen_busy_s"]
        self.train_busy_s = state_dict["train_busy_s"]
        self.wall_s = state_dict["wall_s"]
