#!/usr/bin/env bash
# The default job (`make train`) for several seeds, one after the other; prints each summary line.
# Usage: benchmarks/pipeline/default_run.sh [seeds...] [-- extra hydra overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."
seeds=(); extra=()
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
  seeds+=("$1"); shift
done
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
for seed in "${seeds[@]}"; do
  .venv/bin/lit-parl seed="$seed" run_dir="runs/default_seed$seed" "${extra[@]}" 2>/dev/null | grep '^lit_parl summary'
done
