"""gpu_check/gpu_check.sh, the one script for a GPU machine, run here on the CPU: what it can check without a GPU.

On this machine the script runs the CPU attention backends' exactness (float32 and bfloat16), a bf16-mixed fit
of the ``trainer=gpu`` preset on the CPU (with and without gradient checkpointing), and records the sections
that need a GPU, vLLM or SGLang as skipped; every result ends in one JSON file. The SGLang section's own
sequence is checked against the stand-in in tests/rollout/test_sglang_backend.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_check_runs_its_cpu_parts_and_writes_one_json(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "GPU_CHECK_CPU_SMOKE": "1"}
    done = subprocess.run(
        ["bash", str(ROOT / "gpu_check" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=900
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], report["summary"])
    checks = {r["check"]: r for r in report["records"]}
    assert {
        "float32_exactness_sdpa_Qwen2Config",
        "bfloat16_kernel_sdpa_h8kv2d64",
        "bf16_mixed_model_sdpa_LlamaConfig",
        "fit_trainer_gpu",
        "fit_trainer_gpu_checkpointed",
    } <= set(report["summary"]["ok"])
    assert checks["fit_trainer_gpu"]["precision"] == "bf16-mixed" and checks["fit_trainer_gpu"]["weight_dtypes"] == [
        "torch.float32"
    ]
    # no CUDA, no sglang in this environment
    assert {"strategies", "sglang", "shared_sglang_pool"} <= set(report["summary"]["skipped"])
    assert not report["summary"]["FAILED"]


def test_the_fit_script_the_gpu_sections_run_exists(monkeypatch):
    """gpu_strategies and gpu_shared_pool run tests/helpers/distributed_fit.py (gpu_check/gpu_fits.py names it): a
    path left behind by a move of the tests fails only on a GPU machine, where each run ends in "no such file"."""
    monkeypatch.syspath_prepend(str(ROOT / "gpu_check"))
    spec = importlib.util.spec_from_file_location("gpu_fits", ROOT / "gpu_check" / "gpu_fits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.SCRIPT.is_file(), module.SCRIPT
