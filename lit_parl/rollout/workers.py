"""What the ``hf`` and ``vllm`` pools share: spawned worker processes driven through queues.

Each worker has an inbox and answers on one results queue shared by all workers. Inbox messages:
``("attach", shared_tensors)``, ``("sync", version)``, ``("generate", requests, sampling)``, ``("stop",)``.
Results: ``("ready", worker_id, pid)``, ``("synced", worker_id, version)``, ``("group", worker_id, group)``,
``("done", worker_id, start, end)`` after each piece of work handed out, and ``("error", worker_id,
traceback)`` before a worker exits on an exception.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import time
from collections.abc import Iterable, Iterator

import torch
import torch.multiprocessing as mp

from lit_parl.rollout.base import RolloutPool
from lit_parl.trajectory import Group, GroupRequest

_SPAWN = mp.get_context("spawn")  # a forked worker would inherit the trainer's threads and locks


class SpawnedWorkerPool(RolloutPool):
    """``num_workers`` spawned processes of ``threads_per_worker`` CPU threads each.

    Owns the processes and their queues once started, the policy's shared-memory copy, and the
    trainer's side of the messages: waiting for the workers to be ready, syncing weights, collecting
    groups, and reporting a dead, silent or failed worker. A subclass starts its workers (``_spawn``,
    with its own worker function and a finalizer that stops them) and hands out requests in
    ``generate``. Colocated (sync mode: generation and training take turns), each worker gets
    ``colocated_threads``, by default all cores divided between the workers.
    """

    backend: str  # set by each subclass: the name in health()
    worker_label: str  # set by each subclass: how error messages name a worker

    def __init__(
        self,
        num_workers: int,
        threads_per_worker: int,
        colocated_threads: int | None,
        start_timeout_s: float,
        response_timeout_s: float,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"rollout.pool.num_workers must be >= 1, got {num_workers}")
        if threads_per_worker < 1:
            raise ValueError(f"rollout.pool.threads_per_worker must be >= 1, got {threads_per_worker}")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.colocated_threads = colocated_threads  # None: all cores split between the workers
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self.version = None
        self._processes: list[mp.Process] = []
        self._inboxes: list = []
        self._results = None
        self._shared: dict[str, torch.Tensor] | None = None
        self._intervals: list[tuple[float, float]] = []
        self._finalizer = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def _open_queues(self) -> None:
        """Refuse a second start, then open the results queue and one inbox per worker."""
        if self._processes:
            raise RuntimeError(f"{type(self).__name__}.start called twice")
        self._results = _SPAWN.Queue()
        self._inboxes = [_SPAWN.Queue() for _ in range(self.num_workers)]

    def _worker_threads(self, colocated: bool) -> int:
        if colocated:
            return self.colocated_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        return self.threads_per_worker

    def _spawn(self, target, args: tuple, name: str, daemon: bool) -> None:
        """Run ``target(worker_id, *args, inbox, results, trainer_pid)`` in each worker; return once all are ready."""
        for worker_id in range(self.num_workers):
            process = _SPAWN.Process(
                target=target,
                args=(worker_id, *args, self._inboxes[worker_id], self._results, os.getpid()),
                name=f"{name}-{worker_id}",
                daemon=daemon,
            )
            process.start()
            self._processes.append(process)  # the subclass's finalizer holds this same list
        ready = set()
        while len(ready) < self.num_workers:
            kind, worker_id, *_ = self._receive(self.start_timeout_s, "starting")
            if kind != "ready":
                raise RuntimeError(f"{self.worker_label} {worker_id} sent {kind!r} while starting")
            ready.add(worker_id)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        # a restarted pool attaches fresh shared tensors to its new workers
        self._processes, self._inboxes, self._shared, self.version = [], [], None, None

    def health(self) -> dict:
        return {
            "backend": self.backend,
            "workers": len(self._processes),
            "alive": sum(p.is_alive() for p in self._processes),
            "version": self.version,
        }

    def reserved_cpus(self, colocated: bool) -> int:
        return 0 if colocated else self.num_workers * self.threads_per_worker

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- weights ---------------------------------------------------------------------------------------
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._require_started()
        tensors = {name: t.detach() for name, t in named_tensors}
        if self._shared is None:
            self._shared = {name: t.to("cpu", copy=True).share_memory_() for name, t in tensors.items()}
            for inbox in self._inboxes:
                inbox.put(("attach", self._shared))
        else:
            missing = set(self._shared) ^ set(tensors)
            if missing:
                raise ValueError(f"sync_weights got a different set of tensors than before: {sorted(missing)[:5]}")
            with torch.no_grad():
                for name, t in tensors.items():
                    self._shared[name].copy_(t)
        self.version = None  # nothing may be generated until every worker confirmed the new version
        for inbox in self._inboxes:
            inbox.put(("sync", version))
        confirmed = set()
        while len(confirmed) < self.num_workers:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, f"syncing version {version}")
            if kind != "synced" or rest[0] != version:
                raise RuntimeError(f"{self.worker_label} {worker_id} answered {kind!r} {rest} while syncing version {version}")
            confirmed.add(worker_id)
        self.version = version

    # -- generation ------------------------------------------------------------------------------------
    def _collect(self, requests: list[GroupRequest], busy: int) -> Iterator[Group]:
        """Yield the groups of ``requests`` as they arrive, after ``busy`` pieces of work were handed out."""
        self._intervals = []
        waiting = {r.prompt_id for r in requests}
        while waiting:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, "generating")
            if kind == "group":
                group = rest[0]
                if group.prompt_id not in waiting:
                    raise RuntimeError(f"{self.worker_label} {worker_id} returned prompt_id {group.prompt_id}, which was not requested or already returned")
                waiting.discard(group.prompt_id)
                yield group
            elif kind == "done":
                self._intervals.append((rest[0], rest[1]))
                busy -= 1
            else:
                raise RuntimeError(f"{self.worker_label} {worker_id} sent unexpected {kind!r} while generating")
        while busy:  # collect the last "done" so the next call starts clean
            kind, worker_id, *rest = self._receive(self.response_timeout_s, "finishing")
            if kind != "done":
                raise RuntimeError(f"{self.worker_label} {worker_id} sent unexpected {kind!r} after its groups")
            self._intervals.append((rest[0], rest[1]))
            busy -= 1

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(self._intervals)

    # -- internals -------------------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._processes:
            raise RuntimeError(f"{type(self).__name__} is not started (call start() first, or it was closed)")

    def _receive(self, timeout_s: float, doing: str) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = self._results.get(timeout=0.2)
            except queue.Empty:
                if not self._processes:  # closed from another thread (the trainer failed): stop waiting
                    raise RuntimeError(f"the pool was closed while {doing}") from None
                dead = [(p.name, p.exitcode) for p in self._processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{self.worker_label}(s) died while {doing}: {dead} (name, exit code)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer from the {self.worker_label}s for {timeout_s:.0f} s while {doing}") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"{self.worker_label} {message[1]} failed while {doing}:\n{message[2]}")
            return message


# -- the worker side ---------------------------------------------------------------------------------------
def die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, however the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not Linux: the worker still exits when it sees its parent gone


def inbox_messages(inbox, parent_pid: int) -> Iterator[tuple]:
    """A worker's messages, until ``("stop",)`` or until its parent is gone."""
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if message[0] == "stop":
            return
        yield message


def stop_processes(processes: list, inboxes: list) -> None:
    """Ask the workers to stop, give them 5 s together, then kill the ones left."""
    for inbox in inboxes:
        try:
            inbox.put(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
