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
import sys
from pathlib import Path

import torch
from gpu_fits import against_one_device, run_fit
from gpu_records import log


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
    single = run_fit(out / "single", "single", 1)
    if "error" in single:
        log(records, {"check": "strategy_single", "status": "FAILED", "error": single["error"]})
        sys.exit(1)
    failed = False
    for strategy in ("ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3"):
        result = run_fit(out / strategy, strategy, world)
        if "error" in result:
            log(
                records,
                {"check": f"strategy_{strategy}", "status": "FAILED", "world_size": world, "error": result["error"]},
            )
            failed = True
            continue
        figures = against_one_device(single, result)
        ok = figures.pop("ok")
        failed |= not ok
        status = "ok" if ok else "FAILED"
        log(records, {"check": f"strategy_{strategy}", "status": status, "world_size": world, "note": note, **figures})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
