#!/usr/bin/env bash
# Does the default job learn through real SGLang servers on this CPU? The default job (`lit-parl`, the tiny Qwen2
# copying digits) for each pool and seed, one run at a time, each for the same number of iterations
# (trainer.max_time=null: the 4.5-minute cap would give the slower pool fewer). Prints one row per run: the
# reward of the first iteration, the mean of the first 10 and of the last 10, and the largest per-iteration mean
# |rollout - trainer| log-prob (the runtime on-policy check passed on every group, or the run would have failed).
# Rewards only: the machine is shared, so its times say nothing about the pools.
# Usage (from .venv-sglang, where sglang and lit_parl are installed):
#   benchmarks/sglang/learns.sh [-n iterations] [-s "seeds"] [-p "pools"]
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=30; seeds="0 1 2"; pools="sglang hf"
while getopts "n:s:p:" opt; do
  case $opt in n) iterations=$OPTARG;; s) seeds=$OPTARG;; p) pools=$OPTARG;; *) exit 2;; esac
done
bin=${LIT_PARL:-.venv-sglang/bin/lit-parl}
mkdir -p runs
for pool in $pools; do
  for seed in $seeds; do
    run="runs/learns_${pool}_seed$seed" port=()
    # a free port for the server: the default 30000 may be another run's on a shared machine
    [[ $pool == sglang ]] && port=("pool.launch.port=$("$(dirname "$bin")/python" -c \
      'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')")
    "$bin" pool="$pool" seed="$seed" iterations="$iterations" trainer.max_time=null run_dir="$run" "${port[@]}" \
      callbacks.progress.refresh_rate=0 > "$run.log" 2>&1 || { echo "$pool seed=$seed FAILED: $run.log"; exit 1; }
    "$(dirname "$bin")/python" benchmarks/sglang/learns_row.py "$pool" "$seed" "$run/metrics.csv"
  done
done
