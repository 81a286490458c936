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
import socket
import sys
from pathlib import Path

import torch
from gpu_fits import against_one_device, run_fit
from gpu_records import log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(out: Path, strategy: str, devices: int, method: str) -> dict:
    flags = ("--sglang-gpus", "2", "--sglang-port", str(free_port()), "--sglang-sync", method)
    return run_fit(out, strategy, devices, *flags, "--sglang-master-port", str(free_port()), timeout=150)


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
        figures = against_one_device(single, ddp)
        ok = figures.pop("ok")
        failed |= not ok
        log(records, {"check": f"shared_sglang_pool_{method}", "status": "ok" if ok else "FAILED", **figures})
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
