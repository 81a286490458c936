"""The learned-reward figure: each run's reward-model score and the property it encodes, per iteration.

    python benchmarks/rewards/plot_learning.py --out docs/reward_model_learning.png seed0=runs/x seed1=runs/y

Prints a table row per run: the first iteration's and the last 10 iterations' mean of both.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SERIES = (("reward/model", "reward-model score (logit)"), ("reward/even_share", "even-digit share (the property)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    args = parser.parse_args()
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    print("| run | iterations | score first | score last 10 | even share first | even share last 10 |")
    print("|---|---|---|---|---|---|")
    for spec in args.runs:
        label, run = spec.split("=", 1)
        rows = [r for r in csv.DictReader(open(Path(run) / "metrics.csv")) if r.get("reward")]
        columns = {key: [float(r[key]) for r in rows] for key, _ in SERIES}
        for axis, (key, title) in zip(axes, SERIES):
            axis.plot(columns[key], label=label)
            axis.set_title(title)
            axis.set_xlabel("iteration")
        score, share = columns["reward/model"], columns["reward/even_share"]
        print(
            f"| {label} | {len(rows)} | {score[0]:.2f} | {sum(score[-10:]) / 10:.2f} | {share[0]:.3f} "
            f"| {sum(share[-10:]) / 10:.3f} |"
        )
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(args.out, dpi=110)
    print(f"figure: {args.out}")


if __name__ == "__main__":
    main()
