"""What the ``hf`` and ``vllm`` pools share: spawned worker processes around an engine of their backend.

Each worker runs ``lit_parl.rollout.worker_loop.serve`` around an engine (a small object with ``load``
and ``sample``, see ``WorkerEngine`` there); the loop, the messages (``worker_messages``), the checks and
the restarts are the same for every backend. The trainer's side is in three parts: this pool (the
settings; starting the workers and syncing their weights), ``worker_processes.WorkerProcesses`` (the
processes, their channels, the shared weights, the replacement of a dead or hung worker) and
``generate_call.GenerateCall`` (one ``generate`` call: its pieces of work out, their groups back, and a
lost worker's pieces again, with the same seeds).
"""

from __future__ import annotations

import os
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import ClassVar

from lit_parl.rollout.generate_call import GenerateCall
from lit_parl.rollout.pool_records import PoolSpec
from lit_parl.rollout.processes import unguarded_main_script
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import RolloutPool, WeightBucket
from lit_parl.rollout.worker_loop import WorkerEngine
from lit_parl.rollout.worker_messages import Exited, GroupDone, PieceDone
from lit_parl.rollout.worker_processes import WorkerProcesses


class SpawnedWorkerPool(RolloutPool):
    """``num_workers`` spawned processes that each run ``serve`` around one engine.

    Owns the settings and the rollout protocol's side of the processes: waiting for them to start,
    syncing weights through shared memory, and one ``GenerateCall`` per ``generate``. A subclass says how
    its engine is built (``_engine``) and how requests are split between the workers (``_assign``).

    Args:
        num_workers: worker processes.
        threads_per_worker: CPU threads of each worker while the trainer runs beside it.
        colocated_threads: CPU threads of each worker when generation and training take turns
            (``PoolSpec.colocated``); ``None``: all cores divided between the workers (with ``cores``: each
            worker's own).
        start_timeout_s: how long the workers may take to build their engines (a replacement too).
        response_timeout_s: how long a worker that owes the pool an answer (a group, the end of a piece,
            a sync confirmation) may stay silent before it is taken for hung, killed and replaced.
        max_restarts: worker replacements allowed within one ``generate`` or ``sync_weights`` call; the
            next failure stops the run with an error. 0: any failure stops it.
        cores: CPU cores the workers are pinned to (CPU affinity), split between them in order, the same number
            each; ``None``: wherever the OS runs them. Pin the trainer's process to other cores (``taskset -c``)
            so that generation and training each keep their own (docs/performance.md, "Pinned cores").
    """

    worker_label: ClassVar[str] = "worker"  # how error messages name a worker
    process_name: ClassVar[str] = "lit_parl-worker"
    daemon_workers: ClassVar[bool] = True

    def __init__(
        self,
        num_workers: int,
        threads_per_worker: int,
        colocated_threads: int | None,
        start_timeout_s: float,
        response_timeout_s: float,
        max_restarts: int = 3,
        cores: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if num_workers < 1:
            raise ValueError(f"{name}(num_workers={num_workers}): at least one worker is needed")
        if threads_per_worker < 1:
            raise ValueError(f"{name}(threads_per_worker={threads_per_worker}): a worker needs at least one thread")
        if colocated_threads is not None and colocated_threads < 1:
            raise ValueError(
                f"{name}(colocated_threads={colocated_threads}): give at least one thread, or None for all cores"
            )
        if max_restarts < 0:
            raise ValueError(f"{name}(max_restarts={max_restarts}): give 0 (no restart) or more")
        self.cores = worker_cores(cores, num_workers, name) if cores is not None else None
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.colocated_threads = colocated_threads
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self.max_restarts = max_restarts
        self._processes: WorkerProcesses | None = None
        self._last_call: GenerateCall | None = None
        self._calls = 0

    # -- what a subclass provides ----------------------------------------------------------------------
    @abstractmethod
    def _engine(self, spec: PoolSpec, threads: int) -> Callable[[], WorkerEngine]:
        """A picklable factory that builds the engine inside a worker (``functools.partial`` of a class)."""

    @abstractmethod
    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        """``(worker index, requests)`` pieces of work; each piece is one ``Generate`` message."""

    def _worker_env(self, index: int) -> dict[str, str]:
        """Environment variables set in the process of slot ``index`` (a replacement too) before its engine is built."""
        return {}

    # -- RolloutPool -----------------------------------------------------------------------------------
    def _start(self, spec: PoolSpec) -> None:
        self._processes = WorkerProcesses(
            self._engine(spec, self._worker_threads(spec.colocated)),
            [self._worker_env(index) for index in range(self.num_workers)],
            label=self.worker_label,
            process_name=self.process_name,
            daemon=self.daemon_workers,
            start_timeout_s=self.start_timeout_s,
            response_timeout_s=self.response_timeout_s,
            max_restarts=self.max_restarts,
            cores=self.cores,
        )
        try:
            self._await_ready()
        except RuntimeError as error:
            script = unguarded_main_script()
            if script is None:
                raise
            raise RuntimeError(
                f"{error}. The pool's workers are spawned processes, which import {script} again, and that script "
                'starts training at import time. Put its entry point under `if __name__ == "__main__":`.'
            ) from error

    def _await_ready(self) -> None:
        """Launch every worker; return once each has built its engine (raise if one dies or none answers)."""
        processes = self._processes
        processes.launch()
        deadline = time.monotonic() + self.start_timeout_s
        while not all(w.ready for w in processes.workers):
            event = processes.next_event("starting", owes=lambda w: False)  # a slow start is the deadline's
            if event is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no answer from the {self.worker_label}s for {self.start_timeout_s:.0f} s while starting"
                    )
                continue
            worker, message = event
            if isinstance(message, Exited):
                worker.process.join(timeout=5.0)
                raise RuntimeError(
                    f"{self.worker_label}(s) died while starting: {[(worker.process.name, worker.process.exitcode)]} "
                    "(name, exit code)"
                )
            processes.confirm(worker, message, "starting")

    def _sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        processes = self._processes
        first = processes.weights.write(buckets, version)
        processes.request_sync(version, attach=first)
        self._await_settled(f"syncing version {version}", version)

    def _await_settled(self, doing: str, version: int) -> None:
        """Return once every worker confirmed what it was sent (a worker that dies meanwhile is replaced)."""
        processes, restarts = self._processes, 0
        while not all(w.settled for w in processes.workers):
            event = processes.next_event(doing, owes=lambda w: not w.settled)
            if event is None:
                continue
            worker, message = event
            if isinstance(message, Exited):  # the shared weights hold `version` already: the new worker loads it
                restarts = processes.replace(worker, restarts, doing, version)
            elif not isinstance(message, (GroupDone, PieceDone)):  # those are an earlier generate call's
                processes.confirm(worker, message, doing)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        self._calls += 1
        self._last_call = GenerateCall(self._processes, self._calls, self.version, self._assign(requests), sampling)
        yield from self._last_call.groups()

    def _worker_counts(self) -> tuple[int, int]:
        processes = self._processes  # None while it is being built, when health() asks from another thread
        return (0, 0) if processes is None else (len(processes.pids()), processes.alive())

    def _details(self) -> dict:
        processes = self._processes
        return {"pids": self.pids(), "restarts": 0 if processes is None else processes.restarts}

    def _busy_intervals(self) -> list[tuple[float, float]]:
        return [] if self._last_call is None else list(self._last_call.busy)

    def _close(self) -> None:
        processes, self._processes = self._processes, None  # a restarted pool starts new processes
        if processes is not None:
            processes.stop()

    def reserved_cpus(self, colocated: bool) -> int:
        return 0 if colocated else self.num_workers * self.threads_per_worker

    def pids(self) -> list[int]:
        processes = self._processes
        return [] if processes is None else processes.pids()

    def _worker_threads(self, colocated: bool) -> int:
        if colocated:
            if self.colocated_threads is None and self.cores is not None:
                return len(self.cores[0])
            return self.colocated_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        return self.threads_per_worker


def worker_cores(cores: Sequence[int], num_workers: int, name: str) -> list[tuple[int, ...]]:
    """``cores`` split between ``num_workers`` workers in order, the same number each; checked against the machine's
    cores (not this process's own affinity: a trainer pinned with ``taskset`` pins its workers elsewhere).

    >>> worker_cores([0, 1], 2, "HFRolloutPool")
    [(0,), (1,)]
    """
    cores = [int(core) for core in cores]
    allowed = range(os.cpu_count() or 1)
    if not cores or len(set(cores)) != len(cores) or len(cores) % num_workers:
        raise ValueError(
            f"{name}(cores={cores}): give distinct cores, the same number for each of the {num_workers} workers"
        )
    if not set(cores) <= set(allowed):
        raise ValueError(f"{name}(cores={cores}): this machine's cores are 0 to {allowed[-1]}")
    each = len(cores) // num_workers
    return [tuple(cores[i * each : (i + 1) * each]) for i in range(num_workers)]
