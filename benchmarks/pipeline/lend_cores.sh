#!/usr/bin/env bash
# Cores follow the work: the same job with the pool's cores lent to the trainer's tail (CoreShare) and without,
# interleaved; prints completions/s, each side's busy time and the last-10 reward per run.
#   base           datamodule.lend_cores=false (prefetch off: the CPU default without lending)
#   prefetch       datamodule.lend_cores=false datamodule.prefetch=true (the thread alone)
#   lend           datamodule.lend_cores=true (with the prefetch thread, as lending turns it on)
# Usage: benchmarks/pipeline/lend_cores.sh MODEL ITERATIONS REPS [extra overrides...]
#   MODEL: default (the default job's model) or h64 / h128 / h256x4 (benchmarks/vs_trl's models, lr 5e-4, beta 0)
set -euo pipefail
cd "$(dirname "$0")/../.."
model=$1; iterations=$2; reps=$3; shift 3
model_overrides=()
if [ "$model" != default ]; then
  dir=/tmp/lit_parl_lend_model_$model
  .venv/bin/python -c "import sys; sys.path.insert(0, 'benchmarks/vs_trl'); import vs_trl; from pathlib import Path; vs_trl.save_model(Path('$dir'), '$model', 0)" 2>/dev/null
  model_overrides=(model=pretrained "model.path=$dir" optimizer.lr=5e-4 algorithm.objective.beta=0.0)
fi
declare -A variants=(
  [base]="datamodule.lend_cores=false"
  [prefetch]="datamodule.lend_cores=false datamodule.prefetch=true"
  [lend]="datamodule.lend_cores=true"
)
for rep in $(seq "$reps"); do
  for variant in base prefetch lend; do
    # shellcheck disable=SC2086
    .venv/bin/lit-parl seed=0 iterations="$iterations" checkpoint_every=0 trainer.max_time=null \
      run_dir=/tmp/lit_parl_lend_run "${model_overrides[@]}" ${variants[$variant]} "$@" 2>/dev/null \
      | grep '^lit_parl summary' | sed "s/^/$model $variant rep=$rep /"
  done
done
rm -rf /tmp/lit_parl_lend_run
