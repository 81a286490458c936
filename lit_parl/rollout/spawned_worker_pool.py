"""What the ``hf`` and ``vllm`` pools share: spawned worker processes, their messages, and their loop.

Each worker runs ``lit_parl.rollout.worker_loop.serve`` around an engine of its backend (a small object
with ``load`` and ``sample``, see ``WorkerEngine`` there); the loop, the messages, the checks and the
restarts are the same for every backend. This module is the trainer's side.

Channels: each worker reads an inbox (a ``multiprocessing`` queue only the pool writes) and answers on
a results pipe of its own (``processes.Outbox`` in the worker, ``processes.read_messages`` on a thread
of the trainer). A worker killed in the middle of a message cuts short only its own pipe: the partial
message is dropped, and the pipe's end tells the pool that the worker is gone.

Inbox messages: ``("attach", shared_tensors)``, ``("sync", version)``, ``("generate", call, piece,
requests, sampling)``, ``("stop",)``. Results: ``("ready", worker_id, pid)``, ``("synced", worker_id,
version)``, ``("group", worker_id, call, group)``, ``("done", worker_id, call, piece, start, end)``
after each piece of work, and ``("error", worker_id, traceback)`` before a worker exits on an
exception. ``call`` numbers the pool's ``generate`` calls: what a worker still sends for a call whose
consumer stopped early is dropped, not taken for the next call's. ``piece`` numbers a call's pieces of
work (``_assign``: one ``generate`` message each).

Restarts: a worker that exits (killed, crashed) during ``generate`` or ``sync_weights``, or that owes an
answer and stays silent for ``response_timeout_s`` (then it is killed: hung), is replaced by a new
process in the same slot. The new one attaches the shared weights, loads the version the pool holds,
and is sent again every piece of the dead one that has a group the trainer has not received: the same
requests, seeds and batch, so the same samples. Groups of such a piece that were delivered before the
death are dropped when they come again. Each restart logs a warning (logger ``lit_parl``); the
``max_restarts + 1``-th failure within one call stops the run. An ``("error", ...)`` is a bug, not a
fault, and is raised as it is; so is a worker that dies while the pool starts (a replacement that dies
while starting counts as one more failure).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.multiprocessing as mp

from lit_parl.rollout.rollout_pool import PoolSpec, RolloutPool, WeightBucket
from lit_parl.rollout.processes import descendants, kill_if_same, read_messages, stop_workers, unguarded_main_script
from lit_parl.rollout.worker_loop import WorkerEngine, serve
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams

_SPAWN = mp.get_context("spawn")  # a forked worker would inherit the trainer's threads and locks
_POLL_S = 0.2  # how often a waiting pool looks at its workers (and at whether it was closed)
_EXIT_GRACE_S = 5.0  # a worker gone for this long whose pipe has not ended (a descendant holds it) is given up
log = logging.getLogger("lit_parl")


@dataclass(eq=False)
class _Worker:
    """The process in one worker slot, and what the pool is owed by it."""

    index: int
    process: Any
    inbox: Any
    heard: float  # when it last sent a message, or was started or given work
    ready: bool = False
    owed_syncs: list[int] = field(default_factory=list)  # versions sent, not yet confirmed, in order
    hung: bool = False
    gone_at: float | None = None
    descendants: dict[int, int] = field(default_factory=dict)  # noted before a hung worker is killed

    @property
    def settled(self) -> bool:
        return self.ready and not self.owed_syncs


@dataclass(eq=False)
class _Piece:
    """One ``generate`` message of a call: what a worker was given, and whether it is finished."""

    index: int
    worker: int
    requests: list[GroupRequest]
    done: bool = False
    reissued: bool = False


class SpawnedWorkerPool(RolloutPool):
    """``num_workers`` spawned processes that each run ``serve`` around one engine.

    Owns the processes and their channels, the policy's shared-memory copy, and the trainer's side of
    the messages: waiting for the workers to be ready, syncing weights, collecting groups, and replacing
    a dead or hung worker (see the module docstring). A subclass says how its engine is built
    (``_engine``) and how requests are split between the workers (``_assign``).

    Args:
        num_workers: worker processes.
        threads_per_worker: CPU threads of each worker while the trainer runs beside it.
        colocated_threads: CPU threads of each worker when generation and training take turns
            (``PoolSpec.colocated``); ``None``: all cores divided between the workers.
        start_timeout_s: how long the workers may take to build their engines (a replacement too).
        response_timeout_s: how long a worker that owes the pool an answer (a group, the end of a piece,
            a sync confirmation) may stay silent before it is taken for hung, killed and replaced.
        max_restarts: worker replacements allowed within one ``generate`` or ``sync_weights`` call; the
            next failure stops the run with an error. 0: any failure stops it.
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
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if num_workers < 1:
            raise ValueError(f"{name}(num_workers={num_workers}): at least one worker is needed")
        if threads_per_worker < 1:
            raise ValueError(f"{name}(threads_per_worker={threads_per_worker}): a worker needs at least one thread")
        if colocated_threads is not None and colocated_threads < 1:
            raise ValueError(f"{name}(colocated_threads={colocated_threads}): give at least one thread, or None for all cores")
        if max_restarts < 0:
            raise ValueError(f"{name}(max_restarts={max_restarts}): give 0 (no restart) or more")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.colocated_threads = colocated_threads
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self.max_restarts = max_restarts
        self._workers: list[_Worker] = []
        self._processes: list = []  # the same processes and inboxes, in lists the finalizer holds
        self._inboxes: list = []
        self._messages: queue.Queue | None = None  # (worker, message) from every worker's reader thread
        self._make_engine: Callable[[], WorkerEngine] | None = None
        self._shared: dict[str, torch.Tensor] | None = None
        self._done_intervals: list[tuple[float, float]] = []
        self._call = 0
        self._restarts = 0
        self._open = False
        self._next_watch = 0.0
        self._lock = threading.Lock()  # a replacement never starts a process while close() stops them
        self._finalizer = None
        # Every worker is started from this one thread, which lives as long as the pool. Linux delivers a
        # child's PR_SET_PDEATHSIG when the *thread* that forked it exits: a replacement started from the
        # thread consuming `generate` (a per-iteration prefetch thread) would be killed with that thread.
        self._launcher: ThreadPoolExecutor | None = None

    # -- what a subclass provides ----------------------------------------------------------------------
    @abstractmethod
    def _engine(self, spec: PoolSpec, threads: int) -> Callable[[], WorkerEngine]:
        """A picklable factory that builds the engine inside a worker (``functools.partial`` of a class)."""

    @abstractmethod
    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        """``(worker index, requests)`` pieces of work; each piece is one ``generate`` message."""

    def _worker_env(self, index: int) -> dict[str, str]:
        """Environment variables set in the process of slot ``index`` (a replacement too) before its engine is built."""
        return {}

    # -- RolloutPool -----------------------------------------------------------------------------------
    def _start(self, spec: PoolSpec) -> None:
        self._messages = queue.Queue()
        self._workers, self._processes, self._inboxes = [], [], []
        self._restarts, self._open = 0, True
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.process_name}-launcher")
        # stop the workers even if the owner forgets to close the pool (garbage collection, interpreter exit)
        self._finalizer = weakref.finalize(self, stop_workers, self._processes, self._inboxes)
        self._make_engine = self._engine(spec, self._worker_threads(spec.colocated))
        for index in range(self.num_workers):
            self._launch(index)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not all(w.ready for w in self._workers):
                event = self._event("starting", owes=lambda w: False)  # a slow start is the deadline's
                if event is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"no answer from the {self.worker_label}s for {self.start_timeout_s:.0f} s while starting")
                    continue
                worker, message = event
                if message[0] == "exited":
                    worker.process.join(timeout=5.0)
                    raise RuntimeError(f"{self.worker_label}(s) died while starting: {[(worker.process.name, worker.process.exitcode)]} (name, exit code)")
                if not self._confirm(worker, message):
                    raise RuntimeError(f"{self.worker_label} {worker.index} sent {message[0]!r} while starting")
        except RuntimeError as error:
            script = unguarded_main_script()
            if script is None:
                raise
            raise RuntimeError(
                f"{error}. The pool's workers are spawned processes, which import {script} again, and that script "
                'starts training at import time. Put its entry point under `if __name__ == "__main__":`.'
            ) from error

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
            for worker in self._workers:
                worker.inbox.put(("attach", shared))
        now = time.monotonic()
        for worker in self._workers:
            worker.inbox.put(("sync", version))
            worker.owed_syncs.append(version)
            worker.heard = max(worker.heard, now)
        doing, restarts = f"syncing version {version}", 0
        while not all(w.settled for w in self._workers):
            event = self._event(doing, owes=lambda w: not w.settled)
            if event is None:
                continue
            worker, message = event
            if message[0] == "exited":  # the shared copy holds `version` already: the new worker loads it
                restarts = self._replace(worker, restarts, doing, version, reissued=[])
            elif message[0] not in ("group", "done") and not self._confirm(worker, message):  # group, done: an earlier call's
                raise RuntimeError(f"{self.worker_label} {worker.index} answered {message[0]!r} while {doing}")

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        self._call += 1
        call, version, doing = self._call, self.version, "generating"
        pieces = [_Piece(i, worker, piece) for i, (worker, piece) in enumerate(self._assign(requests))]
        piece_of = {r.prompt_id: p for p in pieces for r in p.requests}
        undelivered = set(piece_of)  # prompts not yet yielded to the trainer
        now = time.monotonic()
        for worker in self._workers:  # silence counts from the moment there is work to do
            worker.heard = max(worker.heard, now)
        # Hand every piece out now: a worker must not wait for the trainer to ask for the next group (the
        # caller trains between two groups, and the workers keep generating meanwhile).
        for piece in pieces:
            self._send(piece, call, sampling)
        self._done_intervals = []

        def owes(worker: _Worker) -> bool:
            return not worker.settled or any(p.worker == worker.index and not p.done for p in pieces)

        restarts = 0
        # A piece is done once its worker said so, after its groups (one pipe keeps them in order), or once
        # every group of it was delivered. A prompt still missing then is the base class's error to raise.
        while not all(p.done for p in pieces) or not all(w.settled for w in self._workers):
            event = self._event(doing, owes)
            if event is None:
                continue
            worker, message = event
            kind = message[0]
            if kind in ("group", "done") and message[2] != call:
                continue  # left over from a generate call whose consumer stopped early
            if kind == "group":
                group = message[3]
                piece = piece_of.get(group.prompt_id)
                if piece is not None and piece.reissued and group.prompt_id not in undelivered:
                    continue  # delivered before the piece's first worker died
                undelivered.discard(group.prompt_id)
                yield group
            elif kind == "done":
                pieces[message[3]].done = True
                self._done_intervals.append((message[4], message[5]))
            elif kind == "exited":
                lost = [p for p in pieces if p.worker == worker.index and not p.done]
                reissued = [p for p in lost if any(r.prompt_id in undelivered for r in p.requests)]
                for piece in lost:
                    piece.done = piece not in reissued  # every group delivered: nothing is owed any more
                delivered = sum(r.prompt_id not in undelivered for p in reissued for r in p.requests)
                restarts = self._replace(worker, restarts, doing, version, reissued, delivered)
                for piece in reissued:
                    piece.reissued = True
                    self._send(piece, call, sampling)
            elif not self._confirm(worker, message):
                raise RuntimeError(f"{self.worker_label} {worker.index} sent unexpected {kind!r} while generating")

    def _worker_counts(self) -> tuple[int, int]:
        return len(self._processes), sum(p.is_alive() for p in self._processes)

    def _details(self) -> dict:
        return {"pids": self.pids(), "restarts": self._restarts}

    def _busy_intervals(self) -> list[tuple[float, float]]:
        return list(self._done_intervals)

    def _close(self) -> None:
        with self._lock:  # from here on, no replacement starts a process
            self._open = False
            finalizer = self._finalizer
        if finalizer is not None:
            finalizer()
        if self._launcher is not None:  # after the workers are stopped: its end would kill them
            self._launcher.shutdown(wait=False)
        # a restarted pool attaches fresh shared tensors to its new workers
        self._workers, self._processes, self._inboxes, self._shared, self._finalizer = [], [], [], None, None
        self._launcher = None

    def reserved_cpus(self, colocated: bool) -> int:
        return 0 if colocated else self.num_workers * self.threads_per_worker

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- internals -------------------------------------------------------------------------------------
    def _worker_threads(self, colocated: bool) -> int:
        if colocated:
            return self.colocated_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        return self.threads_per_worker

    def _launch(self, index: int, version: int | None = None) -> _Worker:
        """Start the process of slot ``index`` (replacing the one there); with ``version``, load it at once."""
        reader, writer = _SPAWN.Pipe(duplex=False)
        inbox = _SPAWN.Queue()
        process = _SPAWN.Process(
            target=serve,
            args=(index, self._make_engine, inbox, writer, os.getpid(), self._worker_env(index)),
            name=f"{self.process_name}-{index}",
            daemon=self.daemon_workers,
        )
        with self._lock:
            if not self._open:
                raise RuntimeError(f"the pool was closed before {self.worker_label} {index} could be replaced")
            self._launcher.submit(process.start).result()
            worker = _Worker(index, process, inbox, heard=time.monotonic())
            if index < len(self._workers):
                old = self._workers[index].inbox
                old.cancel_join_thread()  # its feeder may be stuck on a pipe nobody reads: never wait for it
                old.close()
                self._workers[index], self._processes[index], self._inboxes[index] = worker, process, inbox
            else:
                self._workers.append(worker)
                self._processes.append(process)  # the finalizer holds this same list
                self._inboxes.append(inbox)
        writer.close()  # the child holds the only write end: its death ends the pipe
        threading.Thread(target=read_messages, args=(reader, worker, self._messages), name=f"{process.name}-results", daemon=True).start()
        if version is not None:
            inbox.put(("attach", self._shared))
            inbox.put(("sync", version))
            worker.owed_syncs.append(version)
        return worker

    def _replace(self, worker: _Worker, restarts: int, doing: str, version: int | None, reissued: list[_Piece], delivered: int = 0) -> int:
        """Replace a worker that is gone with a new process loading ``version``; return the call's restarts so far.

        ``reissued`` are the pieces the caller sends the new process again, ``delivered`` how many of their
        groups the trainer has already received (for the log).
        """
        process = worker.process
        process.join(timeout=5.0)  # its pipe has ended, so it has exited or is about to; reap it
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
        kill_if_same(worker.descendants)
        cause = self._cause(worker)
        if restarts >= self.max_restarts:
            raise RuntimeError(
                f"{self.worker_label} {worker.index} (pid {process.pid}) {cause} while {doing}, after {restarts} restart(s) "
                f"in this call: stopping (max_restarts={self.max_restarts}). Its output above may say why; "
                "raise max_restarts to retry more."
            )
        if version is None or self._shared is None:
            raise RuntimeError(f"{self.worker_label} {worker.index} {cause} while {doing}, before the pool held any weights")
        if self.version not in (None, version):  # a sync ran while this generate call was suspended
            raise RuntimeError(f"{self.worker_label} {worker.index} {cause}; its work is for version {version}, but the pool now holds {self.version}")
        new = self._launch(worker.index, version)
        self._restarts += 1
        log.warning(
            "%s %d (pid %s) %s while %s; restarted it as pid %s with version %d and re-issued %d request(s) in %d "
            "piece(s) (%d of their groups were delivered already: dropped when they come again)",
            self.worker_label, worker.index, process.pid, cause, doing, new.process.pid, version,
            sum(len(p.requests) for p in reissued), len(reissued), delivered,
        )
        return restarts + 1

    def _cause(self, worker: _Worker) -> str:
        if worker.hung:
            return f"was silent for {self.response_timeout_s:g} s with work outstanding (hung), so it was killed"
        code = worker.process.exitcode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name} (exit code {code})"
            except ValueError:
                pass
        return f"exited (exit code {code})"

    def _send(self, piece: _Piece, call: int, sampling: SamplingParams) -> None:
        if not self._open:
            raise RuntimeError("the pool was closed while generating")
        self._workers[piece.worker].inbox.put(("generate", call, piece.index, piece.requests, sampling))

    def _confirm(self, worker: _Worker, message: tuple) -> bool:
        """Take a ``ready`` or ``synced`` message into account; False for any other kind."""
        if message[0] == "ready":
            worker.ready = True
            return True
        if message[0] == "synced":
            expected = worker.owed_syncs.pop(0) if worker.owed_syncs else None
            if message[2] != expected:
                raise RuntimeError(f"{self.worker_label} {worker.index} confirmed version {message[2]}, but {expected} was expected")
            return True
        return False

    def _event(self, doing: str, owes: Callable[[_Worker], bool]) -> tuple[_Worker, tuple] | None:
        """The next message of a current worker, or None after a short wait; kills a hung worker meanwhile.

        ``("exited",)`` means the worker is gone: its pipe ended after every complete message it sent.
        ``owes`` says which workers owe an answer: those are killed after ``response_timeout_s`` of
        silence (``start_timeout_s`` until they are ready). Raises a worker's error, and once the pool
        was closed (from another thread: the trainer failed).
        """
        if not self._open:
            raise RuntimeError(f"the pool was closed while {doing}")
        now = time.monotonic()
        # Watched also while other workers stream (a silent one must not hide behind them), but only once
        # every message that arrived is taken into account: after a long training step, the queue holds
        # the messages the workers sent meanwhile, and their senders are not silent.
        if now >= self._next_watch and self._messages.empty():
            self._next_watch = now + _POLL_S
            for worker in self._workers:
                if worker.process.exitcode is not None:
                    worker.gone_at = worker.gone_at or now
                    if now - worker.gone_at > _EXIT_GRACE_S:
                        return worker, ("exited",)  # a descendant keeps its pipe open: give up waiting for the end
                elif not worker.hung and owes(worker):
                    limit = self.response_timeout_s if worker.ready else self.start_timeout_s
                    if now - worker.heard > limit:
                        worker.hung = True
                        # its engine's own processes are re-parented, and lost from view, once it has gone
                        worker.descendants = descendants([worker.process.pid])
                        worker.process.kill()  # its pipe ends, and it is replaced like a dead one
        try:
            worker, message = self._messages.get(timeout=_POLL_S)
        except queue.Empty:
            return None
        workers = self._workers
        if not self._open:
            raise RuntimeError(f"the pool was closed while {doing}")
        if worker.index >= len(workers) or workers[worker.index] is not worker:
            return None  # from a process this slot has replaced
        worker.heard = time.monotonic()
        if message[0] == "error":
            raise RuntimeError(f"{self.worker_label} {worker.index} failed while {doing}:\n{message[2]}")
        if message[0] == "unreadable":
            raise RuntimeError(f"{self.worker_label} {worker.index} sent a message the pool cannot read:\n{message[1]}")
        return worker, message
