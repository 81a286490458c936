"""The fit script the GPU sections run (``tests/helpers/distributed_fit.py``), and how a run is held to one device's.

``run_fit`` runs it on the GPUs and reads back the policy and every rank's samples; ``against_one_device`` says how
far a multi-rank run's policy is from the one-device run's (relative difference per tensor) and whether the
ranks together trained the one-device run's samples, each once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "distributed_fit.py"


def run_fit(out: Path, strategy: str, devices: int, *flags: str, timeout: int = 120) -> dict:
    """One run of the fit script on ``devices`` GPUs: its policy and samples, or ``{"error": ...}``."""
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", str(devices), "--accelerator", "gpu"]
    try:
        result = subprocess.run(
            [*command, "--out", str(out), *flags], cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout} s"}
    if result.returncode != 0:
        return {"error": result.stderr[-3000:]}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {
        "policy": torch.load(out / "policy.pt"),
        "samples": sorted(tuple(s) for r in ranks for s in r["samples"]),
        "shares": [len(r["samples"]) for r in ranks],
    }


def against_one_device(single: dict, result: dict, bound: float = 1e-4) -> dict:
    """The comparison's figures and whether it holds (``ok``): the GPU's float32 kernels are not bitwise across
    layouts, so the policies agree within ``bound``, relative per tensor."""
    worst = max(
        float((result["policy"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
        for k, v in single["policy"].items()
    )
    once = result["samples"] == single["samples"] and len(set(result["samples"])) == len(result["samples"])
    return {
        "ok": worst <= bound and once,
        "max_rel_diff_from_one_device": worst,
        "shares": result["shares"],
        "every_sample_once_as_one_device": once,
    }
