"""``lit-parl-profile``: profile a job briefly in both modes, then name its fastest mode and chunking as overrides.

Runs the job (the ``lit-parl`` overrides after ``--``) for ``--iterations`` iterations four times: async and sync,
each at two chunkings (``--chunks``: prompts per chunk, micro-batches of their samples), then plays every
chunking from one chunk per prompt-divisor up to the whole iteration through ``lit-parl-plan``'s model and prints
the fastest as the overrides to add::

    lit-parl-profile --iterations 30 -- data=reverse shape.prompts=64
    ...
    fastest: sync, 64 prompts per chunk, micro-batches of 512 (2,412 completions/s predicted)
    run it with: lit-parl data=reverse shape.prompts=64 datamodule.mode=sync pool.prompts_per_request=64 \\
        shape.micro_batch_size=512

Nothing is changed behind the user's back: the job runs as configured until the printed overrides are added.
``--fit`` asks for them at once: after the profile the job is trained with the chosen overrides added (the process
becomes ``lit-parl``, as if the printed command had been typed)::

    lit-parl-profile --fit -- data=reverse shape.prompts=64

The mode alone changes nothing that is trained (sync and async train the same samples to the same weights at one
chunking); the chunking changes the order of a gradient's sums (one optimizer step an iteration either way) and,
in the ``hf`` pool, the generation batches a sample is drawn in, whose numerics can move a draw at the margin.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lit_parl.planner.phase_costs import measure_modes
from lit_parl.planner.pipeline_model import Plan, simulate

MODES = ("async", "sync")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lit-parl-profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=30, help="iterations of each profile run")
    p.add_argument("--warmup", type=int, default=5, help="iterations left out at the start of each profile")
    p.add_argument("--chunks", default="8,16", help="the two chunkings profiled: prompts per chunk, comma-separated")
    p.add_argument("--keep", type=Path, default=None, help="keep the profile runs in this directory")
    p.add_argument("--fit", action="store_true", help="then train the job with the fastest mode and chunking")
    p.add_argument("overrides", nargs="*", help="the job: lit-parl overrides (after --)")
    args = p.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    if len(set(args.chunks)) != 2 or min(args.chunks) < 1:
        p.error(f"--chunks {args.chunks}: give two different chunk sizes, e.g. 8,16")
    if args.warmup >= args.iterations - 1:
        p.error(f"--iterations {args.iterations} leaves nothing after --warmup {args.warmup}")
    return args


def profile_overrides(mode: str, chunk: int, group_size: int) -> list[str]:
    """The overrides of ``mode`` with chunks of ``chunk`` prompts and micro-batches of their samples."""
    micro_batch = f"shape.micro_batch_size={chunk * group_size}"
    return [f"datamodule.mode={mode}", f"pool.prompts_per_request={chunk}", micro_batch]


def run_profiles(args: argparse.Namespace, root: Path, group_size: int) -> list[Path]:
    """The four profile runs of the job, one after another; their run directories."""
    lit_parl = lit_parl_command()
    runs = []
    for mode in MODES:
        for chunk in args.chunks:
            run_dir = root / f"{mode}_c{chunk}"
            command = [
                str(lit_parl),
                *args.overrides,
                *profile_overrides(mode, chunk, group_size),
                f"iterations={args.iterations}",
                f"run_dir={run_dir}",
                "checkpoint_every=0",
                "trainer.max_time=null",
                "callbacks.progress.refresh_rate=0",
            ]
            print(f"profiling {mode}, chunks of {chunk} prompts ...", flush=True)
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"the profile run `{' '.join(command)}` failed:\n{result.stderr[-2000:]}")
            runs.append(run_dir)
    return runs


def lit_parl_command() -> Path:
    """The ``lit-parl`` script installed beside this interpreter."""
    return Path(sys.executable).parent / "lit-parl"


def job_shape(overrides: list[str]) -> tuple[int, int]:
    """The job's (prompts per iteration, group size), as its composed config says."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="lit_parl.conf", version_base=None):
        config = compose(config_name="config", overrides=overrides)
    return int(config.shape.prompts), int(config.shape.group_size)


def fastest(run_dirs: list[Path], warmup: int, prompts: int) -> list[tuple[str, int, float]]:
    """(mode, prompts per chunk, predicted completions/s) of every chunking that divides ``prompts``, fastest first."""
    candidates = [c for c in range(1, prompts + 1) if prompts % c == 0]
    cores = os.cpu_count() or 1
    found = []
    for costs in measure_modes(run_dirs, warmup, cores):
        for chunk in candidates:
            plan = Plan(prompts_per_request=chunk, micro_batch_size=chunk * costs.group_size)
            found.append((costs.mode, chunk, simulate(costs, plan, cores).completions_per_s))
    return sorted(found, key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prompts, group_size = job_shape(args.overrides)
        if any(prompts % c or c == prompts for c in args.chunks):  # a profile needs two micro-batches or more
            raise ValueError(
                f"--chunks {args.chunks}: each must divide the job's {prompts} prompts per iteration and be smaller"
            )
        root = args.keep or Path(tempfile.mkdtemp(prefix="lit_parl_profile_"))
        try:
            ranked = fastest(run_profiles(args, root, group_size), args.warmup, prompts)
        finally:
            if args.keep is None:
                shutil.rmtree(root, ignore_errors=True)
    except (RuntimeError, ValueError, FileNotFoundError) as error:
        print(f"lit-parl-profile: {error}", file=sys.stderr)
        return 2
    print("mode | prompts per chunk | micro-batch | predicted completions/s")
    for mode, chunk, rate in ranked:
        print(f"{mode} | {chunk} | {chunk * group_size} | {rate:,.0f}")
    mode, chunk, rate = ranked[0]
    batch = chunk * group_size
    print(f"fastest: {mode}, {chunk} prompts per chunk, micro-batches of {batch} ({rate:,.0f} completions/s predicted)")
    chosen = [*args.overrides, *profile_overrides(mode, chunk, group_size)]
    if not args.fit:
        print("run it with: lit-parl " + " ".join(chosen))
        return 0
    print("training it: lit-parl " + " ".join(chosen), flush=True)
    command = lit_parl_command()
    os.execv(command, [str(command), *chosen])  # the job's own process from here: its signals, its exit code


if __name__ == "__main__":
    sys.exit(main())
