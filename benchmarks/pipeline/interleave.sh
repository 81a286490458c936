#!/usr/bin/env bash
# The default job under several variants, interleaved: for each repetition and seed, one run of each
# variant in turn, one run at a time. Prints "<label> seed=<S> lit_parl summary: {...}" per run;
# benchmarks/pipeline/interleave_table.py turns that output into the tables of RESULTS.md.
# -c adds each run's CPU seconds (user + system, the trainer and the workers it reaped; /usr/bin/time) to its
# summary as "cpu_s": on a shared machine CPU time moves far less than wall time with the neighbours' load.
# Usage: benchmarks/pipeline/interleave.sh [-n iterations] [-r repetitions] [-s "seeds"] [-c] LABEL=BIN[:overrides] ...
#   BIN: a lit-parl executable (e.g. one installed from another commit in a venv of its own);
#   overrides: more Hydra overrides for that variant, separated by spaces.
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=""; reps=1; seeds="0"; cpu=""
while getopts "n:r:s:c" opt; do
  case $opt in n) iterations="iterations=$OPTARG";; r) reps=$OPTARG;; s) seeds=$OPTARG;; c) cpu=1;; *) exit 2;; esac
done
timing=$(mktemp)
shift $((OPTIND - 1))
for _ in $(seq 1 "$reps"); do
  for seed in $seeds; do
    for variant in "$@"; do
      label=${variant%%=*}; rest=${variant#*=}; bin=${rest%%:*}; extra=""
      [[ $rest == *:* ]] && extra=${rest#*:}
      # shellcheck disable=SC2086  # $iterations and $extra are word lists on purpose
      runner=(); [[ -n $cpu ]] && runner=(/usr/bin/time -f %U+%S -o "$timing")
      line=$("${runner[@]}" "$bin" seed="$seed" $iterations run_dir="runs/interleave_${label}_seed$seed" trainer.max_time=null $extra 2>/dev/null \
        | grep '^lit_parl summary')
      [[ -n $cpu ]] && line=${line/summary: \{/summary: \{\"cpu_s\": $(python3 -c "print(round($(tail -1 "$timing"), 2))"), }
      echo "$label seed=$seed $line"
    done
  done
done
