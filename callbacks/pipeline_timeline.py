"""PipelineTimeline: when the pool generated, when the trainer trained, when weights synced; and how much overlapped."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from .contracts import IterationHistory, SyncTimes, TrainIntervals, contract_problems, require
from .fit_end import EpochEndLogs, ends_iteration, new_record


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def overlap_efficiency(gen: list[tuple[float, float]], train: list[tuple[float, float]]) -> float:
    """The share of the shorter side's busy time during which the other side was busy too, in [0, 1].

    From the intervals themselves, not from the iteration's wall time: time when neither side ran (Lightning's
    epoch end after an early push, a loaded machine's scheduling gaps) is not overlap, and counted against it
    through the wall, it pushed the value below 0.
    """
    gen_busy, train_busy = _union_length(gen), _union_length(train)
    shorter = min(gen_busy, train_busy)
    if shorter <= 0:
        return 0.0
    both = gen_busy + train_busy - _union_length([*gen, *train])
    return min(1.0, max(0.0, both / shorter))  # the clamp only absorbs the sums' rounding


class PipelineTimeline(Callback):
    r"""Record every iteration's generation, training and weight-sync intervals; log how much they overlapped.

    After each iteration's last batch it logs the overlap efficiency

        time generating and training at once / min(gen_busy, train_busy)

    which is 1.0 when the shorter side is fully hidden behind the longer one and 0.0 when the two took
    turns, whatever the time when neither ran (``overlap_efficiency``). ``wall_s``, from the iteration's first
    request to its last training step, is recorded beside it; the weight sync before it is drawn but not
    counted. Each iteration's intervals (in seconds since training started)
    are appended to ``timeline.jsonl`` as it ends (one JSON object per line; ``load_timeline`` reads it), and
    only the last ``window`` stay in memory, so a run of any length holds the same. At the end of fit it
    draws those into ``timeline.png``, a Gantt chart. An iteration that a stop (``max_time``) cuts short is
    left out; one whose epoch end a resume skips is not (``lit_parl.callbacks.fit_end``). Its overlap efficiency
    is logged at the epoch's end, after ``WeightSync``'s push when listed after it.

    It reads the generation side from the last record of ``trainer.datamodule.history``
    (:class:`~lit_parl.callbacks.IterationHistory`: ``requested_at``, ``gen_intervals``), the training side
    from the module's ``train_intervals`` (:class:`~lit_parl.callbacks.TrainIntervals`), and the sync from
    the one other callback with ``sync_intervals`` (:class:`~lit_parl.callbacks.SyncTimes`, e.g.
    ``WeightSync``); with no such callback there is no sync row. A sync pushed at an epoch's end
    (``WeightSync(push_early=True)``) is the next iteration's and is drawn there. A checkpoint keeps the last
    ``window`` iterations and the count: a run resumed into the same ``dirpath`` keeps the file's lines up to
    the checkpoint and appends; resumed elsewhere (the CLI gives each run its own directory), its file starts
    at the restored count and the earlier lines stay in the first run's file.

    Override ``plot(path)`` to draw the chart differently (``self.iterations`` holds the last ``window``).

    Args:
        dirpath: where ``timeline.jsonl`` and ``timeline.png`` go. ``None``: ``trainer.default_root_dir``.
        window: how many of the last iterations are kept in memory and drawn.

    Raises:
        TypeError: at fit start, when the datamodule has no ``history`` of records or the LightningModule no
            ``train_intervals``.
        ValueError: at fit start, when more than one callback has ``sync_intervals``.

    Example (no sync callback: the chart has no sync row)::

        >>> import lightning, tempfile, time
        >>> from types import SimpleNamespace
        >>> from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
        >>> class Data(BoringDataModule):
        ...     history = []
        >>> class Model(BoringModel):
        ...     train_intervals = []
        ...     def on_train_epoch_start(self):
        ...         now = time.monotonic()
        ...         self.train_intervals = [(now, now + 0.2)]
        ...         self.trainer.datamodule.history.append(SimpleNamespace(version=self.current_epoch,
        ...             requested_at=now, completed_at=now + 0.1, completions=8, completion_tokens=80, reward_sum=4.0,
        ...             prompts_drawn=2, dropped_groups=0, gen_intervals=[(now, now + 0.1)], reward_mean=0.5,
        ...             gen_busy_s=0.1))
        >>> folder = tempfile.TemporaryDirectory()
        >>> timeline = PipelineTimeline(dirpath=folder.name)
        >>> trainer = lightning.Trainer(accelerator="cpu", max_epochs=2, limit_train_batches=2, limit_val_batches=0,
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ...     callbacks=[timeline])
        >>> trainer.fit(Model(), datamodule=Data())
        >>> [(it["iteration"], round(it["gen_busy_s"], 3), round(it["train_busy_s"], 3)) for it in timeline.iterations]
        [(0, 0.1, 0.2), (1, 0.1, 0.2)]
        >>> sorted(path.name for path in Path(timeline.dirpath).iterdir())
        ['timeline.jsonl', 'timeline.png']
        >>> [it["iteration"] for it in load_timeline(Path(timeline.dirpath) / "timeline.jsonl")]
        [0, 1]
        >>> folder.cleanup()
    """

    def __init__(self, dirpath: str | None = None, window: int = 6) -> None:
        self.dirpath = dirpath
        self.window = window
        self.iterations: deque[dict[str, Any]] = deque(maxlen=window)  # the last `window`; checkpointed
        self.count = 0  # iterations recorded in the whole run (timeline.jsonl's lines); checkpointed
        self._sync_source: SyncTimes | None = None
        self._last_sync: tuple[float, float] | None = None  # the newest sync interval already drawn
        self._file: Path | None = None
        self._last_record: Any = None
        self._logs = EpochEndLogs()  # this iteration's value, logged after the push
        self._epoch_start = 0.0
        self._origin = 0.0  # monotonic time that is 0 s in self.iterations: when training started
        self._offset = 0.0  # a resumed run continues after the restored iterations instead of overdrawing them

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        require(
            trainer.datamodule,
            IterationHistory,
            owner="PipelineTimeline",
            role="the datamodule",
            fix="Give the datamodule a `history` list and append one record per iteration (fields of "
            "lit_parl.callbacks.IterationRecord), as lit_parl.RolloutDataModule does.",
        )
        require(
            pl_module,
            TrainIntervals,
            owner="PipelineTimeline",
            role="the LightningModule",
            fix="Set `self.train_intervals = []` at each epoch start and append (start, end) time.monotonic() "
            "pairs around each training step, as lit_parl.GRPOModule does.",
        )
        sources = [cb for cb in trainer.callbacks if cb is not self and not contract_problems(cb, SyncTimes)]
        if len(sources) > 1:
            raise ValueError(
                f"PipelineTimeline draws one weight-sync row, but {len(sources)} callbacks have `sync_intervals`: "
                f"{', '.join(type(cb).__name__ for cb in sources)}. Keep one of them."
            )
        self._sync_source = sources[0] if sources else None
        self._last_sync = sources[0].sync_intervals[-1] if sources and sources[0].sync_intervals else None
        self._last_record = None
        self._file = Path(self.dirpath or trainer.default_root_dir) / "timeline.jsonl"
        if trainer.is_global_zero:  # keep the lines of the iterations this run restored (none for a new run)
            kept = (
                self._file.read_text().splitlines(keepends=True)[: self.count]
                if self._file.exists() and self.count
                else []
            )
            self._file.parent.mkdir(parents=True, exist_ok=True)
            self._file.write_text("".join(kept))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # here, not at the first epoch's start: a fit resumed inside an epoch starts it without on_train_epoch_start
        self._origin = self._epoch_start = time.monotonic()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not ends_iteration(trainer):  # booked here, not at the epoch's end: see lit_parl.callbacks.fit_end
            return
        record = new_record(trainer, self._last_record, owner="PipelineTimeline", left_out_of="timeline")
        if record is None:
            return
        self._last_record = record
        end = time.monotonic()
        train = list(pl_module.train_intervals)
        sync: list[tuple[float, float]] = []
        if self._sync_source is not None:  # the syncs since the last one drawn (the source may keep only its last few)
            for interval in reversed(self._sync_source.sync_intervals):
                if interval == self._last_sync:
                    break
                sync.insert(0, tuple(interval))
            self._last_sync = sync[-1] if sync else self._last_sync
        gen = list(record.gen_intervals)
        gen_busy, train_busy = _union_length(gen), _union_length(train)
        # the iteration's window: from its requests to its last training step (the weight sync before it is apart)
        wall = (train[-1][1] if train else end) - record.requested_at
        efficiency = overlap_efficiency(gen, train)
        o = self._origin - self._offset
        entry = {
            "iteration": self.count,
            "sync": [(s - o, e - o) for s, e in sync],
            "generate": [(s - o, e - o) for s, e in gen],
            "train": [(s - o, e - o) for s, e in train],
            "start": self._epoch_start - o,
            "end": end - o,
            "gen_busy_s": gen_busy,
            "train_busy_s": train_busy,
            "wall_s": wall,
            "overlap_efficiency": efficiency,
            # the first step on the pool's cores too (lit_parl.data.core_share): the planner measures those apart
            "lent_from": getattr(record, "lent_from", None),
        }
        self.iterations.append(entry)
        self.count += 1
        if trainer.is_global_zero:
            with self._file.open("a") as lines:
                lines.write(json.dumps(entry) + "\n")
        self._logs.book("overlap_efficiency", efficiency)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._logs.log(pl_module)  # after WeightSync's push (lit_parl.callbacks.fit_end.EpochEndLogs)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.iterations:
            return
        self.plot(self._file.parent / "timeline.png")

    def plot(self, path: Path) -> None:
        """Draw the last ``window`` iterations of ``self.iterations`` as a Gantt chart into ``path``."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = list(self.iterations)
        t0 = shown[0]["start"]
        rows = [("rollout pool: generate", "generate", "#1f77b4"), ("trainer: train", "train", "#ff7f0e")]
        if any(it["sync"] for it in shown):
            rows.insert(0, ("weight sync", "sync", "#7f7f7f"))
        fig, ax = plt.subplots(figsize=(11, 0.6 + 0.75 * len(rows)))
        for y, (label, key, colour) in enumerate(reversed(rows)):
            spans = [(s - t0, e - s) for it in shown for s, e in it[key]]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=colour, label=label)
        for it in shown:
            ax.axvline(it["start"] - t0, color="black", lw=0.6, ls=":")
            ax.text(
                it["start"] - t0,
                len(rows) - 0.45,
                f" it {it['iteration']}\n eff {it['overlap_efficiency']:.2f}",
                fontsize=7,
                va="top",
            )
        ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
        ax.set_xlabel("seconds")
        ax.set_title("generation and training overlap inside each iteration; iterations never overlap", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def state_dict(self) -> dict[str, Any]:
        return {"iterations": list(self.iterations), "count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.iterations = deque(state_dict["iterations"], maxlen=self.window)
        self.count = state_dict.get("count", len(state_dict["iterations"]))  # older checkpoints kept every iteration
        self._offset = self.iterations[-1]["end"] if self.iterations else 0.0


def load_timeline(path: str | Path) -> list[dict[str, Any]]:
    """The iterations a ``PipelineTimeline`` wrote to ``timeline.jsonl``, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
