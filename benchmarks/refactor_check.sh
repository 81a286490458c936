#!/usr/bin/env bash
# The default job before and after a change, interleaved: same seeds, one run at a time, each side's
# summary line printed with its label. The "before" side is an installed copy of another commit.
# Usage: benchmarks/refactor_check.sh BEFORE_BIN AFTER_BIN seeds...   (BIN: a lit-parl executable)
# Overrides differ between releases, so each side runs its own default job: only seed and run_dir are set.
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1; after=$2; shift 2
for seed in "$@"; do
  for side in before after; do
    bin=${!side}
    line=$("$bin" seed="$seed" run_dir="runs/check_${side}_seed$seed" trainer.max_time=null 2>/dev/null | grep '^lit_parl summary')
    echo "$side seed=$seed $line"
  done
done
