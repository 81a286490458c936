"""A rollout worker's side: its whole life in one loop, ``serve``, around the engine of its backend.

The trainer's side is ``lit_parl.rollout.spawned_worker_pool`` (the restarts: ``worker_processes``), the
messages ``lit_parl.rollout.worker_messages``. Here run only the worker process's parts: build the
engine, hold the shared tensors and the version, answer the inbox on the worker's own results pipe, and
refuse requests for any version it does not hold.
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

from lit_parl.rollout.processes import Outbox, die_with_parent, pin_to_cores
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.worker_messages import (
    Attach,
    Generate,
    GroupDone,
    LoadAdapter,
    PieceDone,
    Ready,
    Stop,
    Sync,
    Synced,
    WorkerError,
)


class WorkerEngine(Protocol):
    """A backend's engine inside one worker process, built there by the factory the pool hands to ``serve``."""

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        """Load the weights in ``shared`` (Hugging Face names, shared memory); return once they are in use."""

    def sample(
        self, requests: list[GroupRequest], sampling: SamplingParams, version: int
    ) -> Iterator[GroupCompletions]:
        """Yield each request's completions, stamped ``version``, as soon as its samples are finished."""

    # an engine that serves LoRA adapters (vLLM's) also has
    # load_adapter(tensors: dict[str, torch.Tensor], config: dict, version: int) -> None


def serve(
    worker_id: int,
    make_engine: Callable[[], WorkerEngine],
    inbox,
    results,
    parent_pid: int,
    env: dict[str, str] | None = None,
    cores: tuple[int, ...] | None = None,
) -> None:
    """A worker's whole life: build the engine, then answer the inbox until told to stop or orphaned.

    ``results`` is the write end of this worker's own pipe. ``env`` is set in this process first, before
    the engine is built (a backend's per-worker settings, e.g. ``CUDA_VISIBLE_DEVICES``). The loop holds
    the shared tensors and the version, and refuses requests for any version other than the one it holds,
    whatever the pool checked before: a worker never generates with weights it was not asked for. ``cores``: the
    CPU cores this process runs on (``None``: wherever its parent's affinity lets it).
    """
    os.environ.update(env or {})
    if cores is not None:
        pin_to_cores(cores)  # before the engine's threads start
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    outbox = Outbox(results)
    try:
        engine = make_engine()
        shared: dict[str, torch.Tensor] = {}
        version = None
        outbox.put(Ready())
        for message in inbox_messages(inbox, parent_pid):
            if isinstance(message, Attach):
                shared = message.shared
            elif isinstance(message, Sync):
                version = None  # nothing is generated with half-loaded weights
                engine.load(shared, message.version)
                version = message.version
                outbox.put(Synced(version))
            elif isinstance(message, LoadAdapter):
                version = None
                engine.load_adapter(message.tensors, message.config, message.version)
                version = message.version
                outbox.put(Synced(version))
            elif isinstance(message, Generate):
                stale = sorted({r.version for r in message.requests if r.version != version})
                if stale:
                    raise RuntimeError(
                        f"worker {worker_id} holds policy version {version} but got requests for {stale}"
                    )
                start = time.monotonic()
                for group in engine.sample(message.requests, message.sampling, version):
                    if group.version != version:
                        raise RuntimeError(
                            f"worker {worker_id}'s engine stamped version {group.version} while holding {version}"
                        )
                    outbox.put(GroupDone(message.call, group))
                outbox.put(PieceDone(message.call, message.piece, start, time.monotonic()))
            else:
                raise RuntimeError(f"worker {worker_id} got a message of unknown kind: {type(message).__name__}")
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        outbox.put(WorkerError(traceback.format_exc()))
    finally:
        outbox.close()  # sends what is queued; then the pipe ends with this process


def inbox_messages(inbox, parent_pid: int) -> Iterator[Attach | Sync | LoadAdapter | Generate]:
    """A worker's messages, until ``Stop`` or until its parent is gone."""
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if isinstance(message, Stop):
            return
        yield message
