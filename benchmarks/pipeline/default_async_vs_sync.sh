#!/usr/bin/env bash
# The default job (`make train`: 32 prompts x 8, the default model) in async mode against its synchronous
# baselines, interleaved seed by seed; prints each run's summary line, then completions/s per mode.
#   sync     generate everything, then train, each phase on both cores (colocated threads: all cores)
#   sync-1t  the same with one thread per phase
#   sync-256 sync on both cores with the iteration's 32 prompts in one chunk and its 256 samples in one micro-batch
#            (the same optimizer step: the micro-batch size changes only the order of the gradient's sums)
# Usage: benchmarks/pipeline/default_async_vs_sync.sh [iterations] [seeds...]
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=${1:-300}; shift || true
seeds=("$@"); [ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
declare -A modes=(
  [async]=""
  [sync]="datamodule.mode=sync"
  [sync-1t]="datamodule.mode=sync datamodule.trainer_threads=1 +pool.colocated_threads=1"
  [sync-256]="datamodule.mode=sync pool.prompts_per_request=32 shape.micro_batch_size=256"
)
for seed in "${seeds[@]}"; do
  for mode in async sync sync-1t sync-256; do
    # shellcheck disable=SC2086
    line=$(.venv/bin/lit-parl seed="$seed" iterations="$iterations" checkpoint_every=0 trainer.max_time=null \
      run_dir="/tmp/lit_parl_default_${mode}_$seed" ${modes[$mode]} 2>/dev/null | grep '^lit_parl summary')
    echo "$mode seed=$seed $line"
    rm -rf "/tmp/lit_parl_default_${mode}_$seed"
  done
done
