"""Periodic asynchrony against synchronous training on the same split of the cores, each side pinned (issue 41, item 2).

The paper's comparison: inference and training each on devices of their own, and asynchronous execution against
synchronous execution on that same separated deployment. Here the pool's worker is pinned to one core
(``pool.cores=[0]``) and the trainer's process to another (``taskset -c 1``), and on that split:

- ``async``: periodic asynchrony, the pool generating while the trainer trains (the default chunking: chunks of 8
  prompts, micro-batches of 64);
- ``sync-split``: synchronous, the phases taking turns on the same split (each phase on its own core, the other
  idle), at async's chunking;
- ``sync-split-1chunk``: the same at sync's best chunking here (the iteration's prompts in one chunk, its samples
  in one micro-batch: one optimizer step either way);
- ``async-unpinned``: async as the default runs it (one thread each side, the OS placing them), for reference;
- ``sync-best``: the co-located baseline at its best (both cores for each phase, one chunk, one micro-batch);
- ``async-cP`` (``--async-chunks P``): async pinned, with chunks of P prompts and micro-batches of their samples.

Per run: completions/s (``summary.json``), and from the timeline (``overlap_bound.per_iteration``) the medians of
the iteration's wall, its critical-path bound, wall / bound, and the phases. The first mode is then compared with
each other one, seed by seed, beside its "ideal" (sync + gen + train) / bound: what an async mode would gain over
taking turns with the same phases, at its bound. Seeds interleaved (every mode of seed 0, then
seed 1, ...). Needs two cores or more.

    .venv/bin/python benchmarks/pipeline/pinned_split.py --prompts 32 --iterations 150 --seeds 0 1 2
    .venv/bin/python benchmarks/pipeline/pinned_split.py --prompts 128 --iterations 60 --seeds 0 1 2 \
        --modes async sync-split sync-split-1chunk async-unpinned
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overlap_bound import per_iteration, summary  # noqa: E402

from lit_parl.callbacks import load_timeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
POOL_CORE, TRAINER_CORE = 0, 1


def chunking(prompts_per_chunk: int) -> list[str]:
    """Chunks of ``prompts_per_chunk`` prompts and micro-batches of their samples (G = 8)."""
    return [f"pool.prompts_per_request={prompts_per_chunk}", f"shape.micro_batch_size={prompts_per_chunk * 8}"]


def modes(prompts: int, async_chunks: list[int]) -> dict[str, tuple[list[str], list[str]]]:
    """mode -> (the launcher's prefix, the overrides)."""
    pinned = ["taskset", "-c", str(TRAINER_CORE)]
    one_chunk = chunking(prompts)
    chunked = {f"async-c{c}": (pinned, [f"pool.cores=[{POOL_CORE}]", *chunking(c)]) for c in async_chunks}
    return chunked | {
        "async": (pinned, [f"pool.cores=[{POOL_CORE}]"]),
        "sync-split": (pinned, [f"pool.cores=[{POOL_CORE}]", "datamodule.mode=sync"]),
        "sync-split-1chunk": (pinned, [f"pool.cores=[{POOL_CORE}]", "datamodule.mode=sync", *one_chunk]),
        "async-unpinned": ([], []),
        "sync-best": ([], ["datamodule.mode=sync", *one_chunk]),
    }


def one_run(prefix: list[str], overrides: list[str], prompts: int, iterations: int, seed: int, warmup: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="pinned_split_") as run_dir:
        command = [
            *prefix,
            str(ROOT / ".venv" / "bin" / "lit-parl"),
            f"seed={seed}",
            f"iterations={iterations}",
            f"shape.prompts={prompts}",
            f"run_dir={run_dir}",
            "checkpoint_every=0",
            "trainer.max_time=null",
            "callbacks.progress.refresh_rate=0",
            *overrides,
        ]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
        run = Path(run_dir)
        done = json.loads((run / "summary.json").read_text())
        timeline = load_timeline(run / "timeline.jsonl")
    rows = [r for r in per_iteration(timeline) if r["iteration"] >= warmup]
    phases = summary(rows, warmup)
    ideal = statistics.median((r["sync_ms"] + r["gen_busy_ms"] + r["train_busy_ms"]) / r["bound_ms"] for r in rows)
    return {
        "completions_per_s": done["completions_per_s"],
        "reward_last10": done.get("reward_last10"),
        "wall_ms": phases["wall_ms"],
        "bound_ms": phases["bound_ms"],
        "wall_over_bound": phases["wall_over_bound"],
        "gen_busy_ms": phases["gen_busy_ms"],
        "train_busy_ms": phases["train_busy_ms"],
        "sync_ms": phases["sync_ms"],
        "ideal_over_turns": ideal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=None)
    parser.add_argument(
        "--async-chunks",
        type=int,
        nargs="*",
        default=[],
        help="more async modes (pinned): async-cP, chunks of P prompts",
    )
    args = parser.parse_args()
    table = modes(args.prompts, args.async_chunks)
    chosen = args.modes or list(table)
    runs: dict[str, list[dict]] = {mode: [] for mode in chosen}
    for seed in args.seeds:
        for mode in chosen:
            prefix, overrides = table[mode]
            runs[mode].append(one_run(prefix, overrides, args.prompts, args.iterations, seed, args.warmup))
            print(f"{mode} seed={seed}: {json.dumps(runs[mode][-1])}", flush=True)
    print(f"\n{args.prompts} prompts x 8, {args.iterations} iterations, seeds {args.seeds}; medians over iterations\n")
    print("| mode | completions/s (seeds) | wall ms | bound ms | wall / bound | gen ms | train ms | sync ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in chosen:
        rs = runs[mode]
        rate = " ".join(f"{r['completions_per_s']:.0f}" for r in rs)
        cells = [statistics.median(r[key] for r in rs) for key in ("wall_ms", "bound_ms", "wall_over_bound")]
        phases = [statistics.median(r[key] for r in rs) for key in ("gen_busy_ms", "train_busy_ms", "sync_ms")]
        print(
            f"| {mode} | {rate} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.3f} | "
            + " | ".join(f"{p:.1f}" for p in phases)
            + " |"
        )
    first, others = chosen[0], chosen[1:]  # the first mode against each of the others, seed by seed
    print("\n| seed | " + " | ".join(f"{first} / {m}" for m in others) + f" | ideal {first} / turns |")
    print("|---|" + "---|" * len(chosen))
    for i, seed in enumerate(args.seeds):
        a = runs[first][i]
        ratios = [a["completions_per_s"] / runs[m][i]["completions_per_s"] for m in others]
        print(f"| {seed} | " + " | ".join(f"{r:.2f}x" for r in ratios) + f" | {a['ideal_over_turns']:.2f}x |")


if __name__ == "__main__":
    main()
