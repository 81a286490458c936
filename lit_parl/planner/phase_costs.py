"""PhaseCosts: what one profiling run's ``timeline.jsonl`` says each phase of an iteration costs.

A run of ``lit-parl`` writes, per iteration, when the pool generated each piece (a chunk of
``pool.prompts_per_request`` prompts on one worker), when the trainer trained each micro-batch and when the
weights synced (``PipelineTimeline``). ``measure_costs`` takes the median of each, over the iterations after a
warm-up, together with the run's shape from its Hydra config (``.hydra/config.yaml``):

- ``chunk_s``: one chunk's generation, on a worker that has its cores to itself;
- ``step_s``: one micro-batch's training step beside the pool; ``lent_step_s`` the same on the pool's cores too
  (``CoreShare``; ``None`` when the run lent none); ``last_extra_s``: what the iteration's last step adds (the
  optimizer step, under the lending state of the last step);
- ``sync_s``: the weight sync; ``lag_s``: from the chunk that completes a micro-batch to that step's start when
  the trainer was waiting (receive, score, collate); ``gap_s``: between two steps when the next micro-batch was
  already there; ``between_s``: from the last step to the next iteration's sync (Lightning's epoch end).

Example::

    >>> costs = PhaseCosts(chunk_s=0.01, step_s=0.02, lent_step_s=None, last_extra_s=0.002, sync_s=0.003,
    ...     lag_s=0.001, gap_s=0.0005, between_s=0.0004, prompts=32, group_size=8, micro_batch_size=64,
    ...     prompts_per_request=8, workers=1, trainer_threads=1)
    >>> costs.step_s / costs.chunk_s  # training is the longer side of this run
    2.0
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import yaml


@dataclasses.dataclass(frozen=True)
class PhaseCosts:
    """Seconds per unit of each phase, measured at the profiled run's shape (the fields after ``between_s``).

    Args:
        chunk_s: one chunk's generation (``prompts_per_request`` prompts x ``group_size`` samples).
        step_s: one micro-batch's training step while the pool generates beside it.
        lent_step_s: the same with the pool's cores lent to the trainer; ``None``: not measured.
        last_extra_s: what the iteration's last step takes beyond an ordinary one (the optimizer step).
        sync_s: one weight sync.
        lag_s: from a micro-batch's last chunk to its step, when the trainer waited for it.
        gap_s: between two steps, when the second's micro-batch was ready.
        between_s: from the iteration's last step to the next iteration's sync.
        prompts, group_size, micro_batch_size, prompts_per_request, workers, trainer_threads: the profiled shape.
    """

    chunk_s: float
    step_s: float
    lent_step_s: float | None
    last_extra_s: float
    sync_s: float
    lag_s: float
    gap_s: float
    between_s: float
    prompts: int
    group_size: int
    micro_batch_size: int
    prompts_per_request: int
    workers: int
    trainer_threads: int


def _median(values: list[float], what: str, default: float | None = None) -> float:
    if not values:
        if default is not None:
            return default
        raise ValueError(f"the timeline has no {what} after the warm-up: profile more iterations")
    return statistics.median(values)


def _config(run_dir: Path) -> dict:
    path = run_dir / ".hydra" / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: profile with the lit-parl command, which writes the run's config")
    return yaml.safe_load(path.read_text())


def measure_costs(run_dir: str | Path, warmup: int = 5, cores: int | None = None) -> PhaseCosts:
    """The medians of a run's phases over its iterations after the first ``warmup``, profiled on ``cores``
    cores (default: this machine's; they give the trainer's threads when the run left them to the default).

    Raises:
        FileNotFoundError: the run directory has no ``timeline.jsonl`` or no Hydra config.
        ValueError: too few iterations after the warm-up, or a run the planner does not model (sync mode,
            several mini-batches or passes, dynamic sampling's extra rounds).
    """
    run_dir = Path(run_dir)
    timeline_path = run_dir / "timeline.jsonl"
    if not timeline_path.exists():
        raise FileNotFoundError(f"{timeline_path} is missing: profile with the PipelineTimeline callback (the default)")
    config = _config(run_dir)
    shape, pool, data = config["shape"], config["pool"], config["datamodule"]
    if data.get("mode", "async") != "async" or shape.get("mini_batches", 1) != 1 or shape.get("passes", 1) != 1:
        raise ValueError("the planner models async runs with one mini-batch and one pass: profile one of those")
    G, M, p = shape["group_size"], shape["micro_batch_size"], pool.get("prompts_per_request", 8)
    workers, threads = pool.get("num_workers", 1), pool.get("threads_per_worker", 1)
    lines = [json.loads(line) for line in timeline_path.read_text().splitlines() if line.strip()]
    iterations = [it for it in lines[warmup:] if it["train"] and it["generate"] and it["sync"]]
    if len(iterations) < 3:
        raise ValueError(f"{timeline_path}: {len(iterations)} iterations after the warm-up of {warmup}; need 3 or more")
    chunks, steps, lent_steps, lasts, lent_lasts, syncs, lags, gaps, betweens = ([] for _ in range(9))
    for index, it in enumerate(iterations):
        generate, train = sorted(it["generate"]), it["train"]
        chunks += [end - start for start, end in generate]
        syncs.append(sum(end - start for start, end in it["sync"]))
        lent_from = it.get("lent_from")
        for j, (start, end) in enumerate(train[:-1]):
            (lent_steps if lent_from is not None and j >= lent_from else steps).append(end - start)
        last = train[-1][1] - train[-1][0]
        (lent_lasts if lent_from is not None else lasts).append(last)
        # when each micro-batch's samples were in: the end of the chunk that completes its count
        ends = sorted(end for _, end in generate)
        ready = [ends[min(len(ends), -(-((j + 1) * M) // (p * G))) - 1] for j in range(len(train))]
        for j, (start, _) in enumerate(train):
            previous_end = train[j - 1][1] if j else None
            if previous_end is None or ready[j] > previous_end:
                lags.append(start - ready[j])  # the trainer waited for this micro-batch
            else:
                gaps.append(start - previous_end)
        if index + 1 < len(iterations) and iterations[index + 1]["iteration"] == it["iteration"] + 1:
            betweens.append(iterations[index + 1]["sync"][0][0] - train[-1][1])
    step = _median(steps or lent_steps, "training step")  # every step lent (one micro-batch): the lent ones
    lent_step = statistics.median(lent_steps) if lent_steps else None
    last_extra = (
        _median(lent_lasts, "last step") - (lent_step or step) if lent_lasts else _median(lasts, "last step") - step
    )
    return PhaseCosts(
        chunk_s=_median(chunks, "generated chunk"),
        step_s=step,
        lent_step_s=lent_step,
        last_extra_s=max(0.0, last_extra),
        sync_s=_median(syncs, "weight sync"),
        lag_s=_median(lags, "wait for a micro-batch", default=0.0),
        gap_s=_median(gaps, "gap between steps", default=0.0),
        between_s=_median(betweens, "time between iterations", default=0.0),
        prompts=shape["prompts"],
        group_size=G,
        micro_batch_size=M,
        prompts_per_request=p,
        workers=workers,
        # as the datamodule sets them when unset: the cores the pool's workers leave
        trainer_threads=data.get("trainer_threads") or max(1, (cores or os.cpu_count() or 1) - workers * threads),
    )
