#!/usr/bin/env bash
# Creates .venv-trl: a separate environment with Hugging Face TRL, for benchmarks/vs_trl/vs_trl.py.
#   benchmarks/vs_trl/setup_trl_env.sh            # TRL 1.16.0 (the version the comparison was written for)
#   TRL=trl==X.Y.Z benchmarks/vs_trl/setup_trl_env.sh
# torch is installed FIRST and pinned (the local CPU wheel): an unpinned torch would pull a multi-GB CUDA
# build as a dependency of trl/accelerate. Then trl (which brings transformers, accelerate, datasets), then
# this project in editable mode so the TRL side reuses lit_parl's task, reward, tokenizer and model builder.
# Nothing is downloaded at run time: no hub model, no vLLM.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-trl}
TORCH=${TORCH:-torch==2.13.0}
TRL=${TRL:-trl==1.16.0}
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "$TORCH"
# keep torch where it is: a dependency asking for another torch must fail here, not replace it
"$VENV/bin/python" -m pip install -q "$TRL" "$TORCH"
"$VENV/bin/python" -m pip install -q -e ".[math]" "$TORCH"   # the math task's reward (math-verify)
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
for name in ("torch", "trl", "transformers", "accelerate", "datasets", "lit-parl"):
    print(f"{name}=={md.version(name)}")
import trl, lit_parl  # noqa: F401  (both import in one interpreter)
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
EOF
"$VENV/bin/python" -m pip check
echo "setup_trl_env: done in $(( $(date +%s) - start )) s"
