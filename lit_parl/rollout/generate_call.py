"""One ``generate`` call of a spawned-worker pool: its pieces of work out, their groups back, lost pieces again.

Every piece goes out at once (a worker must not wait for the trainer to ask for the next group: the
trainer trains between two groups while the workers keep generating). A piece is done once its worker
said so (``PieceDone``, after its groups: one pipe keeps them in order), or once every group of it was
delivered. A worker that dies or hangs is replaced (``WorkerProcesses.replace``), and every piece of it
with a group the trainer has not received is sent to the new process again: the same requests, seeds and
batch, so the same samples. Groups of such a piece delivered before the death are dropped when they
come again. A prompt still missing at the end is the base class's error to raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.worker_messages import Exited, Generate, GroupDone, PieceDone
from lit_parl.rollout.worker_processes import Worker, WorkerProcesses

_DOING = "generating"


@dataclass(eq=False)
class Piece:
    """One ``Generate`` message of a call: what a worker was given, and whether it is finished."""

    index: int
    worker: int
    requests: list[GroupRequest]
    done: bool = False
    reissued: bool = False


class GenerateCall:
    """One ``generate`` call over the pool's workers: ``groups()`` hands its work out and yields its groups.

    Args:
        processes: the pool's workers.
        call: the call's number; messages of any other call are left-overs, dropped.
        version: the policy version the call's requests are for (a replacement loads it).
        assigned: ``(worker index, requests)`` pieces of work, as ``SpawnedWorkerPool._assign`` made them.
        sampling: how every sample is drawn.
    """

    def __init__(
        self,
        processes: WorkerProcesses,
        call: int,
        version: int,
        assigned: list[tuple[int, list[GroupRequest]]],
        sampling: SamplingParams,
    ) -> None:
        self.processes, self.call, self.version, self.sampling = processes, call, version, sampling
        self.pieces = [Piece(index, worker, requests) for index, (worker, requests) in enumerate(assigned)]
        self.busy: list[tuple[float, float]] = []  # (start, end) of each piece done, as its worker timed it
        self._piece_of = {r.prompt_id: p for p in self.pieces for r in p.requests}
        self._undelivered = set(self._piece_of)  # prompts not yet yielded to the trainer
        self._restarts = 0

    def groups(self) -> Iterator[GroupCompletions]:
        """Send every piece out, then yield each group as it arrives (in completion order); call once."""
        processes = self.processes
        processes.count_silence_from_now()
        for piece in self.pieces:
            self._send(piece)
        while not all(p.done for p in self.pieces) or not all(w.settled for w in processes.workers):
            event = processes.next_event(_DOING, self._owes)
            if event is None:
                continue
            worker, message = event
            if isinstance(message, GroupDone):
                if message.call == self.call and self._fresh(message.group):
                    yield message.group
            elif isinstance(message, PieceDone):
                if message.call == self.call:  # else left over from a call whose consumer stopped early
                    self.pieces[message.piece].done = True
                    self.busy.append((message.start, message.end))
            elif isinstance(message, Exited):
                self._reissue(worker)
            else:
                processes.confirm(worker, message, _DOING)

    def _fresh(self, group: GroupCompletions) -> bool:
        """Whether ``group`` is to be delivered: not one of a re-issued piece that was delivered before."""
        piece = self._piece_of.get(group.prompt_id)
        if piece is not None and piece.reissued and group.prompt_id not in self._undelivered:
            return False
        self._undelivered.discard(group.prompt_id)
        return True

    def _reissue(self, worker: Worker) -> None:
        """Replace the gone ``worker`` and send the new one its pieces that still owe the trainer a group."""
        lost = [p for p in self.pieces if p.worker == worker.index and not p.done]
        reissued = [p for p in lost if any(r.prompt_id in self._undelivered for r in p.requests)]
        for piece in lost:
            piece.done = piece not in reissued  # every group delivered: nothing is owed any more
        delivered = sum(r.prompt_id not in self._undelivered for p in reissued for r in p.requests)
        self._restarts = self.processes.replace(
            worker, self._restarts, _DOING, self.version, [p.requests for p in reissued], delivered
        )
        for piece in reissued:
            piece.reissued = True
            self._send(piece)

    def _owes(self, worker: Worker) -> bool:
        return not worker.settled or any(p.worker == worker.index and not p.done for p in self.pieces)

    def _send(self, piece: Piece) -> None:
        message = Generate(self.call, piece.index, piece.requests, self.sampling)
        self.processes.send(self.processes.workers[piece.worker], message, _DOING)
