#!/usr/bin/env bash
# lit_parl's own settings for one model: the job run once per variant (a string of Hydra overrides), one after
# the other, seed 0; prints completions/s, the reward of the last 10 iterations, the pool's and the trainer's
# busy seconds and the wall seconds. Used to find lit_parl's best chunking for a model size (benchmarks/RESULTS.md).
# Usage: benchmarks/pipeline/config_sweep.sh HIDDEN LAYERS ITERATIONS "variant overrides" ["variant" ...]
#   benchmarks/pipeline/config_sweep.sh 64 2 100 "" "pool.prompts_per_request=16 shape.micro_batch_size=128"
# The MLP is 4x the hidden size and the heads 4, as benchmarks/vs_trl/vs_trl.py's models. Workload (b) of
# vs_trl.py: PYTHONPATH=benchmarks/vs_trl and "data._target_=vs_trl_task.PreambleCopyTask +data.preamble_chars=200".
set -euo pipefail
cd "$(dirname "$0")/../.."
hidden=$1; layers=$2; iterations=$3; shift 3
model="model.hidden_size=$hidden model.intermediate_size=$((4 * hidden)) model.num_layers=$layers"
run_dir=$(mktemp -d /tmp/lit_parl_sweep_XXXXXX)
trap 'rm -rf "$run_dir"' EXIT
echo "completions/s, reward (last 10), generation busy s, training busy s, wall s | variant"
for variant in "$@"; do
  # shellcheck disable=SC2086
  .venv/bin/lit-parl seed=0 iterations="$iterations" checkpoint_every=0 trainer.max_time=null run_dir="$run_dir" \
    $model $variant 2>/dev/null | grep '^lit_parl summary' | .venv/bin/python -c "
import json, sys
s = json.loads(sys.stdin.read().split(': ', 1)[1])
print(round(s['completions_per_s']), round(s['reward_last10'], 3), round(s['gen_busy_s'], 2), round(s['train_busy_s'], 2),
      round(s['wall_s'], 2), '|', sys.argv[1] or '(the default)')" "$variant"
  rm -rf "${run_dir:?}"/*
done
