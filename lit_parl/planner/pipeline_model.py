"""The iteration of periodic asynchrony as a schedule: a prediction of its time for any shape and split.

``simulate`` plays one iteration from ``PhaseCosts``: the weight sync; the pool's chunks, round-robin over its
workers (as ``HFRolloutPool`` assigns them); each micro-batch's step once the chunks that fill it are in (after
the ``lag`` of receiving it when the trainer waited, or the ``gap`` between steps when it did not); the optimizer
step at the end; then Lightning's epoch end. Cores are shared: while more threads are busy than the machine
has cores, each runs at cores / busy threads of its speed (the profile measured every phase with its cores to
itself); each worker's first chunk adds ``fill_extra_s``. Once the pool is done, a step on lent cores
(``CoreShare``) takes ``lent_step_s``.

Example (sync 3 ms, the first chunk at 13 ms, four steps of 20 ms with a 2 ms optimizer step, the epoch end)::

    >>> from lit_parl.planner.phase_costs import PhaseCosts
    >>> costs = PhaseCosts(chunk_s=0.010, step_s=0.020, lent_step_s=None, last_extra_s=0.002, sync_s=0.003,
    ...     lag_s=0.001, gap_s=0.0005, between_s=0.0004, prompts=32, group_size=8, micro_batch_size=64,
    ...     prompts_per_request=8, workers=1, trainer_threads=1)
    >>> round(simulate(costs, Plan(), cores=2).iteration_s * 1e3, 1)
    97.9
    >>> round(simulate(costs, Plan(prompts=64, workers=2), cores=3).iteration_s * 1e3, 1)
    179.9
"""

from __future__ import annotations

import dataclasses

from lit_parl.planner.phase_costs import PhaseCosts


@dataclasses.dataclass(frozen=True)
class Plan:
    """A shape and split to predict; ``None`` fields keep the profiled run's.

    Args:
        prompts: prompts per iteration.
        prompts_per_request: prompts per chunk (``pool.prompts_per_request``).
        micro_batch_size: completions per training step.
        workers: the pool's worker processes (one thread each, as profiled).
        trainer_threads: the trainer's threads beside the pool.
        lend: the pool's cores train the iteration's tail once it is idle (``CoreShare``); ``True`` needs a
            profile that lent (``lent_step_s``). ``None``: as the profile ran.
    """

    prompts: int | None = None
    prompts_per_request: int | None = None
    micro_batch_size: int | None = None
    workers: int | None = None
    trainer_threads: int | None = None
    lend: bool | None = None


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One iteration as ``simulate`` plays it: its time, its completions per second and each side's busy time."""

    iteration_s: float
    completions_per_s: float
    gen_busy_s: float
    train_busy_s: float


def simulate(costs: PhaseCosts, plan: Plan, cores: int) -> Prediction:
    """Play one iteration of ``plan`` from ``costs`` on ``cores`` cores."""
    N = plan.prompts or costs.prompts
    M = plan.micro_batch_size or costs.micro_batch_size
    W = plan.workers or costs.workers
    T = plan.trainer_threads or costs.trainer_threads
    G, p = costs.group_size, plan.prompts_per_request or costs.prompts_per_request
    turns = costs.mode == "sync"  # generation, then training, each on every core
    lend = costs.lent_step_s is not None if plan.lend is None else plan.lend
    if (N * G) % M:
        raise ValueError(f"micro_batch_size={M} must divide prompts x group_size = {N * G}")
    if lend and costs.lent_step_s is None:
        raise ValueError("lend=True needs a profile that lent the pool's cores (datamodule.lend_cores=true)")
    if turns and (W != costs.workers or T != costs.trainer_threads or lend):
        raise ValueError("a sync profile predicts its own split: vary prompts, chunks and micro-batches only")
    chunk_sizes = [min(p, N - start) * G for start in range(0, N, p)]
    queues = [[c for c in range(len(chunk_sizes)) if c % W == w] for w in range(W)]
    per_sample = (costs.chunk_s - costs.chunk_fixed_s) / (costs.prompts_per_request * G)
    # a step's work: its fixed part, and the rest grows with its completions (lent steps in proportion)
    step_scale = (costs.step_fixed_s + (costs.step_s - costs.step_fixed_s) * M / costs.micro_batch_size) / costs.step_s
    if T == costs.trainer_threads:
        beside = costs.step_s
    elif costs.lent_step_s is not None and T == costs.trainer_threads + costs.workers:
        beside = costs.lent_step_s  # the profile's lent steps ran on this many threads
    else:
        raise ValueError(
            f"trainer_threads={T}: the profile measured steps on {costs.trainer_threads} thread(s)"
            + ("" if costs.lent_step_s is None else f" and on {costs.trainer_threads + costs.workers} (lent)")
        )
    steps = N * G // M

    now, arrived, gen_busy, train_busy = 0.0, 0, 0.0, 0.0
    workers = [None] * W  # remaining work of each worker's current chunk, or None
    trainer = ["sync", costs.sync_s]  # activity, remaining work
    next_step, generating, lent = 0, False, False
    while trainer is not None:
        if not generating and trainer[0] != "sync":
            generating = True  # the requests go out once the weights are synced
        if generating:
            for w in range(W):
                if workers[w] is None and queues[w]:
                    first = queues[w][0] < W  # a worker's first chunk of the iteration: after the dispatch, cold
                    workers[w] = costs.chunk_fixed_s + per_sample * chunk_sizes[queues[w][0]]
                    workers[w] += costs.fill_extra_s if first else 0.0
        if trainer[0] == "wait" and arrived >= (N * G if turns else (next_step + 1) * M):
            trainer = ["lag", costs.lag_s]
        busy_workers = [w for w in range(W) if workers[w] is not None]
        # a lent step runs alone, on every core (more threads than cores are no faster than that)
        trainer_threads = (min(T + W, cores) if lent else T) if trainer[0] == "step" else int(trainer[0] != "wait")
        busy = len(busy_workers) + trainer_threads
        rate = min(1.0, cores / busy) if busy else 1.0
        # the next event: a chunk ends or the trainer's activity ends
        ends = [workers[w] / rate for w in busy_workers] + ([trainer[1] / rate] if trainer[0] != "wait" else [])
        if not ends:
            raise RuntimeError(f"the schedule stalled: step {next_step} waits for samples no worker will generate")
        horizon = min(ends)
        now += horizon
        gen_busy += horizon if busy_workers else 0.0
        train_busy += horizon if trainer[0] == "step" else 0.0
        for w in busy_workers:
            workers[w] -= horizon * rate
            if workers[w] <= 1e-12:
                arrived += chunk_sizes[queues[w].pop(0)]
                workers[w] = None
        if trainer[0] == "wait":
            continue
        trainer[1] -= horizon * rate
        if trainer[1] > 1e-12:
            continue
        done = trainer[0]
        if done in ("lag", "gap"):
            lent = lend and not any(queues) and all(w is None for w in workers)
            work = (costs.lent_step_s if lent else beside) * step_scale
            trainer = ["step", work + (costs.last_extra_s if next_step == steps - 1 else 0.0)]
        elif done == "step":
            next_step += 1
            lent = False
            if next_step == steps:
                trainer = ["between", costs.between_s]
            elif arrived >= (next_step + 1) * M:
                trainer = ["gap", costs.gap_s]
            else:
                trainer = ["wait", 0.0]
        elif done == "between":
            trainer = None
        else:  # the sync
            trainer = ["wait", 0.0]
    return Prediction(now, N * G / now, gen_busy, train_busy)
