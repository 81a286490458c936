"""The processes of a spawned-worker pool: starting them, hearing them, replacing them, stopping them.

One process per worker slot runs ``lit_parl.rollout.worker_loop.serve`` around the pool's engine. It
reads an inbox (a ``multiprocessing`` queue only the trainer writes) and answers on a results pipe of its
own, which a thread of the trainer reads onto the one queue of every slot's messages
(``processes.read_messages``). A worker killed in the middle of a message cuts short only its own pipe:
the partial message is dropped, and the pipe's end (``Exited``) tells the trainer that the worker is gone.

Restarts: a worker that exits (killed, crashed), or that owes an answer and stays silent for
``response_timeout_s`` (then it is killed: hung), is replaced by a new process in the same slot, which
attaches the shared weights and loads the version they hold, and the LoRA adapter beside them if any. Each
restart logs a warning (logger ``lit_parl``); the ``max_restarts + 1``-th failure within one call stops the
run. A ``WorkerError`` is a bug, not a fault, and is raised as it is; so is a worker that dies while the pool
starts (a replacement that dies while starting counts as one more failure).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

from lit_parl.rollout.processes import descendants, kill_if_same, read_messages, stop_workers, why_gone
from lit_parl.rollout.records import GroupRequest
from lit_parl.rollout.shared_weights import SharedWeights
from lit_parl.rollout.worker_loop import WorkerEngine, serve
from lit_parl.rollout.worker_messages import FROM_WORKER, Exited, LoadAdapter, Ready, Synced, Unreadable, WorkerError

_SPAWN = mp.get_context("spawn")  # a forked worker would inherit the trainer's threads and locks
_POLL_S = 0.2  # how often a waiting pool looks at its workers (and at whether it was closed)
_EXIT_GRACE_S = 5.0  # a worker gone for this long whose pipe has not ended (a descendant holds it) is given up
log = logging.getLogger("lit_parl")


@dataclass(eq=False)
class Worker:
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


class WorkerProcesses:
    """The worker processes of one started pool, their inboxes, the queue of their messages, their weights.

    Every process is started from one thread of its own, which lives as long as this object: Linux
    delivers a child's ``PR_SET_PDEATHSIG`` when the *thread* that forked it exits, so a replacement
    started from the thread consuming ``generate`` (a per-iteration prefetch thread) would die with it.

    Args:
        make_engine: a picklable factory that builds the engine inside a worker.
        envs: each slot's environment variables, set in its process (a replacement's too) first.
        cores: each slot's CPU cores, its process pinned to them first (``None``: no slot is pinned).
        label: how error messages name a worker.
        process_name: the processes' names are this and the slot.
        daemon: daemonic processes (a daemonic process may not start processes of its own).
        start_timeout_s, response_timeout_s, max_restarts: as ``SpawnedWorkerPool`` takes them.
    """

    def __init__(
        self,
        make_engine: Callable[[], WorkerEngine],
        envs: Sequence[dict[str, str]],
        label: str,
        process_name: str,
        daemon: bool,
        start_timeout_s: float,
        response_timeout_s: float,
        max_restarts: int,
        cores: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        self.make_engine = make_engine
        self.envs = list(envs)
        self.cores = list(cores) if cores is not None else [None] * len(self.envs)
        self.label, self.process_name, self.daemon = label, process_name, daemon
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self.max_restarts = max_restarts
        self.workers: list[Worker] = []
        self.weights = SharedWeights()
        self.restarts = 0  # over the pool's life
        self.open = True
        self._processes: list = []  # the workers' processes and inboxes, in lists the finalizer holds
        self._inboxes: list = []
        self._messages: queue.Queue = queue.Queue()  # (worker, message) from every worker's reader thread
        self._next_watch = 0.0
        self._lock = threading.Lock()  # a replacement never starts a process while stop() stops them
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{process_name}-launcher")
        # stop the workers even if the owner forgets to close the pool (garbage collection, interpreter exit)
        self._finalizer = weakref.finalize(self, stop_workers, self._processes, self._inboxes)

    def launch(self) -> None:
        """Start every slot's process; each sends ``Ready`` once it has built its engine."""
        for index in range(len(self.envs)):
            self._launch(index)

    def request_sync(self, version: int, attach: bool) -> None:
        """Ask every worker to load ``version`` from the shared weights (``attach``: attach them first)."""
        messages = self.weights.catch_up(version)[0 if attach else 1 :]  # [Attach,] Sync: no adapter after a write
        for worker in self.workers:
            for message in messages:
                self.send(worker, message, f"syncing version {version}")
            worker.owed_syncs.append(version)
        self.count_silence_from_now()

    def request_adapter(self, message: LoadAdapter) -> None:
        """Ask every worker to load ``message``'s LoRA adapter beside the base it holds."""
        self.weights.hold_adapter(message)
        for worker in self.workers:
            self.send(worker, message, f"loading the adapter of version {message.version}")
            worker.owed_syncs.append(message.version)
        self.count_silence_from_now()

    def send(self, worker: Worker, message: object, doing: str) -> None:
        """Put ``message`` in ``worker``'s inbox; refused once the pool was closed (while the caller was ``doing``)."""
        if not self.open:
            raise RuntimeError(f"the pool was closed while {doing}")
        worker.inbox.put(message)

    def count_silence_from_now(self) -> None:
        """Work was just handed out: a worker's silence counts from now, not from its last message."""
        now = time.monotonic()
        for worker in self.workers:
            worker.heard = max(worker.heard, now)

    def confirm(self, worker: Worker, message: object, doing: str) -> None:
        """Take a ``Ready`` or ``Synced`` into account; any other message is out of place while ``doing``."""
        if isinstance(message, Ready):
            worker.ready = True
        elif isinstance(message, Synced):
            expected = worker.owed_syncs.pop(0) if worker.owed_syncs else None
            if message.version != expected:
                raise RuntimeError(
                    f"{self.label} {worker.index} confirmed version {message.version}, but {expected} was expected"
                )
        else:
            raise RuntimeError(f"{self.label} {worker.index} sent {type(message).__name__} while {doing}")

    def replace(
        self,
        worker: Worker,
        restarts: int,
        doing: str,
        version: int,
        reissued: Sequence[Sequence[GroupRequest]] = (),
        delivered: int = 0,
    ) -> int:
        """Replace a worker that is gone with a new process loading ``version``; return the call's restarts so far.

        ``restarts`` counts the calling ``generate`` or sync's restarts before this one. ``reissued`` are the
        pieces the caller sends the new process again, ``delivered`` how many of their groups the trainer
        has already received (for the log).
        """
        process = worker.process
        process.join(timeout=5.0)  # its pipe has ended, so it has exited or is about to; reap it
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
        kill_if_same(worker.descendants)
        cause = why_gone(worker.hung, worker.process.exitcode, self.response_timeout_s)
        if restarts >= self.max_restarts:
            raise RuntimeError(
                f"{self.label} {worker.index} (pid {process.pid}) {cause} while {doing}, after {restarts} restart(s) "
                f"in this call: stopping (max_restarts={self.max_restarts}). Its output above may say why; "
                "raise max_restarts to retry more."
            )
        held = self.weights.version
        if self.weights.tensors is None:
            raise RuntimeError(f"{self.label} {worker.index} {cause} while {doing}, before the pool held any weights")
        if held != version:  # a sync ran while this generate call was suspended
            raise RuntimeError(
                f"{self.label} {worker.index} {cause}; its work is for version {version}, but the pool now holds {held}"
            )
        new = self._launch(worker.index, version)
        self.restarts += 1
        requests = sum(len(piece) for piece in reissued)
        log.warning(  # rare (a worker died): formatted here
            f"{self.label} {worker.index} (pid {process.pid}) {cause} while {doing}; restarted it as pid "
            f"{new.process.pid} with version {version} and re-issued {requests} request(s) in {len(reissued)} "
            f"piece(s) ({delivered} of their groups were delivered already: dropped when they come again)"
        )
        return restarts + 1

    def next_event(self, doing: str, owes: Callable[[Worker], bool]) -> tuple[Worker, object] | None:
        """The next message of a current worker, or None after a short wait; kills a hung worker meanwhile.

        ``Exited`` means the worker is gone: its pipe ended after every complete message it sent. ``owes``
        says which workers owe an answer: those are killed after ``response_timeout_s`` of silence
        (``start_timeout_s`` until they are ready). Raises a worker's error, a message the pool cannot read
        or does not know, and once the pool was closed (from another thread: the trainer failed).
        """
        if not self.open:
            raise RuntimeError(f"the pool was closed while {doing}")
        now = time.monotonic()
        # Watched also while other workers stream (a silent one must not hide behind them), but only once
        # every message that arrived is taken into account: after a long training step, the queue holds
        # the messages the workers sent meanwhile, and their senders are not silent.
        if now >= self._next_watch and self._messages.empty():
            self._next_watch = now + _POLL_S
            for worker in self.workers:
                if worker.process.exitcode is not None:
                    worker.gone_at = worker.gone_at or now
                    if now - worker.gone_at > _EXIT_GRACE_S:
                        return worker, Exited()  # a descendant keeps its pipe open: give up waiting for the end
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
        workers = self.workers
        if not self.open:
            raise RuntimeError(f"the pool was closed while {doing}")
        if worker.index >= len(workers) or workers[worker.index] is not worker:
            return None  # from a process this slot has replaced
        worker.heard = time.monotonic()
        if isinstance(message, WorkerError):
            raise RuntimeError(f"{self.label} {worker.index} failed while {doing}:\n{message.traceback}")
        if isinstance(message, Unreadable):
            raise RuntimeError(f"{self.label} {worker.index} sent a message the pool cannot read:\n{message.traceback}")
        if not isinstance(message, FROM_WORKER):
            raise RuntimeError(
                f"{self.label} {worker.index} sent a message of unknown kind while {doing}: {type(message).__name__}"
            )
        return worker, message

    def stop(self) -> None:
        """Stop every process (and what it started); from here on, none is started. Idempotent."""
        with self._lock:
            self.open = False
        self._finalizer()
        self._launcher.shutdown(wait=False)  # after the workers are stopped: its end would kill them

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def alive(self) -> int:
        return sum(p.is_alive() for p in self._processes)

    def _launch(self, index: int, version: int | None = None) -> Worker:
        """Start the process of slot ``index`` (replacing the one there); with ``version``, load it at once."""
        reader, writer = _SPAWN.Pipe(duplex=False)
        inbox = _SPAWN.Queue()
        process = _SPAWN.Process(
            target=serve,
            args=(index, self.make_engine, inbox, writer, os.getpid(), self.envs[index], self.cores[index]),
            name=f"{self.process_name}-{index}",
            daemon=self.daemon,
        )
        with self._lock:
            if not self.open:
                raise RuntimeError(f"the pool was closed before {self.label} {index} could be replaced")
            self._launcher.submit(process.start).result()
            worker = Worker(index, process, inbox, heard=time.monotonic())
            if index < len(self.workers):
                old = self.workers[index].inbox
                old.cancel_join_thread()  # its feeder may be stuck on a pipe nobody reads: never wait for it
                old.close()
                self.workers[index], self._processes[index], self._inboxes[index] = worker, process, inbox
            else:
                self.workers.append(worker)
                self._processes.append(process)  # the finalizer holds this same list
                self._inboxes.append(inbox)
        writer.close()  # the child holds the only write end: its death ends the pipe
        threading.Thread(
            target=read_messages, args=(reader, worker, self._messages), name=f"{process.name}-results", daemon=True
        ).start()
        if version is not None:
            messages = self.weights.catch_up(version)
            for message in messages:
                inbox.put(message)
            worker.owed_syncs += [version] * (len(messages) - 1)  # each but the Attach is answered by a Synced
        return worker
