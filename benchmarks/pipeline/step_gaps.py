"""What fills the gaps between two training steps of the default job, measured inside a run.

A gap (``benchmarks/pipeline/overlap_bound.py``) runs from one step's end to the next one's start. This
splits each gap that follows a step of the same iteration into: ``after the step`` (Lightning's and the
callbacks' per-step hooks, up to the request for the next micro-batch), ``data`` (the next micro-batch:
receiving, scoring, accepting and collating its groups, and any wait for the pool), and ``to the step``
(the batch's transfer hooks up to ``training_step``). It also prints the mean time of each data part per
call and of each callback's ``on_train_batch_end`` (whose iteration-ending calls weigh in the mean; they
fall outside the gaps). It wraps the functions with timers in the trainer's process; nothing is changed.

Usage: ``.venv/bin/python benchmarks/pipeline/step_gaps.py [--iterations 150] [hydra overrides ...]``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time

from lightning.pytorch import Callback

import lit_parl.data.group_acceptor as group_acceptor
import lit_parl.data.group_scorer as group_scorer
import lit_parl.data.iteration_batcher as iteration_batcher
import lit_parl.data.iteration_streams as iteration_streams
import lit_parl.trainer.grpo_module as grpo_module
import lit_parl.trainer.grpo_objective as grpo_objective

events: list[tuple[str, float, float]] = []  # ("first data" | "data" | "step", start, end), in order
spent: collections.Counter = collections.Counter()  # name -> seconds
calls: collections.Counter = collections.Counter()  # name -> calls


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.monotonic() - start
            calls[name] += 1

    return wrapper


def instrument() -> None:
    stream_iter = iteration_streams.IterationStream.__iter__

    def timed_iter(self):
        batches = stream_iter(self)
        first = True  # the iteration's first micro-batch: its wait for the fill is no gap between steps
        while True:
            start = time.monotonic()
            try:
                batch = next(batches)
            except StopIteration:
                return
            events.append(("first data" if first else "data", start, time.monotonic()))
            first = False
            yield batch

    iteration_streams.IterationStream.__iter__ = timed_iter
    step = grpo_module.GRPOModule.training_step

    def timed_step(self, batch, batch_idx):
        start = time.monotonic()
        out = step(self, batch, batch_idx)
        events.append(("step", start, time.monotonic()))
        return out

    grpo_module.GRPOModule.training_step = timed_step
    group_scorer.GroupScorer.score = timed("score (a group)", group_scorer.GroupScorer.score)
    group_acceptor.GroupAcceptor.accept = timed("accept (a group)", group_acceptor.GroupAcceptor.accept)
    grpo_objective.GRPOObjective.advantages = timed("  of which advantages", grpo_objective.GRPOObjective.advantages)
    iteration_batcher.collate = timed("collate (a micro-batch)", iteration_batcher.collate)


class TimeCallbackHooks(Callback):
    """Wraps every other callback's ``on_train_batch_end`` with a timer at fit start."""

    def on_fit_start(self, trainer, pl_module) -> None:
        for callback in trainer.callbacks:
            if callback is not self:
                name = f"on_train_batch_end: {type(callback).__name__}"
                callback.on_train_batch_end = timed(name, callback.on_train_batch_end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for the run")
    args = parser.parse_args()
    instrument()
    from lit_parl import cli

    build = cli.build

    def build_with_timer(cfg):  # the timing callback joins the run's callbacks
        module, datamodule, trainer = build(cfg)
        trainer.callbacks.append(TimeCallbackHooks())
        return module, datamodule, trainer

    cli.build = build_with_timer
    with tempfile.TemporaryDirectory(prefix="step_gaps_") as run_dir:
        sys.argv = ["lit-parl", f"iterations={args.iterations}", "trainer.max_time=null", "checkpoint_every=0"]
        sys.argv += [f"run_dir={run_dir}", *args.overrides]
        try:
            cli.main()
        except SystemExit:
            pass
    after, data, to_step = [], [], []
    for earlier, fetch, later in zip(events, events[1:], events[2:]):
        if (earlier[0], fetch[0], later[0]) == ("step", "data", "step"):
            after.append(fetch[1] - earlier[2])
            data.append(fetch[2] - fetch[1])
            to_step.append(later[1] - fetch[2])
    skip = len(after) // 3  # the first third: warm-up

    def median_ms(values: list[float]) -> float:
        return 1e3 * statistics.median(values[skip:])

    print(
        f"gaps between steps of one iteration ({len(after) - skip} after warm-up), medians: after the step "
        f"{median_ms(after):.2f} ms, data {median_ms(data):.2f} ms, to the step {median_ms(to_step):.2f} ms"
    )
    for name in sorted(spent, key=lambda n: -spent[n] / calls[n]):
        print(f"  {1e3 * spent[name] / calls[name]:7.3f} ms per call  x {calls[name]:6d}  {name}")


if __name__ == "__main__":
    main()
