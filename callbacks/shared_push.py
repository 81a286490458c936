"""SharedPush: one weight push for every rank, to a receiver all the ranks reach (a pool of servers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy

from .contracts import SharedWeightReceiver, WeightBucket


class SharedPush:
    r"""Push each version once, from rank 0, while every rank reads the weights; every rank then holds it.

    First, what each rank learned of the receiver's engines since the last push (those its own requests saw fail,
    ``failed_engines()``) reaches rank 0 in one gather, and rank 0's receiver drops them in this push
    (``mark_failed(urls)``): a server only rank 1 saw die is not pushed to, and no rank drives it afterwards.
    Every rank iterates the buckets, since reading a sharded policy is a collective (FSDP2's ``full_tensor``,
    FSDP1's unit by unit, ZeRO-3's gathered parameters): rank 0 hands them to the receiver, the other ranks
    drop each bucket once read, so the extra memory stays one bucket. Whatever rank 0's receiver left unread
    (it failed half-way) is read too, so no rank is left inside a gather. Then one broadcast carries rank 0's
    outcome: on success the receiver's ``address()`` (the servers it pushed to, which may change at a push),
    else why it failed; each other rank, on success, takes the version from the receiver
    (``adopt_version(version, address)``: its view follows those servers and checks that they report it). One
    reduction tells every rank whether every rank holds it, and a failure anywhere raises on every rank: none
    is left waiting in the trainer's next collective.

    Args:
        strategy: the trainer's strategy: its ``broadcast`` and ``reduce_boolean_decision`` are the collectives.
        rank: this process's global rank (``trainer.global_rank``; ``from_trainer`` reads it): rank 0 of the whole
            trainer pushes, not the first rank of each node.
        gather: every rank's object, in rank order, on every rank (``None``: ``all_gather_objects``, over the
            trainer's process group).

    Example (one process, whose strategy's collectives return what they are given)::

        >>> from lightning.pytorch.strategies import SingleDeviceStrategy
        >>> class Servers:
        ...     shared_across_ranks = True
        ...     def sync_weights(self, buckets, version): self.names = [n for b in buckets for n, _ in b]
        ...     def address(self): return {"urls": ["http://infer1:30000"]}
        ...     def adopt_version(self, version, address): pass
        >>> servers = Servers()
        >>> SharedPush(SingleDeviceStrategy("cpu"), rank=0).push(servers, iter([[("w", None)], [("b", None)]]), 0)
        >>> servers.names
        ['w', 'b']
    """

    def __init__(self, strategy: Strategy, rank: int, gather: Callable[[object], list] | None = None) -> None:
        self.strategy = strategy
        self.rank = rank
        self.gather = gather or all_gather_objects

    @classmethod
    def from_trainer(cls, trainer: Trainer) -> SharedPush:
        """The shared push of ``trainer``'s process: its strategy's collectives, its rank in the whole trainer."""
        return cls(trainer.strategy, trainer.global_rank)

    def push(self, receiver: SharedWeightReceiver, buckets: Iterator[WeightBucket], version: int, load=None) -> None:
        """Load ``version`` on the receiver from rank 0 (``load(buckets, version)``; ``None``: its
        ``sync_weights``); return on every rank once every rank holds it."""
        self._share_failures(receiver)
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                (load or receiver.sync_weights)(buckets, version)
            except BaseException as error:  # noqa: BLE001 - said to the other ranks first, then raised
                failure = error
        for _ in buckets:  # the rest of the reads (all of them off rank 0): each may be a collective
            pass
        outcome = None
        if self.rank == 0:
            outcome = receiver.address() if failure is None else f"{type(failure).__name__}: {failure}"
        said = self.strategy.broadcast(outcome, src=0)  # the address, or why the push failed
        failed_at_0 = isinstance(said, str)
        if not failed_at_0 and self.rank != 0:
            try:
                receiver.adopt_version(version, said)
            except BaseException as error:  # noqa: BLE001 - counted below, then raised
                failure = error
        everyone = self.strategy.reduce_boolean_decision(failure is None and not failed_at_0, all=True)
        if failure is not None:
            raise failure
        if failed_at_0:
            raise RuntimeError(f"rank 0 could not push version {version} to the shared pool: {said}")
        if not everyone:
            raise RuntimeError(
                f"another rank could not take version {version} from the shared pool (that rank's error says why)"
            )

    def _share_failures(self, receiver: SharedWeightReceiver) -> None:
        """The engines any rank saw fail reach rank 0's receiver, which drops them before it pushes."""
        failed = getattr(receiver, "failed_engines", None)  # a receiver without engines of its own to lose
        heard = self.gather(list(failed()) if failed is not None else [])  # every rank takes part in the collective
        if self.rank == 0 and failed is not None:
            receiver.mark_failed(sorted({url for urls in heard for url in urls}))


def all_gather_objects(obj: object) -> list:
    """``obj`` of every rank, in rank order (one collective over the default process group; alone: ``[obj]``)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [obj]
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, obj)
    return gathered
