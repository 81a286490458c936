#!/usr/bin/env bash
# Sampling profile of a default run, both processes: the trainer and the spawned rollout worker.
# Needs py-spy (`.venv/bin/pip install py-spy`; a profiling tool only, not a dependency of lit_parl).
# Usage: benchmarks/pipeline/profile_default.sh [iterations] [-- extra hydra overrides]
# Writes runs/profile/pyspy.txt (collapsed stacks; the worker's stacks start with a second
# `process N:` frame) and prints the lit_parl / kernels functions of each process in ms per iteration.
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations="${1:-60}"; shift || true
[ "${1:-}" = "--" ] && shift
out=runs/profile
mkdir -p "$out"
rate=100
.venv/bin/py-spy record --subprocesses --format raw --rate "$rate" -o "$out/pyspy.txt" -- \
  .venv/bin/lit-parl iterations="$iterations" trainer.max_time=null checkpoint_every=0 run_dir="$out/run" "$@" \
  2>/dev/null | grep '^lit_parl summary' || true
.venv/bin/python - "$out/pyspy.txt" "$iterations" "$rate" <<'EOF'
import collections, re, sys
path, iterations, rate = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
ms = 1000.0 / rate / iterations
inclusive = collections.defaultdict(collections.Counter)
total = collections.Counter()
for line in open(path):
    stack, n = line.rstrip().rsplit(" ", 1)
    frames = stack.split(";")
    proc = "worker" if len(frames) > 1 and frames[1].startswith("process ") else "trainer"
    names = {re.sub(r":\d+\)", ")", f) for f in frames if not f.startswith("process ")}
    total[proc] += int(n)
    for name in names:
        inclusive[proc][name] += int(n)
for proc in ("trainer", "worker"):
    print(f"== {proc}: {total[proc] * ms:.1f} ms of samples per iteration (startup included)")
    for name, n in inclusive[proc].most_common():
        if re.search(r"\((lit_parl|kernels|callbacks)/", name) and "<module>" not in name:
            print(f"  {n * ms:8.2f} ms/it  {name[:140]}")
EOF
