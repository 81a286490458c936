#!/usr/bin/env bash
# The one script for a machine with one or more GPUs and no internet (docs/gpu.md, "The GPU check"): under 10
# minutes below 3 GPUs (the sections' limits add up to 500 s, each plus 15 s to kill; with 3 GPUs or more the
# shared-pool section adds up to 240 s), every result in one file,
# $OUT/gpu_check.json (exit 1 if a check failed or none ran).
# Sections, each under its own time limit, each logging records as it goes (gpu_check/gpu_records.py):
#   gpu_check.py         shared-prompt exactness (flex, flash in bfloat16) and speed, a short bf16-mixed fit
#   gpu_strategies.py    DDP, FSDP2, FSDP1, DeepSpeed ZeRO-2/3 against one device
#   gpu_check_vllm.py    the vLLM pool on the GPU: start, sync, generate, the versions (if vllm is importable)
#   gpu_check_sglang.py  an SGLang server: launch, a sync by each method one GPU allows, generate (if sglang is)
#   gpu_shared_pool.py   one SGLang pool for a 2-rank DDP trainer (3 GPUs and sglang, else skipped)
# Wheels for what the machine lacks go in .whl/ (installed with --no-deps into /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_check_out}"
mkdir -p "$OUT"
rm -f "$OUT/gpu_check.jsonl" "$OUT/gpu_check.json"   # a run cut short must not leave an older run's results
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
if ! "$PY" -c "import lit_parl.kernels" 2>/dev/null; then
  # not installed: lit_parl maps callbacks/ kernels/ conf/ into the package; mirror that without installing
  mkdir -p .gpu_src && rm -rf .gpu_src/lit_parl && cp -r lit_parl .gpu_src/ && cp -r callbacks kernels conf .gpu_src/lit_parl/
  export PYTHONPATH="$PWD/.gpu_src:${PYTHONPATH:-}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/nvidia_smi.txt" 2>&1

section() {  # section NAME SECONDS SCRIPT: a section cut off by its limit leaves a FAILED record saying so
  local name="$1" limit="$2" script="$3"
  local failed_before; failed_before=$(cat "$OUT/gpu_check.jsonl" 2>/dev/null | grep -c '"status": "FAILED"')
  # shellcheck disable=SC2086 - $script is the script and its arguments
  # -k: a process that outlives SIGTERM (a fit only acts on it between batches) is killed 15 s later
  timeout -k 15 "$limit" "$PY" gpu_check/$script --out "$OUT" > "$OUT/$name.log" 2>&1
  local rc=$?
  local failed_after; failed_after=$(cat "$OUT/gpu_check.jsonl" 2>/dev/null | grep -c '"status": "FAILED"')
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "{\"check\": \"$name\", \"status\": \"FAILED\", \"why\": \"timed out after $limit s\"}" >> "$OUT/gpu_check.jsonl"
  elif [ "$rc" != 0 ] && [ "$failed_after" = "$failed_before" ]; then  # a crash that logged no failure itself
    echo "{\"check\": \"$name\", \"status\": \"FAILED\", \"why\": \"exit code $rc, see $name.log\"}" >> "$OUT/gpu_check.jsonl"
  fi
  tail -n 3 "$OUT/$name.log"
  "$PY" gpu_check/gpu_records.py "$OUT" > /dev/null   # gpu_check.json after every section: a cut-off run keeps what it had
}
# GPU_CHECK_CPU_SMOKE=1: the test suite's run on a CPU machine (no speed section, 2 iterations per fit)
FAST_ARGS=""
[ "${GPU_CHECK_CPU_SMOKE:-0}" = 1 ] && FAST_ARGS="--skip-speed --iterations 2"
section kernels_and_fit 170 "gpu_check.py $FAST_ARGS"
section strategies 130 gpu_strategies.py
section vllm 100 gpu_check_vllm.py
section sglang 100 gpu_check_sglang.py
section shared_pool 240 gpu_shared_pool.py
"$PY" gpu_check/gpu_records.py "$OUT"
