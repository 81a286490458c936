"""Learning curves of `lit-parl +experiment=smollm2_reverse` runs: training reward and held-out greedy reward per
iteration, one line per run, from each run's `metrics.csv`.

    .venv/bin/python benchmarks/smollm2/plot_curves.py --out docs/smollm2_reverse.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{metric: [(iteration, value)]}`` of the training reward and the held-out greedy reward and accuracy."""
    out: dict[str, list[tuple[int, float]]] = {"reward": [], "val/greedy_reward": [], "val/greedy_accuracy": []}
    for row in csv.DictReader(open(run_dir / "metrics.csv")):
        for key, points in out.items():
            if row.get(key):
                points.append((int(row["epoch"]), float(row[key])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    args = parser.parse_args()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for spec in args.runs:
        label, run_dir = spec.split("=", 1)
        data = curves(Path(run_dir))
        line = axes[0].plot(*zip(*data["reward"]), label=label, alpha=0.8)[0]
        axes[1].plot(*zip(*data["val/greedy_reward"]), marker="o", color=line.get_color(), label=f"{label}: reward")
        axes[1].plot(
            *zip(*data["val/greedy_accuracy"]), marker="x", ls="--", color=line.get_color(), label=f"{label}: exact"
        )
    axes[0].set(title="training reward (mean over the iteration's samples)", xlabel="iteration", ylim=(0, 1))
    axes[1].set(title="held-out prompts, greedy", xlabel="iteration", ylim=(0, 1))
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
