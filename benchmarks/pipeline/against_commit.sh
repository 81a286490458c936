#!/usr/bin/env bash
# The default job at an earlier commit against the working tree, interleaved: wall / bound, the time between
# iterations and the gaps between steps (benchmarks/pipeline/overlap_bound.py), then completions/s
# (benchmarks/pipeline/interleave.sh). The commit is checked out in a git worktree with a venv of its own
# (torch pinned first, as `make` does), both under DIR, which is removed at the end.
# Usage: benchmarks/pipeline/against_commit.sh REV [rounds] [iterations for the throughput runs] [seeds]
# e.g.   benchmarks/pipeline/against_commit.sh 976f034 3 300 "0 1 2"
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=$1; rounds=${2:-3}; iterations=${3:-300}; seeds=${4:-0}
dir=$(mktemp -d /tmp/lit_parl_against_XXXX)
trap 'git worktree remove --force "$dir/src" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
git worktree add --detach "$dir/src" "$rev" >/dev/null
python3 -m venv "$dir/venv"
"$dir/venv/bin/pip" install -q torch==2.13.0
"$dir/venv/bin/pip" install -q -e "$dir/src"
echo "old: $rev ($(git rev-parse --short "$rev")); new: the working tree at $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' with changes')"
for round in $(seq 1 "$rounds"); do
  echo -n "old round $round: "
  (cd "$dir/src" && "$dir/venv/bin/python" benchmarks/pipeline/overlap_bound.py --iterations 150 --warmup 50 --prompts 32 --seeds 0 | tail -1)
  echo -n "new round $round: "
  .venv/bin/python benchmarks/pipeline/overlap_bound.py --iterations 150 --warmup 50 --prompts 32 --seeds 0 | tail -1
done
benchmarks/pipeline/interleave.sh -n "$iterations" -r "$rounds" -s "$seeds" old="$dir/venv/bin/lit-parl" new=.venv/bin/lit-parl
