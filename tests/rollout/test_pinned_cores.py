"""The pool's workers pinned to cores of their own (``SpawnedWorkerPool(cores=...)``): every thread of every worker,
a replacement's too, runs on its share of the cores, the trainer's process keeps its own, and a pinned worker's
threads in sync mode default to its cores."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from helpers.sglang_pools import SAMPLING, buckets, requests_for
from lit_parl.models import tiny_qwen2
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.spawned_worker_pool import worker_cores


def thread_cores(pid: int) -> set[str]:
    """The ``Cpus_allowed_list`` of every thread of process ``pid``."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.add(line.split(":", 1)[1].strip())
    return out


def test_every_thread_of_a_worker_and_of_its_replacement_runs_on_the_workers_cores(spec):
    last = os.cpu_count() - 1
    trainer = os.sched_getaffinity(0)
    # two threads on one core: the OpenMP team the engine starts for its first batch is pinned too
    pool = HFRolloutPool(num_workers=1, threads_per_worker=2, cores=[last], max_restarts=1)
    pool.start(spec)
    try:
        model, _ = tiny_qwen2(seed=0)
        pool.sync_weights(buckets(model), version=0)
        assert len(list(pool.generate(requests_for(0), SAMPLING))) == 4
        (pid,) = pool.pids()
        assert len(list(Path(f"/proc/{pid}/task").iterdir())) > 2  # the engine's threads exist
        assert thread_cores(pid) == {str(last)}
        os.kill(pid, signal.SIGKILL)
        assert len(list(pool.generate(requests_for(0), SAMPLING))) == 4  # the replacement generated them
        (replacement,) = pool.pids()
        assert replacement != pid and thread_cores(replacement) == {str(last)}
        assert os.sched_getaffinity(0) == trainer  # the trainer's process is not moved
    finally:
        pool.close()


def test_the_cores_are_split_between_the_workers_in_order_and_a_bad_list_is_refused(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert worker_cores([4, 5, 6, 7], 2, "P") == [(4, 5), (6, 7)]
    assert worker_cores([3], 1, "P") == [(3,)]
    for cores, workers, problem in [
        ([0, 1, 2], 2, "the same number"),
        ([1, 1], 2, "distinct"),
        ([], 1, "distinct"),
        ([8], 1, "cores are 0 to 7"),
    ]:
        with pytest.raises(ValueError, match=problem):
            worker_cores(cores, workers, "HFRolloutPool")
    with pytest.raises(ValueError, match=r"HFRolloutPool\(cores=\[0, 1, 2\]\)"):
        HFRolloutPool(num_workers=2, cores=[0, 1, 2])


def test_a_pinned_worker_takes_its_cores_threads_when_generation_and_training_take_turns(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert HFRolloutPool(num_workers=2, cores=[4, 5, 6, 7])._worker_threads(colocated=True) == 2
    assert HFRolloutPool(num_workers=2, cores=[4, 5, 6, 7], colocated_threads=1)._worker_threads(colocated=True) == 1
    assert HFRolloutPool(num_workers=2)._worker_threads(colocated=True) == 4  # unpinned: the machine's, divided
    assert HFRolloutPool(num_workers=2, threads_per_worker=1, cores=[4, 5])._worker_threads(colocated=False) == 1
