#!/usr/bin/env bash
# The default job on one process against DDP on two (trainer=ddp: 2 ranks, each with its own hf pool of one
# worker), the same global batch (32 prompts x 8 per iteration), interleaved run by run, then the table side by
# side: completions/s of each run, the medians and their ratio, and whether the rewards agree seed by seed.
# Usage: benchmarks/pipeline/ddp_vs_single.sh [iterations] [seeds]     (default: 200 iterations, seeds "0 1 2")
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=${1:-200}; seeds=${2:-"0 1 2"}
log=$(mktemp)
benchmarks/pipeline/interleave.sh -c -n "$iterations" -s "$seeds" single=.venv/bin/lit-parl ddp=.venv/bin/lit-parl:trainer=ddp | tee "$log"
.venv/bin/python benchmarks/pipeline/interleave_table.py "$log"
