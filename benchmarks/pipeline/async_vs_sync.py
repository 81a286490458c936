"""Periodic asynchrony against the synchronous baseline, side by side on this machine.

The same configuration (model, task, prompts per iteration, G, lengths, iterations, seed) runs in both
modes, interleaved A B A B ... so that a noisy neighbour hurts both alike:

- ``sync``: the colocated baseline. The pool generates the whole iteration, then the trainer trains on
  it; each phase gets every core (pool threads = trainer threads = all cores).
- ``async``: periodic asynchrony. The pool (one worker, one thread) and the trainer (one thread) run at
  the same time, each on one core: the same hardware. The trainer receives and collates each micro-batch
  between its steps (``datamodule.prefetch=false``, the default on CPU).
- ``async-prefetch`` (``--modes``): the same with the prefetch thread, which receives and collates
  micro-batches while the trainer trains (the default on an accelerator).
- ``sync-1t``: the synchronous baseline at its best on this machine. A model this small runs no faster
  on two threads than on one, so this variant gives each phase one thread. It is reported beside `sync`
  so that the ratio does not depend on a handicapped baseline.

Per mode it prints the median completions/s and tokens/s over the iterations after a warm-up, the
async/sync ratio, the overlap efficiency per iteration,
(gen_busy + train_busy - iteration_wall) / min(gen_busy, train_busy), 1.0 meaning the shorter phase is
completely hidden, and where the rest goes: the trainer's wait for its first micro-batch and the gaps
between its steps. Three workloads: balanced (generation time ~ training time), generation-heavy (long
completions of ragged lengths: groups finish at different times) and training-heavy; and ``episodes``:
multi-turn games of uneven length (1 to 8 turns, docs/episodes.md), where a completion is an episode.

    .venv/bin/python benchmarks/pipeline/async_vs_sync.py                 # all three, 3 runs per mode each
    .venv/bin/python benchmarks/pipeline/async_vs_sync.py --workloads balanced --reps 5 --json out.json
    .venv/bin/python benchmarks/pipeline/async_vs_sync.py --prompts 128 --modes sync sync-1t async-prefetch

An iteration loses a fixed amount of overlap at each end: the trainer waits for the first chunk (fill)
and trains the last micro-batch alone (drain). The more micro-batches an iteration has, the smaller that
share: ``--prompts`` sets the iteration's size.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lit_parl.callbacks import load_timeline

ROOT = Path(__file__).resolve().parents[2]

COMMON = [
    "checkpoint_every=0",
    "trainer.max_time=null",
    "+trainer.enable_progress_bar=false",
    "model.hidden_size=128",
    "model.intermediate_size=512",
    "shape.group_size=8",
]
# Each workload: overrides on top of COMMON. Tuned on this 2-core machine so that, in async mode, the
# balanced workload spends about as long generating as training (see RESULTS.md for the measured split).
WORKLOADS = {
    "balanced": ["data=copy", "sampling.max_new_tokens=12", "shape.micro_batch_size=64", "pool.prompts_per_request=8"],
    "generation-heavy": [
        "data=copy",
        "sampling.max_new_tokens=48",
        "shape.micro_batch_size=64",
        "pool.prompts_per_request=8",
    ],
    # multi-turn episodes of uneven length (docs/episodes.md): the number game with up to 8 guesses, each turn
    # ended at its first digit, so a game won at once ends after one turn and a lost one plays all eight (the
    # long tail; the untrained model wins about one turn in ten)
    "episodes": [
        "data=guess_number",
        "env=guess_number",
        "reward=environment",
        "sampling.max_new_tokens=3",
        "sampling.stop_token_ids=[3,4,5,6,7,8,9,10,11,12]",  # a turn ends at its first digit (a guess)
        "datamodule.episodes.max_turns=8",
        "datamodule.episodes.max_episode_tokens=32",
        "shape.micro_batch_size=64",
        "pool.prompts_per_request=8",
    ],
    "training-heavy": [
        "data=copy",
        "sampling.max_new_tokens=8",
        "shape.micro_batch_size=64",
        "pool.prompts_per_request=8",
        "shape.passes=2",
        "algorithm.objective.beta=0.04",
    ],
}


MODES = {
    "sync": ["datamodule.mode=sync", "datamodule.prefetch=false"],
    "async": ["datamodule.mode=async", "datamodule.prefetch=false"],  # the CPU default: collated between the steps
    "sync-1t": [
        "datamodule.mode=sync",
        "datamodule.prefetch=false",
        "datamodule.trainer_threads=1",
        "+pool.colocated_threads=1",
    ],
    # async with a prefetch thread receiving and collating micro-batches while the trainer trains
    "async-prefetch": ["datamodule.mode=async", "datamodule.prefetch=true"],
}
DEFAULT_MODES = ["sync", "async", "sync-1t"]


def _first_step_wait(iteration: dict) -> float:
    """From the iteration's requests to its first training step (the window ends with the last step)."""
    train = sorted(iteration["train"])
    requested = train[-1][1] - iteration["wall_s"]
    return train[0][0] - requested


def _step_gaps(iteration: dict) -> float:
    train = sorted(iteration["train"])
    return sum(later[0] - earlier[1] for earlier, later in zip(train, train[1:]))


def run_once(workload: str, mode: str, prompts: int, iterations: int, seed: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"lit_parl_bench_{workload}_{mode}_") as run_dir:
        overrides = [
            *COMMON,
            f"shape.prompts={prompts}",
            *WORKLOADS[workload],
            *MODES[mode],
            f"iterations={iterations}",
            f"seed={seed}",
            f"run_dir={run_dir}",
            *extra,
        ]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "lit_parl", *overrides], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{workload}/{mode} failed:\n{done.stderr[-3000:]}")
        rows = list(csv.DictReader(open(Path(run_dir) / "metrics.csv")))
        timeline = load_timeline(Path(run_dir) / "timeline.jsonl")
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    rows = [r for r in rows if r.get("completions_per_s")]
    warm = max(2, len(rows) // 5)  # the first iterations pay for start-up and allocator warm-up
    steady = rows[warm:]
    return {
        "workload": workload,
        "mode": mode,
        "prompts": prompts,
        "process_s": time.monotonic() - started,
        "completions_per_s": statistics.median(float(r["completions_per_s"]) for r in steady),
        "tokens_per_s": statistics.median(float(r["tokens_per_s"]) for r in steady),
        "gen_busy_s": statistics.median(it["gen_busy_s"] for it in timeline[warm:]),
        "train_busy_s": statistics.median(it["train_busy_s"] for it in timeline[warm:]),
        "iteration_s": statistics.median(it["end"] - it["start"] for it in timeline[warm:]),
        "overlap_efficiency": [it["overlap_efficiency"] for it in timeline[warm:]],
        # where the overlap goes: the trainer's wait for its first micro-batch (fill), and the gaps between its steps
        "first_step_wait_s": statistics.median(_first_step_wait(it) for it in timeline[warm:]),
        "step_gaps_s": statistics.median(_step_gaps(it) for it in timeline[warm:]),
        "reward_last10": summary.get("reward_last10"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES), help="async is always run")
    parser.add_argument("--reps", type=int, default=3, help="runs per mode and workload (interleaved)")
    parser.add_argument(
        "--prompts", type=int, default=64, help="prompts per iteration (x G=8 completions; micro-batches of 64)"
    )
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    parser.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()

    print(
        f"machine: {os.cpu_count()} cores; {args.prompts} prompts x 8 per iteration; {args.reps} runs per mode, "
        f"{args.iterations} iterations each, interleaved",
        flush=True,
    )
    modes = [mode for mode in MODES if mode in args.modes or mode == "async"]
    results = []
    for workload in args.workloads:
        for rep in range(args.reps):
            order = modes
            for mode in order[rep % len(order) :] + order[: rep % len(order)]:  # rotate: each mode runs first once
                result = run_once(workload, mode, args.prompts, args.iterations, args.seed, args.extra)
                results.append(result)
                print(
                    f"  {workload:16s} {mode:12s} run {rep}: {result['completions_per_s']:8.1f} completions/s "
                    f"gen {result['gen_busy_s'] * 1e3:6.1f} ms train {result['train_busy_s'] * 1e3:6.1f} ms "
                    f"iteration {result['iteration_s'] * 1e3:6.1f} ms",
                    flush=True,
                )

    print()
    header = (
        f"{'workload':16s} {'mode':12s} {'completions/s':>13s} {'tokens/s':>9s} {'gen ms':>7s} {'train ms':>8s} "
        f"{'iter ms':>8s} {'overlap eff. (median, p10)':>27s}"
    )
    print(header)
    print("-" * len(header))
    summary = {}
    for workload in args.workloads:
        per_mode = {}
        for mode in modes:
            runs = [r for r in results if r["workload"] == workload and r["mode"] == mode]
            efficiency = [e for r in runs for e in r["overlap_efficiency"]]
            per_mode[mode] = {
                "completions_per_s": statistics.median(r["completions_per_s"] for r in runs),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                "gen_ms": 1e3 * statistics.median(r["gen_busy_s"] for r in runs),
                "train_ms": 1e3 * statistics.median(r["train_busy_s"] for r in runs),
                "iteration_ms": 1e3 * statistics.median(r["iteration_s"] for r in runs),
                "overlap_median": statistics.median(efficiency),
                "first_step_wait_ms": 1e3 * statistics.median(r["first_step_wait_s"] for r in runs),
                "step_gaps_ms": 1e3 * statistics.median(r["step_gaps_s"] for r in runs),
                "overlap_p10": statistics.quantiles(efficiency, n=10)[0] if len(efficiency) > 1 else efficiency[0],
            }
            m = per_mode[mode]
            overlap = (
                f"{m['overlap_median']:.2f}, {m['overlap_p10']:.2f}" if mode.startswith("async") else "(takes turns)"
            )
            print(
                f"{workload:16s} {mode:12s} {m['completions_per_s']:13.1f} {m['tokens_per_s']:9.1f} {m['gen_ms']:7.1f} "
                f"{m['train_ms']:8.1f} {m['iteration_ms']:8.1f} {overlap:>27s}"
            )
        for mode in [mode for mode in per_mode if mode.startswith("async")]:
            m = per_mode[mode]
            print(
                f"{workload:16s} {mode:12s} overlap lost to: the wait for the first micro-batch "
                f"{m['first_step_wait_ms']:.1f} ms, "
                f"gaps between training steps {m['step_gaps_ms']:.1f} ms per iteration"
            )
        ratios = {}
        for baseline in [mode for mode in per_mode if mode != "async"]:
            ratio = per_mode["async"]["completions_per_s"] / per_mode[baseline]["completions_per_s"]
            token_ratio = per_mode["async"]["tokens_per_s"] / per_mode[baseline]["tokens_per_s"]
            ratios[baseline] = {"completions": ratio, "tokens": token_ratio}
            print(f"{workload:16s} async/{baseline}: {ratio:.2f}x completions/s, {token_ratio:.2f}x tokens/s")
        summary[workload] = {**per_mode, "ratios": ratios}
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
