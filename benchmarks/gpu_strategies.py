"""The strategies on the GPUs of one machine: DDP (NCCL), FSDP2, FSDP1 (Lightning's ``fsdp``) and DeepSpeed ZeRO-2 and
ZeRO-3 against a one-device run on the same global batch.

Each run is ``tests/distributed_fit.py`` (2 iterations, SGD, β > 0, 2 mini-batches; an in-process pool on the
trainer's machine), as ``make test`` runs it on the CPU. With two or more GPUs the strategies run on two of them
and their final policy is compared with the one-device run (relative difference per tensor, bound 1e-4: the
GPU's float32 kernels are not bitwise across layouts); every rank's samples must together be the one-device
run's, each once. With one GPU they run at world size 1 and this says that sharding was not exercised.

Usage: python benchmarks/gpu_strategies.py --out DIR     (called by benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "distributed_fit.py"


def run(out: Path, strategy: str, devices: int) -> dict:
    command = [sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", str(devices), "--accelerator", "gpu", "--out", str(out)]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 120 s"}
    if result.returncode != 0:
        return {"error": result.stderr[-3000:]}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {"policy": torch.load(out / "policy.pt"), "samples": sorted(tuple(s) for r in ranks for s in r["samples"]),
            "shares": [len(r["samples"]) for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out) / "strategies"
    gpus = torch.cuda.device_count()
    if gpus == 0:
        print("strategies: skipped (no CUDA device)")
        return
    world = 2 if gpus >= 2 else 1
    if world == 1:
        print("strategies: one GPU: every strategy runs at world size 1; sharding and the rank split were NOT exercised")
    single = run(out / "single", "single", 1)
    if "error" in single:
        print(f"strategies: the one-device run failed:\n{single['error']}")
        sys.exit(1)
    failed = False
    for strategy in ("ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3"):
        result = run(out / strategy, strategy, world)
        if "error" in result:
            print(f"strategies: {strategy} x{world} FAILED:\n{result['error']}")
            failed = True
            continue
        worst = max(float((result["policy"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12)) for k, v in single["policy"].items())
        same_samples = result["samples"] == single["samples"] and len(set(result["samples"])) == len(result["samples"])
        verdict = "OK" if worst <= 1e-4 and same_samples else "MISMATCH"
        failed |= verdict != "OK"
        print(f"strategies: {strategy} x{world}: {verdict} worst relative difference {worst:.2e} from one device; "
              f"shares {result['shares']}; every sample once, the one-device run's: {same_samples}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
