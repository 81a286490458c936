"""The built-in environments' learning curves: reward per iteration of each seed, as a table and a plot.

Reads the ``metrics.csv`` of runs of ``lit-parl +experiment=guess_number`` and ``+experiment=calculator``
(copied to ``benchmarks/logs/<task>_seed<k>_metrics.csv``), prints the reward averaged over blocks of
iterations and writes ``docs/episodes_curves.png``.

    .venv/bin/python benchmarks/episodes/learning_curves.py
"""

from __future__ import annotations

import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"guess_number": 150, "calculator": 300}  # iterations of each run


def rewards(path: Path) -> list[float]:
    rows = [row for row in csv.DictReader(path.open()) if row.get("reward")]
    return [float(row["reward"]) for row in sorted(rows, key=lambda row: int(row["epoch"]))]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(TASKS), figsize=(10, 3.5))
    for axis, (task, iterations) in zip(axes, TASKS.items()):
        block = iterations // 6
        for path in sorted((ROOT / "benchmarks" / "logs").glob(f"{task}_seed*_metrics.csv")):
            curve = rewards(path)
            means = [sum(curve[i : i + block]) / len(curve[i : i + block]) for i in range(0, len(curve), block)]
            seed = path.name.split("_seed")[1].split("_")[0]
            print(f"{task} seed {seed}: reward per {block} iterations", " ".join(f"{m:.3f}" for m in means))
            axis.plot(range(len(curve)), curve, label=f"seed {seed}", linewidth=1)
        axis.set_title(f"{task} (tiny model, CPU)")
        axis.set_xlabel("iteration")
        axis.set_ylabel("training reward")
        axis.legend()
    figure.tight_layout()
    figure.savefig(ROOT / "docs" / "episodes_curves.png", dpi=90)


if __name__ == "__main__":
    main()
