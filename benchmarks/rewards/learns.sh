#!/usr/bin/env bash
# Does a policy learn from a learned reward? Trains the tiny digit reward model (train_reward_model.py: preference
# pairs that prefer even digits, written here), then the default job (the tiny Qwen2 on the copy task's prompts)
# against it alone through the CLI (reward=model), one seed at a time, with the property it encodes logged beside it
# at weight 0 (reward/even_share). Prints one row per seed and writes the figure (plot_learning.py).
# Usage: benchmarks/rewards/learns.sh [-n iterations] [-s "seeds"] [-o figure.png]
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=200; seeds="0 1 2"; figure=docs/reward_model_learning.png
while getopts "n:s:o:" opt; do
  case $opt in n) iterations=$OPTARG;; s) seeds=$OPTARG;; o) figure=$OPTARG;; *) exit 2;; esac
done
py=${PYTHON:-.venv/bin/python}
rm_dir=runs/digit_reward_model
[[ -f $rm_dir/config.json ]] || "$py" benchmarks/rewards/train_reward_model.py --out "$rm_dir"
runs=()
for seed in $seeds; do
  run=runs/reward_model_seed$seed
  "$(dirname "$py")/lit-parl" reward=model reward.model.path="$rm_dir" seed="$seed" iterations="$iterations" \
    +reward.even_share._target_=lit_parl.rewards.Reward \
    +reward.even_share.fn=benchmarks/rewards/digit_preference.py:even_share +reward.even_share.weight=0 \
    trainer.max_time=null run_dir="$run" callbacks.progress.refresh_rate=0 > "$run.log" 2>&1 \
    || { echo "seed=$seed FAILED: $run.log"; exit 1; }
  runs+=("seed$seed=$run")
done
"$py" benchmarks/rewards/plot_learning.py --out "$figure" "${runs[@]}"
