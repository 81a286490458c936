"""Tables from benchmarks/pipeline/interleave.sh's output: completions/s per run and their median for each variant,
against the first variant; with two variants, the seed-by-seed comparison (rewards and speed).

Usage: python benchmarks/pipeline/interleave_table.py interleave.log
"""

from __future__ import annotations

import json
import re
import statistics
import sys


def main(path: str) -> None:
    runs: dict[str, list[tuple[int, dict]]] = {}
    for line in open(path):
        match = re.match(r"(\S+) seed=(\d+) lit_parl summary: (.*)", line.strip())
        if match:
            runs.setdefault(match[1], []).append((int(match[2]), json.loads(match[3])))
    labels = list(runs)
    base = statistics.median(s["completions_per_s"] for _, s in runs[labels[0]])
    print("| variant | completions/s, each run | median | against the first |\n|---|---|---|---|")
    for label in labels:
        speeds = [s["completions_per_s"] for _, s in runs[label]]
        median = statistics.median(speeds)
        print(f"| {label} | {', '.join(f'{v:.0f}' for v in speeds)} | {median:.0f} | {median / base:.3f}x |")
    if len(labels) != 2:
        return
    first, second = (dict(runs[label]) for label in labels)
    print(f"\n| seed | rewards | completions/s {labels[0]} | {labels[1]} | ratio |\n|---|---|---|---|---|")
    ratios = []
    for seed in sorted(first.keys() & second.keys()):
        a, b = first[seed], second[seed]
        same = (a["reward_first"], a["reward_last10"]) == (b["reward_first"], b["reward_last10"])
        ratios.append(b["completions_per_s"] / a["completions_per_s"])
        rewards = f"{a['reward_first']:.6f} / {a['reward_last10']:.6f} " + (
            "(identical)" if same else f"vs {b['reward_first']:.6f} / {b['reward_last10']:.6f}"
        )
        print(
            f"| {seed} | {rewards} | {a['completions_per_s']:.0f} | {b['completions_per_s']:.0f} | {ratios[-1]:.3f} |"
        )
    for key in ("wall_s", "gen_busy_s", "train_busy_s", "cpu_s"):
        if all(key in s for side in (first, second) for s in side.values()):
            medians = [statistics.median(s[key] for s in side.values()) for side in (first, second)]
            print(f"median {key}: {medians[0]:.1f} -> {medians[1]:.1f} ({medians[1] / medians[0]:.3f}x)")
    print(f"median of the per-seed ratios: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
