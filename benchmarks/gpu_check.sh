#!/usr/bin/env bash
# The one script for the lent GPU machine (must finish in under 8 minutes; results in $OUT).
# The device has no internet: carry .whl (see the device tool's README) if a package is missing there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD/.gpu_src:${PYTHONPATH:-}"
  # lit_parl's layout maps callbacks/ kernels/ conf/ into the package: mirror that without installing
  mkdir -p .gpu_src && rm -rf .gpu_src/lit_parl && cp -r lit_parl .gpu_src/ && cp -r callbacks kernels conf .gpu_src/lit_parl/
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
timeout 420 "$PY" benchmarks/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
# DDP (NCCL), FSDP2, FSDP1 and DeepSpeed ZeRO-2/3 on two GPUs (or at world size 1 on one, saying so) against a
# one-device run; DeepSpeed needs its wheel (pip wheel deepspeed==0.19.8 into .whl: a pure-Python build)
timeout 420 "$PY" benchmarks/gpu_strategies.py --out "$OUT" 2>&1 | tee "$OUT/gpu_strategies.log"
# SGLang: only where it is importable (a user's GPU box; the lent device has no sglang). Logs `skipped` otherwise.
timeout 600 "$PY" benchmarks/gpu_check_sglang.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check_sglang.log"
