"""What the ``hf`` and ``vllm`` pools share: spawned worker processes, their messages, and their loop.

Each worker runs ``serve`` around an engine of its backend (a small object with ``load`` and
``sample``, see ``WorkerEngine``); the loop, the messages and the checks are the same for every backend.
Each worker has an inbox and answers on one results queue shared by all workers.

Inbox messages: ``("attach", shared_tensors)``, ``("sync", version)``, ``("generate", call, requests,
sampling)``, ``("stop",)``. Results: ``("ready", worker_id, pid)``, ``("synced", worker_id, version)``,
``("group", worker_id, call, group)``, ``("done", worker_id, call, start, end)`` after each piece of work
handed out, and ``("error", worker_id, traceback)`` before a worker exits on an exception. ``call``
numbers the pool's ``generate`` calls: what a worker still sends for a call whose consumer stopped early
is dropped, not taken for the next call's.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar, Protocol

import torch
import torch.multiprocessing as mp

from lit_parl.rollout.base import PoolSpec, RolloutPool, WeightBucket
from lit_parl.rollout.processes import die_with_parent, stop_workers, unguarded_main_script
from lit_parl.trajectory import GroupCompletions, GroupRequest, SamplingParams

_SPAWN = mp.get_context("spawn")  # a forked worker would inherit the trainer's threads and locks


class WorkerEngine(Protocol):
    """A backend's engine inside one worker process, built there by the factory the pool hands to ``serve``."""

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        """Load the weights in ``shared`` (Hugging Face names, shared memory); return once they are in use."""

    def sample(self, requests: list[GroupRequest], sampling: SamplingParams, version: int) -> Iterator[GroupCompletions]:
        """Yield each request's completions, stamped ``version``, as soon as its samples are finished."""


class SpawnedWorkerPool(RolloutPool):
    """``num_workers`` spawned processes that each run ``serve`` around one engine.

    Owns the processes and their queues, the policy's shared-memory copy, and the trainer's side of the
    messages: waiting for the workers to be ready, syncing weights, collecting groups, and reporting a
    dead, silent or failed worker. A subclass says how its engine is built (``_engine``) and how requests
    are split between the workers (``_assign``).

    Args:
        num_workers: worker processes.
        threads_per_worker: CPU threads of each worker while the trainer runs beside it.
        colocated_threads: CPU threads of each worker when generation and training take turns
            (``PoolSpec.colocated``); ``None``: all cores divided between the workers.
        start_timeout_s: how long the workers may take to build their engines.
        response_timeout_s: how long the pool waits for any answer of a worker before it gives up.
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
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if num_workers < 1:
            raise ValueError(f"{name}(num_workers={num_workers}): at least one worker is needed")
        if threads_per_worker < 1:
            raise ValueError(f"{name}(threads_per_worker={threads_per_worker}): a worker needs at least one thread")
        if colocated_threads is not None and colocated_threads < 1:
            raise ValueError(f"{name}(colocated_threads={colocated_threads}): give at least one thread, or None for all cores")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.colocated_threads = colocated_threads
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self._processes: list = []
        self._inboxes: list = []
        self._results = None
        self._shared: dict[str, torch.Tensor] | None = None
        self._done_intervals: list[tuple[float, float]] = []
        self._call = 0
        self._finalizer = None

    # -- what a subclass provides ----------------------------------------------------------------------
    @abstractmethod
    def _engine(self, spec: PoolSpec, threads: int) -> Callable[[], WorkerEngine]:
        """A picklable factory that builds the engine inside a worker (``functools.partial`` of a class)."""

    @abstractmethod
    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        """``(worker index, requests)`` pieces of work; each piece is one ``generate`` message."""

    # -- RolloutPool -----------------------------------------------------------------------------------
    def _start(self, spec: PoolSpec) -> None:
        self._results = _SPAWN.Queue()
        self._inboxes = [_SPAWN.Queue() for _ in range(self.num_workers)]
        self._processes = []
        # stop the workers even if the owner forgets to close the pool (garbage collection, interpreter exit)
        self._finalizer = weakref.finalize(self, stop_workers, self._processes, self._inboxes)
        threads = self._worker_threads(spec.colocated)
        make_engine = self._engine(spec, threads)
        for worker_id in range(self.num_workers):
            process = _SPAWN.Process(
                target=serve,
                args=(worker_id, make_engine, self._inboxes[worker_id], self._results, os.getpid()),
                name=f"{self.process_name}-{worker_id}",
                daemon=self.daemon_workers,
            )
            process.start()
            self._processes.append(process)  # the finalizer holds this same list
        ready = set()
        while len(ready) < self.num_workers:
            try:
                kind, worker_id, *_ = self._receive(self.start_timeout_s, "starting")
            except RuntimeError as error:
                script = unguarded_main_script()
                if script is None:
                    raise
                raise RuntimeError(
                    f"{error}. The pool's workers are spawned processes, which import {script} again, and that script "
                    'starts training at import time. Put its entry point under `if __name__ == "__main__":`.'
                ) from error
            if kind != "ready":
                raise RuntimeError(f"{self.worker_label} {worker_id} sent {kind!r} while starting")
            ready.add(worker_id)

    def _sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        first = self._shared is None
        shared = {} if first else self._shared
        seen: set[str] = set()
        with torch.no_grad():
            for bucket in buckets:  # each bucket is copied as it arrives: the caller may free it right after
                for name, tensor in bucket:
                    if name in seen:
                        raise ValueError(f"sync_weights got tensor {name!r} twice in one sync")
                    seen.add(name)
                    tensor = tensor.detach()
                    if first:
                        shared[name] = tensor.to("cpu", copy=True).share_memory_()
                    elif name not in shared:
                        raise ValueError(f"sync_weights got tensor {name!r}, which the first sync did not have")
                    elif shared[name].shape != tensor.shape:
                        raise ValueError(f"sync_weights got {name!r} of shape {tuple(tensor.shape)}, not {tuple(shared[name].shape)} as before")
                    else:
                        shared[name].copy_(tensor)
        missing = set(shared) - seen
        if missing:
            raise ValueError(f"sync_weights lacks {len(missing)} tensor(s) the first sync had: {sorted(missing)[:5]}")
        if first:
            self._shared = shared  # kept only once complete: a failed first sync allocates afresh next time
            for inbox in self._inboxes:
                inbox.put(("attach", shared))
        for inbox in self._inboxes:
            inbox.put(("sync", version))
        confirmed = set()
        while len(confirmed) < self.num_workers:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, f"syncing version {version}")
            if kind != "synced" or rest[0] != version:
                raise RuntimeError(f"{self.worker_label} {worker_id} answered {kind!r} {rest} while syncing version {version}")
            confirmed.add(worker_id)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        self._call += 1
        call = self._call
        pieces = self._assign(requests)
        # Hand every piece out now: a worker must not wait for the trainer to ask for the next group (the
        # caller trains between two groups, and the workers keep generating meanwhile).
        for worker, piece in pieces:
            self._inboxes[worker].put(("generate", call, piece, sampling))
        self._done_intervals = []
        waiting, busy = len(requests), len(pieces)
        while waiting or busy:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, "generating", call)
            if kind == "group":
                waiting -= 1
                yield rest[1]
            elif kind == "done":
                self._done_intervals.append((rest[1], rest[2]))
                busy -= 1
            else:
                raise RuntimeError(f"{self.worker_label} {worker_id} sent unexpected {kind!r} while generating")

    def _worker_counts(self) -> tuple[int, int]:
        return len(self._processes), sum(p.is_alive() for p in self._processes)

    def _details(self) -> dict:
        return {"pids": self.pids()}

    def _busy_intervals(self) -> list[tuple[float, float]]:
        return list(self._done_intervals)

    def _close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        # a restarted pool attaches fresh shared tensors to its new workers
        self._processes, self._inboxes, self._shared, self._finalizer = [], [], None, None

    def reserved_cpus(self, colocated: bool) -> int:
        return 0 if colocated else self.num_workers * self.threads_per_worker

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- internals -------------------------------------------------------------------------------------
    def _worker_threads(self, colocated: bool) -> int:
        if colocated:
            return self.colocated_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        return self.threads_per_worker

    def _receive(self, timeout_s: float, doing: str, call: int | None = None) -> tuple:
        """The next message; groups and "done" of any generate call but ``call`` are dropped."""
        results, deadline = self._results, time.monotonic() + timeout_s
        while True:
            try:
                message = results.get(timeout=0.2)
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
            if message[0] in ("group", "done") and message[2] != call:
                continue  # left over from a generate call whose consumer stopped early
            return message


# -- the worker side ---------------------------------------------------------------------------------------
def serve(worker_id: int, make_engine: Callable[[], WorkerEngine], inbox, results, parent_pid: int) -> None:
    """A worker's whole life: build the engine, then answer the inbox until told to stop or orphaned.

    The loop holds the shared tensors and the version, and refuses requests for any version other than
    the one it holds, whatever the pool checked before: a worker never generates with weights it was not
    asked for.
    """
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    try:
        engine = make_engine()
        shared: dict[str, torch.Tensor] = {}
        version = None
        results.put(("ready", worker_id, os.getpid()))
        for message in inbox_messages(inbox, parent_pid):
            kind = message[0]
            if kind == "attach":
                shared = message[1]
            elif kind == "sync":
                version = None  # nothing is generated with half-loaded weights
                engine.load(shared, message[1])
                version = message[1]
                results.put(("synced", worker_id, version))
            elif kind == "generate":
                call, requests, sampling = message[1:]
                stale = sorted({r.version for r in requests if r.version != version})
                if stale:
                    raise RuntimeError(f"worker {worker_id} holds policy version {version} but got requests for {stale}")
                start = time.monotonic()
                for group in engine.sample(requests, sampling, version):
                    if group.version != version:
                        raise RuntimeError(f"worker {worker_id}'s engine stamped version {group.version} while holding {version}")
                    results.put(("group", worker_id, call, group))
                results.put(("done", worker_id, call, start, time.monotonic()))
            else:
                raise RuntimeError(f"worker {worker_id} got unknown message {kind!r}")
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        results.put(("error", worker_id, traceback.format_exc()))


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
