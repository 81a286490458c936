"""A rollout worker's side: its whole life in one loop, ``serve``, around the engine of its backend.

The messages and the restarts are described in ``lit_parl.rollout.spawned_worker_pool`` (the trainer's side). Here
run only the worker process's parts: build the engine, hold the shared tensors and the version, answer
the inbox on the worker's own results pipe, and refuse requests for any version it does not hold.
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from lit_parl.rollout.processes import Outbox, die_with_parent
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


class WorkerEngine(Protocol):
    """A backend's engine inside one worker process, built there by the factory the pool hands to ``serve``."""

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        """Load the weights in ``shared`` (Hugging Face names, shared memory); return once they are in use."""

    def sample(self, requests: list[GroupRequest], sampling: SamplingParams, version: int) -> Iterator[GroupCompletions]:
        """Yield each request's completions, stamped ``version``, as soon as its samples are finished."""


def serve(worker_id: int, make_engine: Callable[[], WorkerEngine], inbox, results, parent_pid: int, env: dict[str, str] | None = None) -> None:
    """A worker's whole life: build the engine, then answer the inbox until told to stop or orphaned.

    ``results`` is the write end of this worker's own pipe. ``env`` is set in this process first, before
    the engine is built (a backend's per-worker settings, e.g. ``CUDA_VISIBLE_DEVICES``). The loop holds
    the shared tensors and the version, and refuses requests for any version other than the one it holds,
    whatever the pool checked before: a worker never generates with weights it was not asked for.
    """
    os.environ.update(env or {})
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    outbox = Outbox(results)
    try:
        engine = make_engine()
        shared: dict[str, torch.Tensor] = {}
        version = None
        outbox.put(("ready", worker_id, os.getpid()))
        for message in inbox_messages(inbox, parent_pid):
            kind = message[0]
            if kind == "attach":
                shared = message[1]
            elif kind == "sync":
                version = None  # nothing is generated with half-loaded weights
                engine.load(shared, message[1])
                version = message[1]
                outbox.put(("synced", worker_id, version))
            elif kind == "generate":
                call, piece, requests, sampling = message[1:]
                stale = sorted({r.version for r in requests if r.version != version})
                if stale:
                    raise RuntimeError(f"worker {worker_id} holds policy version {version} but got requests for {stale}")
                start = time.monotonic()
                for group in engine.sample(requests, sampling, version):
                    if group.version != version:
                        raise RuntimeError(f"worker {worker_id}'s engine stamped version {group.version} while holding {version}")
                    outbox.put(("group", worker_id, call, group))
                outbox.put(("done", worker_id, call, piece, start, time.monotonic()))
            else:
                raise RuntimeError(f"worker {worker_id} got unknown message {kind!r}")
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        outbox.put(("error", worker_id, traceback.format_exc()))
    finally:
        outbox.close()  # sends what is queued; then the pipe ends with this process


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
