"""One row of benchmarks/sglang/learns.sh's table, from a run's metrics.csv (one row per iteration)."""

import csv
import sys

pool, seed, path = sys.argv[1:4]
rows = [r for r in csv.DictReader(open(path)) if r.get("reward")]
reward = [float(r["reward"]) for r in rows]
mismatch = max(float(r["mismatch/logprob_abs_diff"]) for r in rows)
first10, last10 = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
print(
    f"| {pool} | {seed} | {len(rows)} | {reward[0]:.3f} | {first10:.3f} | {last10:.3f} | {last10 - first10:+.3f} "
    f"| {mismatch:.1e} |"
)
