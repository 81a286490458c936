"""SharedPush and start_pool, one rank at a time: what each rank does with what the collectives tell it.

The collectives are a stand-in strategy that answers as the other ranks would (what rank 0 broadcast, whether
every rank agreed); the 2-process runs with real collectives are tests/system/test_shared_pool.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lit_parl.callbacks.shared_push import SharedPush
from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.pool_start import start_pool
from lit_parl.data.rank_share import RankShare
from lit_parl.errors import PoolStartError
from lit_parl.rollout.pool_records import PoolSpec


class Collectives:
    """A strategy's collectives as rank ``rank`` sees them; ``said``: what rank 0 broadcasts to the others;
    ``everyone_agrees``: the other ranks' decision in the reduction (taken as ``all`` asks: every rank, or any)."""

    def __init__(self, rank: int, said=None, everyone_agrees: bool = True) -> None:
        self.rank, self.said, self.everyone_agrees = rank, said, everyone_agrees
        self.broadcast_sent: list = []
        self.decisions: list[bool] = []

    def broadcast(self, obj, src=0):
        self.broadcast_sent.append(obj)
        return obj if self.rank == src else self.said

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.decisions.append(decision)
        return (decision and self.everyone_agrees) if all else (decision or self.everyone_agrees)


class Receiver:
    shared_across_ranks = True

    def __init__(self, fail_after: int | None = None, adopt_fails: bool = False) -> None:
        self.fail_after, self.adopt_fails = fail_after, adopt_fails
        self.taken: list[str] = []
        self.adopted: list[int] = []

    def sync_weights(self, buckets, version):
        for bucket in buckets:
            if self.fail_after is not None and len(self.taken) == self.fail_after:
                raise ConnectionError("server gone")
            self.taken += [name for name, _ in bucket]

    def address(self):
        return {"urls": ["http://infer1:30000"]}

    def adopt_version(self, version, address):
        if self.adopt_fails:
            raise RuntimeError("servers report version 0")
        self.adopted.append((version, address))


def buckets(read: list[str]):
    """Three buckets; each read is recorded, as a sharded policy's gather would be a collective."""
    for name in ("a", "b", "c"):
        read.append(name)
        yield [(name, None)]


def test_rank_0_pushes_and_the_others_adopt_on_the_servers_rank_0_pushed_to():
    receiver, read, collectives = Receiver(), [], Collectives(rank=0)
    SharedPush(collectives, rank=0).push(receiver, buckets(read), 3)
    assert receiver.taken == ["a", "b", "c"] and receiver.adopted == [] and read == ["a", "b", "c"]
    assert collectives.broadcast_sent == [{"urls": ["http://infer1:30000"]}], "rank 0 says where it pushed"
    other, read = Receiver(), []
    address = {"urls": ["http://infer1:30000", "http://infer2:30000"]}
    SharedPush(Collectives(rank=1, said=address), rank=1).push(other, buckets(read), 3)
    assert other.taken == [] and other.adopted == [(3, address)]
    assert read == ["a", "b", "c"], "a rank that does not push must still read every bucket (the gathers)"


def test_a_push_that_fails_half_way_still_reads_every_bucket_and_says_why_to_the_others():
    collectives, read = Collectives(rank=0), []
    with pytest.raises(ConnectionError, match="server gone"):
        SharedPush(collectives, rank=0).push(Receiver(fail_after=1), buckets(read), 3)
    assert read == ["a", "b", "c"], "rank 0 stopped reading: the other ranks would wait in a gather"
    assert collectives.broadcast_sent == ["ConnectionError: server gone"] and collectives.decisions == [False]
    other = Receiver()
    with pytest.raises(RuntimeError, match="rank 0 could not push version 3 to the shared pool: ConnectionError"):
        SharedPush(Collectives(rank=1, said="ConnectionError: server gone"), rank=1).push(other, buckets([]), 3)
    assert other.adopted == [], "a rank must not take a version rank 0 failed to push"


def test_a_rank_that_cannot_adopt_stops_every_rank():
    with pytest.raises(RuntimeError, match="servers report version 0"):
        SharedPush(Collectives(rank=1), rank=1).push(Receiver(adopt_fails=True), buckets([]), 3)
    with pytest.raises(RuntimeError, match="another rank could not take version 3"):
        SharedPush(Collectives(rank=0, everyone_agrees=False), rank=0).push(Receiver(), buckets([]), 3)


def test_the_rank_that_pushes_is_global_rank_0_not_each_nodes_first():
    """The first rank of the second node has local rank 0 and global rank 2: it must not push."""
    pushed = {}
    for global_rank, local_rank in [(0, 0), (1, 1), (2, 0), (3, 1)]:
        trainer = SimpleNamespace(
            strategy=Collectives(rank=global_rank), global_rank=global_rank, local_rank=local_rank
        )
        receiver = Receiver()
        SharedPush.from_trainer(trainer).push(receiver, buckets([]), 3)
        pushed[global_rank] = receiver.taken != []
    assert pushed == {0: True, 1: False, 2: False, 3: False}


class Engines(Receiver):
    """A receiver whose engines a rank may see fail; it records what reached it, and when."""

    def __init__(self, failed: list[str]) -> None:
        super().__init__()
        self.failed, self.events = failed, []

    def failed_engines(self):
        return self.failed

    def mark_failed(self, urls):
        self.events.append(("mark_failed", urls))

    def sync_weights(self, buckets, version):
        self.events.append(("sync_weights", version))
        super().sync_weights(buckets, version)


def test_a_server_only_another_rank_saw_fail_is_dropped_by_rank_0_before_it_pushes():
    gathered = []

    def gather(obj):  # rank 0's and rank 1's, as the collective hands them to every rank
        gathered.append(obj)
        return [obj, ["http://infer2:30000"]]

    receiver = Engines(failed=[])
    SharedPush(Collectives(rank=0), rank=0, gather=gather).push(receiver, buckets([]), 3)
    assert receiver.events == [("mark_failed", ["http://infer2:30000"]), ("sync_weights", 3)]
    other = Engines(failed=["http://infer2:30000"])
    SharedPush(Collectives(rank=1, said={"urls": []}), rank=1, gather=gather).push(other, buckets([]), 3)
    assert gathered == [[], ["http://infer2:30000"]], "each rank must hand what it saw fail to the gather"
    assert other.events == [], "only rank 0 applies what the ranks saw"


class Pool:
    backend = "test"
    shared_across_ranks = True

    def __init__(self, start_fails: bool = False) -> None:
        self.start_fails = start_fails
        self.calls: list = []

    def start(self, spec):
        if self.start_fails:
            raise OSError("port in use")
        self.calls.append("start")

    def address(self):
        return {"urls": ["http://a:1"]}

    def join(self, spec, address):
        self.calls.append(("join", address))


def trainer_of(collectives: Collectives) -> SimpleNamespace:
    """What start_pool reads of a lightning.Trainer: its strategy."""
    return SimpleNamespace(strategy=collectives)


SPEC = PoolSpec(model_dir="unused", eos_id=1, pad_id=0)
SHAPE = IterationShape(prompts=8, group_size=4, micro_batch_size=4)


def test_rank_0_starts_a_shared_pool_and_the_others_join_it_at_its_address():
    first, second = Pool(), Pool()
    collectives = Collectives(rank=0)
    start_pool(first, SPEC, trainer_of(collectives), RankShare(SHAPE, world=2, rank=0))
    assert first.calls == ["start"] and collectives.broadcast_sent == [{"urls": ["http://a:1"]}]
    start_pool(
        second, SPEC, trainer_of(Collectives(rank=1, said={"urls": ["http://a:1"]})), RankShare(SHAPE, world=2, rank=1)
    )
    assert second.calls == [("join", {"urls": ["http://a:1"]})]
    alone = Pool()
    start_pool(alone, SPEC, None, RankShare(SHAPE))  # one rank: started as any pool
    assert alone.calls == ["start"]


def test_a_shared_pool_that_rank_0_cannot_start_stops_every_rank():
    collectives = Collectives(rank=0)
    with pytest.raises(OSError, match="port in use"):
        start_pool(Pool(start_fails=True), SPEC, trainer_of(collectives), RankShare(SHAPE, world=2, rank=0))
    assert collectives.broadcast_sent == ["OSError: port in use"], "the others must hear why, not wait"
    other = Pool()
    # a PoolStartError: the CLI prints it as one line, not a traceback
    with pytest.raises(PoolStartError, match="rank 0 could not start the shared test pool: OSError: port in use"):
        start_pool(
            other, SPEC, trainer_of(Collectives(rank=1, said="OSError: port in use")), RankShare(SHAPE, world=2, rank=1)
        )
    assert other.calls == []
    with pytest.raises(PoolStartError, match="another rank could not join the shared test pool"):
        start_pool(
            Pool(), SPEC, trainer_of(Collectives(rank=0, everyone_agrees=False)), RankShare(SHAPE, world=2, rank=0)
        )
