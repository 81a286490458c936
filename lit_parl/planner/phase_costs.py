"""PhaseCosts: what one profiling run's ``timeline.jsonl`` says each phase of an iteration costs.

A run of ``lit-parl`` writes, per iteration, when the pool generated each piece (a chunk of
``pool.prompts_per_request`` prompts on one worker), when the trainer trained each micro-batch and when the
weights synced (``PipelineTimeline``). ``measure_costs`` takes the median of each, over the iterations after a
warm-up, together with the run's shape from its Hydra config (``.hydra/config.yaml``):

- ``chunk_s``: one chunk's generation, on a worker that has its cores to itself; ``fill_extra_s``: what a worker's
  first chunk of an iteration adds, with its request's dispatch after the sync (the worker resumes after a pause,
  which slows its next decode);
- ``step_s``: one micro-batch's training step beside the pool; ``lent_step_s`` the same on the pool's cores too
  (``CoreShare``; ``None`` when the run lent none); ``last_extra_s``: what the iteration's last step adds (the
  optimizer step, under the lending state of the last step);
- ``sync_s``: the weight sync; ``lag_s``: from the chunk that completes a micro-batch to that step's start when
  the trainer was waiting (receive, score, collate); ``gap_s``: between two steps when the next micro-batch was
  already there; ``between_s``: from the last step to the next iteration's sync (Lightning's epoch end).

One profile cannot tell a call's own costs from its samples' (on a small model a chunk's and a step's fixed
costs can outweigh their arithmetic): ``fit_fixed_costs`` separates them from profiles of one mode at several
chunk or micro-batch sizes (a straight line through each size's cost). A ``sync`` run (``datamodule.mode``) is
profiled the same way; its phases take turns, each on every core.

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
        mode: the profiled run's ``datamodule.mode``: ``async`` (the pool beside the trainer) or ``sync`` (they
            take turns, each on every core).
        chunk_fixed_s: the part of ``chunk_s`` that does not grow with the chunk's samples (a call's own costs);
            0 from one profile, fitted from several (``fit_fixed_costs``).
        step_fixed_s: the same for ``step_s`` (and ``lent_step_s`` in proportion).
        fill_extra_s: from the sync's end to a worker's first chunk's end, beyond ``chunk_s`` (the dispatch, and
            the first decode after a pause).
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
    mode: str = "async"
    chunk_fixed_s: float = 0.0
    step_fixed_s: float = 0.0
    fill_extra_s: float = 0.0


def _median(values: list[float], what: str, default: float | None = None) -> float:
    if not values:
        if default is not None:
            return default
        raise ValueError(f"the timeline has no {what} after the warm-up: profile more iterations")
    return statistics.median(values)


def _config(run_dir: str | Path) -> dict:
    """A profiling run's Hydra config (``.hydra/config.yaml`` in its directory)."""
    path = Path(run_dir) / ".hydra" / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: profile with the lit-parl command, which writes the run's config")
    return yaml.safe_load(path.read_text())


def measure_costs(run_dir: str | Path, warmup: int = 5, cores: int | None = None) -> PhaseCosts:
    """The medians of a run's phases over its iterations after the first ``warmup``, profiled on ``cores``
    cores (default: this machine's; they give the trainer's threads when the run left them to the default).

    Raises:
        FileNotFoundError: the run directory has no ``timeline.jsonl`` or no Hydra config.
        ValueError: too few iterations after the warm-up, or a run the planner does not model (several
            mini-batches or passes, dynamic sampling's extra rounds).
    """
    run_dir = Path(run_dir)
    timeline_path = run_dir / "timeline.jsonl"
    if not timeline_path.exists():
        raise FileNotFoundError(f"{timeline_path} is missing: profile with the PipelineTimeline callback (the default)")
    config = _config(run_dir)
    shape, pool, data = config["shape"], config["pool"], config["datamodule"]
    mode = data.get("mode", "async")
    if mode not in ("async", "sync") or shape.get("mini_batches", 1) != 1 or shape.get("passes", 1) != 1:
        raise ValueError("the planner models runs with one mini-batch and one pass: profile one of those")
    G, M, p = shape["group_size"], shape["micro_batch_size"], pool.get("prompts_per_request", 8)
    workers, threads = pool.get("num_workers", 1), pool.get("threads_per_worker", 1)
    lines = [json.loads(line) for line in timeline_path.read_text().splitlines() if line.strip()]
    iterations = [it for it in lines[warmup:] if it["train"] and it["generate"] and it["sync"]]
    if len(iterations) < 3:
        raise ValueError(f"{timeline_path}: {len(iterations)} iterations after the warm-up of {warmup}; need 3 or more")
    chunks, firsts, steps, lent_steps, lasts, lent_lasts, syncs, lags, gaps, betweens = ([] for _ in range(10))
    for index, it in enumerate(iterations):
        generate, train = sorted(it["generate"]), it["train"]
        chunks += [end - start for start, end in generate[1:]]  # the median: another worker's first is an outlier
        firsts.append((generate[0], it["sync"][-1][1]))
        syncs.append(sum(end - start for start, end in it["sync"]))
        lent_from = it.get("lent_from")
        for j, (start, end) in enumerate(train[:-1]):
            (lent_steps if lent_from is not None and j >= lent_from else steps).append(end - start)
        last = train[-1][1] - train[-1][0]
        (lent_lasts if lent_from is not None else lasts).append(last)
        # when each micro-batch's samples were in: the end of the chunk that completes its count
        ends = sorted(end for _, end in generate)
        ready = [ends[min(len(ends), -(-((j + 1) * M) // (p * G))) - 1] for j in range(len(train))]
        if mode == "sync":  # every step waits for the whole iteration
            ready = [ends[-1]] * len(train)
        for j, (start, _) in enumerate(train):
            previous_end = train[j - 1][1] if j else None
            if previous_end is None or ready[j] > previous_end:
                lags.append(start - ready[j])  # the trainer waited for this micro-batch
            else:
                gaps.append(start - previous_end)
        if index + 1 < len(iterations) and iterations[index + 1]["iteration"] == it["iteration"] + 1:
            betweens.append(iterations[index + 1]["sync"][0][0] - train[-1][1])
    if all(len(it["train"]) == 1 for it in iterations):
        raise ValueError(
            f"{timeline_path}: one micro-batch per iteration, so its step cannot be told from the optimizer step: "
            "profile with two or more (a smaller shape.micro_batch_size)"
        )
    step = _median(steps or lent_steps, "training step")  # every step lent (one micro-batch): the lent ones
    lent_step = statistics.median(lent_steps) if lent_steps else None
    last_extra = (
        _median(lent_lasts, "last step") - (lent_step or step) if lent_lasts else _median(lasts, "last step") - step
    )
    # from one chunk an iteration, only first chunks: chunk_s is theirs, and the fill adds the dispatch
    chunk = _median(chunks or [end - start for (start, end), _ in firsts], "generated chunk")
    fill_extra = statistics.median(end - synced - chunk for (_, end), synced in firsts)
    return PhaseCosts(
        chunk_s=chunk,
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
        # as the datamodule sets them when unset: the cores the pool's workers leave (sync: every core)
        trainer_threads=data.get("trainer_threads")
        or max(1, (cores or os.cpu_count() or 1) - (0 if mode == "sync" else workers * threads)),
        mode=mode,
        fill_extra_s=max(0.0, fill_extra),
    )


def fit_fixed_costs(profiles: list[PhaseCosts]) -> PhaseCosts:
    """One mode's profiles as one: the first's costs, with the parts of a chunk and of a step that do not grow
    with their samples fitted from the profiles' sizes (least squares; 0 where every profile has one size).

    Example (chunks of 8 x 8 samples in 10 ms and of 32 x 8 in 25 ms: 5 ms a call and 5 ms per 64 samples;
    steps of 64 samples in 20 ms and of 256 in 50: 10 ms a step and 10 per 64 samples)::

        >>> a = PhaseCosts(0.010, 0.020, None, 0.0, 0.0, 0.0, 0.0, 0.0, 32, 8, 64, 8, 1, 1)
        >>> b = PhaseCosts(0.025, 0.050, None, 0.0, 0.0, 0.0, 0.0, 0.0, 32, 8, 256, 32, 1, 1)
        >>> fitted = fit_fixed_costs([a, b])
        >>> round(fitted.chunk_fixed_s * 1e3, 3), round(fitted.step_fixed_s * 1e3, 3)
        (5.0, 10.0)
    """
    first = profiles[0]
    for other in profiles[1:]:
        for field in ("mode", "group_size", "workers", "trainer_threads"):
            if getattr(other, field) != getattr(first, field):
                raise ValueError(
                    f"profiles of one mode must differ only in prompts, chunk and micro-batch sizes: one has "
                    f"{field}={getattr(first, field)}, another {getattr(other, field)}"
                )
    G = first.group_size
    chunks = [(c.prompts_per_request * G, c.chunk_s) for c in profiles]
    steps = [(c.micro_batch_size, c.step_s) for c in profiles]
    return dataclasses.replace(
        first,
        chunk_fixed_s=_fixed_part(chunks, first.prompts_per_request * G, first.chunk_s),
        step_fixed_s=_fixed_part(steps, first.micro_batch_size, first.step_s),
    )


def _fixed_part(points: list[tuple[int, float]], size: int, cost: float) -> float:
    """What of ``cost`` (at ``size``) the line through ``points`` (size, cost) does not grow with size."""
    if len({s for s, _ in points}) < 2:
        return 0.0
    slope, _ = statistics.linear_regression([float(s) for s, _ in points], [c for _, c in points])
    return min(max(cost - slope * size, 0.0), cost)


def measure_modes(run_dirs: list[str | Path], warmup: int = 5, cores: int | None = None) -> list[PhaseCosts]:
    """Each mode's costs from its profiles (``fit_fixed_costs`` where they have several sizes); one model's only."""
    by_mode: dict[str, list[PhaseCosts]] = {}
    for run_dir in run_dirs:
        costs = measure_costs(run_dir, warmup, cores)
        by_mode.setdefault(costs.mode, []).append(costs)
    models = {json.dumps(_config(d).get("model"), sort_keys=True) for d in run_dirs}
    if len(models) > 1:
        raise ValueError(f"the profiles are of {len(models)} different models: give one model's profiles at a time")
    return [fit_fixed_costs(profiles) for profiles in by_mode.values()]
