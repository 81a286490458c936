"""PipelineTimeline: when the pool generated, when the trainer trained, when weights synced.

Every iteration it logs the overlap efficiency

    (gen_busy + train_busy - iteration_wall) / min(gen_busy, train_busy)

which is 1.0 when the shorter side is fully hidden behind the longer one and 0.0 when the two took
turns. ``iteration_wall`` runs from the iteration's first request to its last training step; the weight
sync before it is drawn but not counted. At the end of the run it writes ``timeline.json`` (every interval of every iteration) and
``timeline.png``: a Gantt chart of the last ``window`` iterations.

Reads ``trainer.datamodule.history[-1].gen_intervals`` (rollout side), ``pl_module.train_intervals``
(trainer side) and times the weight sync itself.

Example::

    trainer = lightning.Trainer(callbacks=[WeightSync(), PipelineTimeline("runs/x")])
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def overlap_efficiency(gen_busy: float, train_busy: float, wall: float) -> float:
    shorter = min(gen_busy, train_busy)
    return (gen_busy + train_busy - wall) / shorter if shorter > 0 else 0.0


class PipelineTimeline(Callback):
    def __init__(self, dirpath: str | None = None, window: int = 6) -> None:
        self.dirpath = dirpath  # None: trainer.default_root_dir
        self.window = window
        self.iterations: list[dict] = []
        self._epoch_start = 0.0
        self._origin: float | None = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = time.monotonic()
        if self._origin is None:
            self._origin = self._epoch_start

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        history = getattr(trainer.datamodule, "history", None)
        if not history:
            return
        stats = history[-1]
        end = time.monotonic()
        train = list(getattr(pl_module, "train_intervals", []))
        sync = [interval for cb in trainer.callbacks for interval in getattr(cb, "sync_intervals", [])[-1:]]
        gen_busy, train_busy = _union_length(stats.gen_intervals), _union_length(train)
        # the iteration's window: from its requests to its last training step (the weight sync before it is apart)
        wall = (train[-1][1] if train else end) - stats.requested_at
        efficiency = overlap_efficiency(gen_busy, train_busy, wall)
        o = self._origin
        self.iterations.append({
            "iteration": len(self.iterations),
            "sync": [(s - o, e - o) for s, e in sync],
            "generate": [(s - o, e - o) for s, e in stats.gen_intervals],
            "train": [(s - o, e - o) for s, e in train],
            "start": self._epoch_start - o,
            "end": end - o,
            "gen_busy_s": gen_busy,
            "train_busy_s": train_busy,
            "wall_s": wall,
            "overlap_efficiency": efficiency,
        })
        pl_module.log("overlap_efficiency", efficiency, on_epoch=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero or not self.iterations:
            return
        directory = Path(self.dirpath or trainer.default_root_dir)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "timeline.json").write_text(json.dumps(self.iterations))
        self.plot(directory / "timeline.png")

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shown = self.iterations[-self.window :]
        t0 = shown[0]["start"]
        rows = [("weight sync", "sync", "#7f7f7f"), ("rollout pool: generate", "generate", "#1f77b4"), ("trainer: train", "train", "#ff7f0e")]
        fig, ax = plt.subplots(figsize=(11, 2.8))
        for y, (label, key, colour) in enumerate(reversed(rows)):
            spans = [(s - t0, e - s) for it in shown for s, e in it[key]]
            ax.broken_barh(spans, (y - 0.35, 0.7), facecolors=colour, label=label)
        for it in shown:
            ax.axvline(it["start"] - t0, color="black", lw=0.6, ls=":")
            ax.text(it["start"] - t0, len(rows) - 0.45, f" it {it['iteration']}\n eff {it['overlap_efficiency']:.2f}", fontsize=7, va="top")
        ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)])
        ax.set_xlabel("seconds")
        ax.set_title("lit_parl pipeline: generation and training overlap inside each iteration; iterations never overlap", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)

    def state_dict(self) -> dict:
        return {"iterations": self.iterations}

    def load_state_dict(self, state_dict: dict) -> None:
        self.iterations = state_dict["iterations"]
