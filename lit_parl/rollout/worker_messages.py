"""The messages between a spawned-worker pool and its worker processes: one frozen dataclass per kind.

Each worker reads an inbox, a ``multiprocessing`` queue only the pool writes, and answers on a results
pipe of its own (``lit_parl.rollout.processes``). Both ends match a message by its type, never by
position. Every message is pickled on its way, so each holds only what its receiver reads: one group
per ``GroupDone``, the default job's most frequent message.

To a worker, from the pool (``WorkerProcesses``; ``Generate`` from ``GenerateCall``, ``Stop`` from
``processes.stop_workers``):

- ``Attach(shared)``: the policy's tensors in shared memory, once per worker, before its first ``Sync``.
- ``Sync(version)``: load the shared tensors, which now hold ``version``; answered by ``Synced``.
- ``LoadAdapter(version, tensors, config)``: load a LoRA adapter (peft's names and config) beside the base the
  shared tensors hold, as ``version`` (an engine that serves adapters: vLLM's); answered by ``Synced``.
- ``Generate(call, piece, requests, sampling)``: sample ``requests``; answered by one ``GroupDone`` per
  request, as each is finished, then ``PieceDone``.
- ``Stop()``: leave the loop and exit (the pool is closing).

To the pool, from a worker (``lit_parl.rollout.worker_loop.serve``):

- ``Ready()``: the engine is built, once, first.
- ``Synced(version)``: ``version`` is loaded and in use.
- ``GroupDone(call, group)``: one request's completions.
- ``PieceDone(call, piece, start, end)``: every group of the piece was sent; the engine worked on it
  from ``start`` to ``end`` (``time.monotonic``).
- ``WorkerError(traceback)``: the worker failed and exits: a bug, raised in the trainer as it is. Its
  ``Outbox`` sends one too for a message it could not pickle.

Made up on the trainer's side, never sent (by ``processes.read_messages``, and by
``WorkerProcesses.next_event`` for a worker whose pipe outlives it):

- ``Unreadable(traceback)``: a complete message that could not be unpickled.
- ``Exited()``: the worker is gone; every complete message it sent came before.

``call`` numbers the pool's ``generate`` calls: what a worker still sends for a call whose consumer
stopped early is dropped, not taken for the next call's. ``piece`` numbers a call's pieces of work.

Example::

    >>> import pickle
    >>> pickle.loads(pickle.dumps(Synced(version=3)))
    Synced(version=3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


# -- to a worker -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Attach:
    shared: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Sync:
    version: int


@dataclass(frozen=True)
class LoadAdapter:
    version: int
    tensors: dict[str, torch.Tensor]
    config: dict


@dataclass(frozen=True)
class Generate:
    call: int
    piece: int
    requests: list[GroupRequest]
    sampling: SamplingParams


@dataclass(frozen=True)
class Stop:
    pass


# -- from a worker ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    pass


@dataclass(frozen=True)
class Synced:
    version: int


@dataclass(frozen=True)
class GroupDone:
    call: int
    group: GroupCompletions


@dataclass(frozen=True)
class PieceDone:
    call: int
    piece: int
    start: float
    end: float


@dataclass(frozen=True)
class WorkerError:
    traceback: str


# -- made up by the trainer's side -----------------------------------------------------------------------
@dataclass(frozen=True)
class Unreadable:
    traceback: str


@dataclass(frozen=True)
class Exited:
    pass


FROM_WORKER = (Ready, Synced, GroupDone, PieceDone, WorkerError, Unreadable, Exited)  # what the pool understands
