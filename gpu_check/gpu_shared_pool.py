"""One SGLang pool for a 2-rank trainer on the GPUs of one machine: DDP on GPUs 0-1, one SGLang server on GPU 2.

Rank 0 launches the server and pushes each iteration's weights once (``distributed``: NCCL, rank 0 and the server
only), the other rank joins it, and both send their own share of the requests
(``tests/helpers/distributed_fit.py --sglang-gpus 2``, as ``make test-slow`` runs it with stand-in servers on the
CPU). The 2-rank policy must match a one-device run against the same kind of server (relative difference per
tensor, bound 1e-4), and the ranks' samples must together be the one-device run's, each once. It needs three
GPUs and ``import sglang``; otherwise it logs ``skipped`` and why.

Usage: python gpu_check/gpu_shared_pool.py --out DIR     (called by gpu_check/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path

import torch
from gpu_records import log

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "helpers" / "distributed_fit.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: Path, strategy: str, devices: int, method: str) -> dict:
    command = [
        *(sys.executable, str(SCRIPT), "--strategy", strategy, "--devices", str(devices), "--accelerator", "gpu"),
        *("--out", str(out), "--sglang-gpus", "2", "--sglang-port", str(free_port()), "--sglang-sync", method),
        *("--sglang-master-port", str(free_port())),
    ]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 150 s"}
    if result.returncode != 0:
        return {"error": result.stderr[-3000:]}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    samples = sorted(tuple(s) for r in ranks for s in r["samples"])
    return {"policy": torch.load(out / "policy.pt"), "samples": samples, "shares": [len(r["samples"]) for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    records = Path(parser.parse_args().out)
    gpus = torch.cuda.device_count()
    why = None
    if gpus < 3:
        why = f"{gpus} GPU(s): a 2-rank trainer beside a server needs 3"
    elif importlib.util.find_spec("sglang") is None:
        why = "sglang is not importable here (carry its wheels: docs/gpu.md, The GPU check)"
    if why is not None:
        log(records, {"check": "shared_sglang_pool", "status": "skipped", "why": why})
        return
    failed = False
    for method in ("distributed",):  # the method for servers on GPUs of their own; disk and tensor: make test-slow
        out = records / f"shared_pool_{method}"
        single, ddp = run(out / "single", "single", 1, method), run(out / "ddp", "ddp", 2, method)
        error = single.get("error") or ddp.get("error")
        if error:
            log(records, {"check": f"shared_sglang_pool_{method}", "status": "FAILED", "error": error})
            failed = True
            continue
        worst = max(
            float((ddp["policy"][k] - v).abs().max() / v.abs().max().clamp(min=1e-12))
            for k, v in single["policy"].items()
        )
        same_samples = ddp["samples"] == single["samples"] and len(set(ddp["samples"])) == len(ddp["samples"])
        ok = worst <= 1e-4 and same_samples
        failed |= not ok
        log(
            records,
            {
                "check": f"shared_sglang_pool_{method}",
                "status": "ok" if ok else "FAILED",
                "max_rel_diff_from_one_device": worst,
                "shares": ddp["shares"],
                "every_sample_once_as_one_device": same_samples,
            },
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
