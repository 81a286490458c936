"""The other half of cores that follow the work: the worker takes the trainer's core while the trainer waits.

While the pool generates an iteration's first chunk (the fill), the trainer has no micro-batch to train on.
This measures whether the worker should decode that chunk on two threads, the trainer's and its own: the
default job (``lit-parl``, one worker, 32 prompts x 8, chunks of 8 prompts) interleaved round by round,

- ``one``: the worker decodes every chunk on its one thread (lit_parl as it is);
- ``fill``: ``FillThreadsPool``, whose worker decodes the first chunk after each weight sync on
  ``--fill-threads`` threads and the rest on one.

Each run prints ``overlap_bound.py``'s medians (fill, generate, wall, wall / bound) and the trainer's CPU
time on its main thread from the push to the iteration's first training step (``TrainerCpuAfterPush``):
Lightning's epoch end and start and the iteration's start, which run during the fill, on the core a
two-thread worker would take.

    .venv/bin/python benchmarks/pipeline/fill_threads.py --rounds 3 --iterations 120
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lit_parl.rollout.hf_pool import HFEngine, HFRolloutPool

HERE = Path(__file__).resolve().parent


class FillThreadsEngine(HFEngine):
    """``HFEngine`` that samples its first request after each weight load on ``fill_threads`` threads."""

    def __init__(self, model_dir: str, eos_id: int, pad_id: int, threads: int, fill_threads: int) -> None:
        super().__init__(model_dir, eos_id, pad_id, threads)
        self.threads, self.fill_threads, self.first = threads, fill_threads, False

    def load(self, shared, version):
        super().load(shared, version)
        self.first = True  # the next piece is the iteration's first: the trainer waits for it

    def sample(self, requests, sampling, version):
        threads = self.fill_threads if self.first else self.threads
        self.first = False
        torch.set_num_threads(threads)
        try:
            yield from super().sample(requests, sampling, version)
        finally:
            torch.set_num_threads(self.threads)


class FillThreadsPool(HFRolloutPool):
    """``HFRolloutPool`` whose workers decode each iteration's first chunk on ``fill_threads`` threads."""

    def __init__(self, fill_threads: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fill_threads = fill_threads

    def _engine(self, spec, threads):
        return functools.partial(
            FillThreadsEngine, str(spec.model_dir), spec.eos_id, spec.pad_id, threads, self.fill_threads
        )


class TrainerCpuAfterPush(Callback):
    """Appends to ``path`` the main thread's CPU ms from the end of the epoch's end hooks that run before this
    callback (``WeightSync``'s push among them) to the next epoch's first training step."""

    def __init__(self, path: str) -> None:
        self.path, self.mark = path, None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.mark = time.thread_time()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0 and self.mark is not None:
            with open(self.path, "a") as out:
                out.write(f"{1e3 * (time.thread_time() - self.mark):.3f}\n")
            self.mark = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=40, help="iterations left out of the medians")
    parser.add_argument("--fill-threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # the CLI's process and its spawned workers import this module by name
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(HERE))
    from overlap_bound import run, show, summary

    cpu_file = Path(f"/tmp/lit_parl_fill_cpu_{os.getpid()}.txt")
    variants = {
        "one": [],
        "fill": ["pool._target_=fill_threads.FillThreadsPool", f"+pool.fill_threads={args.fill_threads}"],
    }
    try:
        for round_ in range(1, args.rounds + 1):
            for name, overrides in variants.items():
                cpu_file.unlink(missing_ok=True)
                callback = [
                    "+callbacks.fill_cpu._target_=fill_threads.TrainerCpuAfterPush",
                    f"+callbacks.fill_cpu.path={cpu_file}",
                ]
                rows = run(32, args.iterations, args.seed, overrides + callback)
                show(f"{name} (round {round_})", summary(rows, args.warmup))
                cpu = [float(line) for line in cpu_file.read_text().split()][args.warmup :]
                print(f"  trainer CPU from the push to the first step: median {statistics.median(cpu):.2f} ms")
    finally:
        cpu_file.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
