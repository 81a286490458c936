#!/usr/bin/env bash
# OpenMP's spin (GOMP_SPINCOUNT) on a quiet machine and beside one other busy process, interleaved: the default
# job in sync mode (its trainer on every core: the setting that collapsed when another process took a core).
# For each repetition: for each spin count, a run without and a run with one busy process (a Python loop, as
# another job on the machine). Prints "<load>_spin<N> seed=0 lit_parl summary: {...}" per run;
# benchmarks/pipeline/interleave_table.py turns it into a table.
# Usage: benchmarks/pipeline/spin_under_load.sh [-n iterations] [-r repetitions] [-m mode] "SPINS" [overrides...]
#   SPINS: GOMP_SPINCOUNT values, e.g. "0 10000 100000"
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=30; reps=1; mode=sync
while getopts "n:r:m:" opt; do
  case $opt in n) iterations=$OPTARG;; r) reps=$OPTARG;; m) mode=$OPTARG;; *) exit 2;; esac
done
shift $((OPTIND - 1)); spins=$1; shift
hog=""
trap '[[ -n $hog ]] && kill "$hog" 2>/dev/null; rm -rf runs/spin_under_load' EXIT
for _ in $(seq 1 "$reps"); do
  for spin in $spins; do
    for load in quiet loaded; do
      [[ $load == loaded ]] && { python3 -c 'while True: pass' & hog=$!; }
      line=$(GOMP_SPINCOUNT=$spin .venv/bin/lit-parl seed=0 iterations="$iterations" checkpoint_every=0 \
        trainer.max_time=null datamodule.mode="$mode" run_dir=runs/spin_under_load "$@" 2>/dev/null \
        | grep '^lit_parl summary')
      [[ -n $hog ]] && { kill "$hog"; wait "$hog" 2>/dev/null || true; hog=""; }
      echo "${load}_spin$spin seed=0 $line"
    done
  done
done
