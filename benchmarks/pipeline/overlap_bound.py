"""How close an iteration comes to its critical path: wall / bound per iteration, and the time between iterations.

An iteration of periodic asynchrony cannot be shorter than

    bound = sync + max(fill + train_busy, gen_busy + last_step)

where ``sync`` is its weight sync, ``fill`` the pool's first chunk (the trainer has nothing to train on
before it), ``train_busy`` the trainer's steps, ``gen_busy`` the pool's generation and ``last_step`` the
training step that only the last chunk can feed. ``wall`` runs from the sync's start to the last step's
end; ``between`` from that end to the next iteration's sync. Since ``WeightSync`` pushes at the first
epoch-end hook, Lightning's epoch end and start (logging, metrics, callbacks) now fall inside the next
iteration's wall, where they overlap its fill. Where the trainer's side of the wall goes beyond the bound:
``lag``, from the first chunk's end to the first step's start (the epoch end and start, the first
micro-batch's receive, scoring and collation), and ``gaps``, the time between the iteration's steps (the
next micro-batch's receive, scoring and collation on the trainer's thread, or waiting for the pool, and
Lightning's per-step work). The fill is the request's dispatch and the first chunk's decode: the first chunk
is printed beside the median of the iteration's other chunks (the worker decodes it after a pause, and a
pause slows the next decode: ``benchmarks/costs/cold_chunk.py``). All come from the run's ``timeline.jsonl``
(``PipelineTimeline``).

It runs the default job (``lit-parl``, 32 prompts x 8) and the same with 128 prompts, one process each,
and prints, per run, the medians over the iterations after ``--warmup``: wall, bound, wall / bound,
between, and the parts of the bound. ``--timeline`` reads an existing ``timeline.jsonl`` instead.

    .venv/bin/python benchmarks/pipeline/overlap_bound.py --iterations 150 --seeds 0 1 2
    .venv/bin/python benchmarks/pipeline/overlap_bound.py --timeline runs/<run>/timeline.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lit_parl.callbacks import load_timeline

ROOT = Path(__file__).resolve().parents[2]


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def per_iteration(timeline: list[dict]) -> list[dict]:
    """Each iteration's wall, bound, its parts and the time to the next iteration's start (ms)."""
    rows = []
    for i, it in enumerate(timeline):
        if not it["train"] or not it["generate"]:
            continue
        begin = it["sync"][0][0] if it["sync"] else it["generate"][0][0]
        last_train_end = it["train"][-1][1]
        generate = sorted(it["generate"])
        fill = generate[0][1] - begin - _length(it["sync"])  # from the request (after the sync) to the first chunk
        first_chunk = generate[0][1] - generate[0][0]  # the fill is the request's dispatch and this chunk's decode
        others = [end - start for start, end in generate[1:]]
        sync, train_busy, gen_busy = _length(it["sync"]), _length(it["train"]), it["gen_busy_s"]
        last_step = it["train"][-1][1] - it["train"][-1][0]
        lag = it["train"][0][0] - generate[0][1]
        gaps = sum(later[0] - earlier[1] for earlier, later in zip(it["train"], it["train"][1:]))
        bound = sync + max(fill + train_busy, gen_busy + last_step)
        following = timeline[i + 1] if i + 1 < len(timeline) else None
        next_begin = None
        if following is not None:
            next_begin = (
                following["sync"][0][0]
                if following["sync"]
                else (following["generate"][0][0] if following["generate"] else None)
            )
        rows.append(
            {
                "iteration": it["iteration"],
                "wall_ms": 1e3 * (last_train_end - begin),
                "bound_ms": 1e3 * bound,
                "sync_ms": 1e3 * sync,
                "fill_ms": 1e3 * fill,
                "first_chunk_ms": 1e3 * first_chunk,
                "other_chunks_ms": 1e3 * statistics.median(others) if others else None,
                "train_busy_ms": 1e3 * train_busy,
                "gen_busy_ms": 1e3 * gen_busy,
                "last_step_ms": 1e3 * last_step,
                "lag_ms": 1e3 * lag,
                "gaps_ms": 1e3 * gaps,
                "between_ms": None if next_begin is None else 1e3 * (next_begin - last_train_end),
            }
        )
    return rows


def summary(rows: list[dict], warmup: int) -> dict:
    kept = [r for r in rows if r["iteration"] >= warmup] or rows

    def median(key: str) -> float | None:  # None: no iteration has the value (one chunk: no other chunk)
        values = [r[key] for r in kept if r[key] is not None]
        return statistics.median(values) if values else None

    out = {
        key: median(key)
        for key in (
            "wall_ms",
            "bound_ms",
            "between_ms",
            "sync_ms",
            "fill_ms",
            "first_chunk_ms",
            "other_chunks_ms",
            "train_busy_ms",
            "gen_busy_ms",
            "last_step_ms",
            "lag_ms",
            "gaps_ms",
        )
    }
    out["wall_over_bound"] = statistics.median(r["wall_ms"] / r["bound_ms"] for r in kept)
    out["iterations"] = len(kept)
    return out


def run(prompts: int, iterations: int, seed: int, extra: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="overlap_bound_") as run_dir:
        command = [
            str(Path(sys.executable).parent / "lit-parl"),
            f"seed={seed}",
            f"iterations={iterations}",
            f"shape.prompts={prompts}",
            f"run_dir={run_dir}",
            "checkpoint_every=0",
            "trainer.max_time=null",
            "~callbacks.samples",
            *extra,
        ]
        subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
        return per_iteration(load_timeline(Path(run_dir) / "timeline.jsonl"))


def show(label: str, s: dict) -> None:
    others = "-" if s["other_chunks_ms"] is None else f"{s['other_chunks_ms']:.1f}"  # "-": one chunk an iteration
    print(
        f"{label}: wall {s['wall_ms']:.1f} ms, bound {s['bound_ms']:.1f} ms, wall/bound {s['wall_over_bound']:.3f}, "
        f"between {s['between_ms']:.1f} ms | sync {s['sync_ms']:.1f}, fill {s['fill_ms']:.1f}, "
        f"train {s['train_busy_ms']:.1f}, generate {s['gen_busy_ms']:.1f}, last step {s['last_step_ms']:.1f} | "
        f"trainer lag {s['lag_ms']:.1f}, gaps {s['gaps_ms']:.1f} | first chunk {s['first_chunk_ms']:.1f}, "
        f"each other chunk {others} "
        f"(medians of {s['iterations']} iterations)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeline", type=Path, help="read this timeline.jsonl instead of running")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=50, help="iterations left out of the medians")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("overrides", nargs="*", help="more lit-parl overrides")
    args = parser.parse_args()
    if args.timeline:
        show(str(args.timeline), summary(per_iteration(load_timeline(args.timeline)), args.warmup))
        return
    for prompts in args.prompts:
        for seed in args.seeds:
            show(
                f"{prompts} prompts x 8, seed {seed}",
                summary(run(prompts, args.iterations, seed, args.overrides), args.warmup),
            )


if __name__ == "__main__":
    main()
