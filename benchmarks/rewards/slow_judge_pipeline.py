"""What a slow judge does to a run: the default job (tiny Qwen2, copy task, 32 prompts x 8) with the positional
reward alone, and with a judge beside it that takes ``--latency-s`` to answer each request (the tests'
OpenAI-compatible stand-in, ``tests/helpers/judge_server.py``, in this process), in both modes. In async mode
groups are scored as they arrive, while the pool generates the rest; in sync mode the iteration's generation ends
first. The judge keeps ``--concurrency`` requests in flight over ``--groups-in-flight`` groups. Every request is
distinct (the cache is off), so every sample pays the latency.

Prints, per setting, the fit's wall time per iteration (median over ``--repeats``, runs interleaved) and its
ratio to the same mode without a judge, beside the judge-only floor: samples x latency / requests in flight.

Usage: ``.venv/bin/python benchmarks/rewards/slow_judge_pipeline.py [--iterations 20] [--latency-s 0.2]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.judge_server import JudgeServer  # noqa: E402


def wall_per_iteration(overrides: list[str], iterations: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            str(Path(sys.executable).parent / "lit-parl"),
            f"iterations={iterations}",
            f"run_dir={run_dir}",
            "checkpoint_every=0",
            "callbacks.progress.refresh_rate=0",
            "trainer.max_time=null",
            *overrides,
        ]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        return json.loads((Path(run_dir) / "summary.json").read_text())["wall_s"] / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--groups-in-flight", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    server = JudgeServer(stall_s=args.latency_s).start()
    judge = [
        "reward=[positional,judge]",
        f"reward.judge.url={server.url}",
        "reward.judge.rubric='{completion}'",
        "reward.judge.cache_size=0",
        f"reward.judge.concurrency={args.concurrency}",
        f"reward.judge.concurrent_groups={args.groups_in_flight}",
        "reward.judge.weight=0",
    ]
    settings = {
        f"{mode}, {name}": [f"datamodule.mode={mode}", *extra]
        for mode in ("async", "sync")
        for name, extra in (("positional only", []), ("with the judge", judge))
    }
    results = {label: [] for label in settings}
    try:
        for _ in range(args.repeats):
            for label, overrides in settings.items():
                results[label].append(wall_per_iteration(overrides, args.iterations))
    finally:
        server.stop()
    floor = 32 * 8 * args.latency_s / min(args.concurrency, 8 * args.groups_in_flight)
    print(
        f"{args.iterations} iterations; judge: {args.latency_s} s a request, {args.concurrency} in flight over "
        f"{args.groups_in_flight} groups: judging alone takes {floor:.2f} s an iteration; median of {args.repeats}"
    )
    print("| setting | s / iteration | runs | vs the same mode without the judge |")
    print("|---|---|---|---|")
    for label, values in results.items():
        base = statistics.median(results[label.split(",")[0] + ", positional only"])
        median = statistics.median(values)
        print(f"| {label} | {median:.2f} | {' '.join(f'{v:.2f}' for v in values)} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
