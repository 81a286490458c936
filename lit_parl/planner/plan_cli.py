"""``lit-parl-plan``: predict iteration time and throughput for other shapes and splits, and recommend one.

From a profiling run (any ``lit-parl`` run directory: its ``timeline.jsonl`` and Hydra config)::

    lit-parl-plan runs/profile --prompts 32,64,128 --workers 1,2 --lend

prints, for every combination, the predicted iteration time, completions per second and each side's busy
time, and names the fastest. Profiles of one mode at two or more chunk and micro-batch sizes separate a call's
fixed costs from its samples' (``fit_fixed_costs``), and profiles of both modes are compared::

    lit-parl-plan runs/async_c8 runs/async_c16 runs/sync_c8 runs/sync_c16 --prompts-per-request 8,16,32 \\
        --micro-batch-sizes 64,128,256

For GPUs, from stated throughputs instead of a profile (docs/planner.md)::

    lit-parl-plan --gpus 8 --gen-tokens-per-s 20000 --train-tokens-per-s 30000 --sync-s 0.5 \\
        --prompts 512 --group-size 8 --completion-tokens 1024 --prompt-tokens 256
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

from lit_parl.planner.phase_costs import PhaseCosts, measure_modes
from lit_parl.planner.pipeline_model import Plan, Prediction, simulate


def _ints(text: str | None) -> list[int | None]:
    return [None] if text is None else [int(value) for value in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lit-parl-plan", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "run_dirs",
        nargs="*",
        help="profiling runs' directories (timeline.jsonl, .hydra/config.yaml) of one model: async, sync or both",
    )
    p.add_argument("--warmup", type=int, default=5, help="iterations left out at the start of the profile")
    p.add_argument("--cores", type=int, default=None, help="the machine's cores (default: this machine's)")
    p.add_argument("--prompts", help="prompts per iteration, comma-separated (default: the profile's)")
    p.add_argument("--prompts-per-request", help="prompts per chunk, comma-separated (default: the profile's)")
    p.add_argument("--micro-batch-sizes", help="completions per step, comma-separated (default: the profile's)")
    p.add_argument("--workers", help="rollout workers (CPU) or inference GPUs, comma-separated (async only)")
    p.add_argument("--trainer-threads", help="the trainer's threads beside the pool, comma-separated (async only)")
    p.add_argument(
        "--lend",
        action="store_true",
        help="also predict the other lending state (CoreShare, async): lent, from a profile that lent, or not lent",
    )
    gpus = p.add_argument_group("GPUs, from stated throughputs instead of a profile")
    gpus.add_argument("--gpus", type=int, help="devices to split between inference and training")
    gpus.add_argument("--gen-tokens-per-s", type=float, help="tokens one inference device generates per second")
    gpus.add_argument("--train-tokens-per-s", type=float, help="tokens one training device trains per second")
    gpus.add_argument("--train-efficiency", type=float, default=0.9, help="data-parallel scaling per added device")
    gpus.add_argument("--sync-s", type=float, default=0.0, help="one weight sync, seconds")
    gpus.add_argument("--group-size", type=int, default=8)
    gpus.add_argument("--completion-tokens", type=float, default=512.0, help="mean tokens per completion")
    gpus.add_argument("--prompt-tokens", type=float, default=256.0, help="prompt tokens (trained once per group)")
    gpus.add_argument("--chunk-prompts", type=int, default=64, help="prompts per inference batch")
    args = p.parse_args(argv)
    if (not args.run_dirs) == (args.gpus is None):
        p.error("give profiling runs' directories, or --gpus with the stated throughputs")
    if args.gpus is not None and not (args.gen_tokens_per_s and args.train_tokens_per_s):
        p.error("--gpus needs --gen-tokens-per-s and --train-tokens-per-s")
    return args


def gpu_costs(args: argparse.Namespace, prompts: int, micro_batch: int, inference: int) -> PhaseCosts:
    """Costs of a GPU split from stated throughputs: ``inference`` devices generate, the rest train (data parallel)."""
    trainers = args.gpus - inference
    if inference < 1 or trainers < 1:
        raise ValueError(f"--gpus {args.gpus}: {inference} for inference leaves {trainers} to train")
    G, chunk = args.group_size, min(args.chunk_prompts, prompts)
    # a step trains its completions and, once per group, their prompt (shared-prompt packing)
    step_tokens = micro_batch * args.completion_tokens + micro_batch / G * args.prompt_tokens
    speed = args.train_tokens_per_s * (1 + (trainers - 1) * args.train_efficiency)
    return PhaseCosts(
        chunk_s=chunk * G * args.completion_tokens / args.gen_tokens_per_s,
        step_s=step_tokens / speed,
        lent_step_s=None,
        last_extra_s=0.0,
        sync_s=args.sync_s,
        lag_s=0.0,
        gap_s=0.0,
        between_s=0.0,
        prompts=prompts,
        group_size=G,
        micro_batch_size=micro_batch,
        prompts_per_request=chunk,
        workers=inference,
        trainer_threads=1,
    )


def rows(args: argparse.Namespace) -> list[tuple[dict, Prediction]]:
    """Every combination asked for, with its prediction."""
    found = []
    if args.gpus is not None:
        prompts = [n or 256 for n in _ints(args.prompts)]
        micro = [m or args.group_size * 8 for m in _ints(args.micro_batch_sizes)]
        splits = _ints(args.workers) if args.workers else list(range(1, args.gpus))
        for n, m, d in itertools.product(prompts, micro, splits):
            costs = gpu_costs(args, n, m, d)
            # every device is its own: no sharing (cores = every busy thread)
            found.append(
                (
                    {"prompts": n, "micro_batch": m, "inference": d, "train": args.gpus - d},
                    simulate(costs, Plan(), cores=d + 1),
                )
            )
        return found
    cores = args.cores or os.cpu_count() or 1
    for costs in measure_modes(args.run_dirs, args.warmup, cores):
        split = costs.mode == "async"  # a sync profile predicts its own split
        lent = costs.lent_step_s is not None  # a profile that lent plays back lending, as it ran
        for n, c, m, w, t, lend in itertools.product(
            _ints(args.prompts),
            _ints(args.prompts_per_request),
            _ints(args.micro_batch_sizes),
            _ints(args.workers) if split else [None],
            _ints(args.trainer_threads) if split else [None],
            ([lent, not lent] if args.lend else [lent]) if split else [False],
        ):
            plan = Plan(prompts=n, prompts_per_request=c, micro_batch_size=m, workers=w, trainer_threads=t, lend=lend)
            shown = {
                "mode": costs.mode,
                "prompts": n or costs.prompts,
                "chunk": c or costs.prompts_per_request,
                "micro_batch": m or costs.micro_batch_size,
                "workers": w or costs.workers,
                "trainer_threads": t or costs.trainer_threads,
                "lend": lend,
            }
            found.append((shown, simulate(costs, plan, cores)))
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        found = rows(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"lit-parl-plan: {error}", file=sys.stderr)
        return 2
    keys = list(found[0][0])
    print(" | ".join([*keys, "iteration ms", "completions/s", "generating ms", "training ms"]))
    for shown, prediction in found:
        print(
            " | ".join(
                [str(shown[k]) for k in keys]
                + [
                    f"{prediction.iteration_s * 1e3:.1f}",
                    f"{prediction.completions_per_s:.4g}",
                    f"{prediction.gen_busy_s * 1e3:.1f}",
                    f"{prediction.train_busy_s * 1e3:.1f}",
                ]
            )
        )
    best, prediction = max(found, key=lambda row: row[1].completions_per_s)
    chosen = ", ".join(f"{k}={v}" for k, v in best.items())
    print(f"recommended: {chosen} ({prediction.completions_per_s:.4g} completions/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
