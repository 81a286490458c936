"""The strategies on the GPUs of one machine: DDP (NCCL), FSDP2, FSDP1 (Lightning's ``fsdp``) and DeepSpeed ZeRO-2 and
ZeRO-3 against a one-device run on the same global batch.

Each run is ``tests/helpers/distributed_fit.py`` (2 iterations, SGD, β > 0, 2 mini-batches; an in-process pool on the
trainer's machine), as ``make test`` runs it on the CPU. With two or more GPUs the strategies run on two of them
and their final policy is compared with the one-device run (relative difference per tensor, bound 1e-4: the
GPU's float32 kernels are not bitwise across layouts); every rank's samples must together be the one-device
run's, each once. With one GPU they run at world size 1 and this says that sharding was not exercised.

Each outcome is a record of the check's results file (``gpu_records``).

Usage: python gpu_check/gpu_strategies.py --out DIR     (called by gpu_check/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from gpu_records import log

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "distributed_fit.py"


def run(out: Path, strategy: str, devices: int) -> dict:
    command = [
        sys.executable,
        str(SCRIPT),
        "--strategy",
        strategy,
        "--devices",
        str(devices),
        "--accelerator",
        "gpu",
        "--out",
        str(out),
    ]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 120 s"}
    if result.returncode != 0:
        return {"error": result.stderr[-3000:]}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    return {
        "policy": torch.load(out / "policy.pt"),
        "samples": sorted(tuple(s) for r in ranks for s in r["samples"]),
        "shares": [len(r["samples"]) for r in ranks],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = Path(args.out)
    out = records / "strategies"
    gpus = torch.cuda.device_count()
    if gpus == 0:
        log(records, {"check": "strategies", "status": "skipped", "why": "no CUDA device"})
        return
    world = 2 if gpus >= 2 else 1
    note = None if world == 2 else "one GPU: world size 1, so sharding and the rank split were NOT exercised"
    single = run(out / "single", "single", 1)
    if "error" in single:
        log(records, {"check": "strategy_single", "status": "FAILED", "error": single["error"]})
        sys.exit(1)
    failed = False
    for strategy in ("ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3"):
        result = run(out / strategy, strategy, world)
        if "error" in result:
            log(
                records,
                {"check": f"strategy_{strategy}", "status": "FAILED", "world_size": world, "error": result["error"]},
            )
            failed = True
            continue
        worst = max(
            float((result["policy"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
            for k, v in single["policy"].items()
        )
        same_samples = result["samples"] == single["samples"] and len(set(result["samples"])) == len(result["samples"])
        ok = worst <= 1e-4 and same_samples
        failed |= not ok
        log(
            records,
            {
                "check": f"strategy_{strategy}",
                "status": "ok" if ok else "FAILED",
                "world_size": world,
                "note": note,
                "max_rel_diff_from_one_device": worst,
                "shares": result["shares"],
                "every_sample_once_as_one_device": same_samples,
            },
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
