"""Each rank's share of an iteration (``RankShare``) and the datamodule taking its share by the global rank.

The multi-process fits (tests/system/test_strategies.py, slow) run W ranks on one machine, where a rank's local and
global numbers agree; here a trainer of two nodes with one device each (local rank 0 on both) shows that the
share follows the global rank, and the slot arithmetic is checked by its properties over many shapes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch.accelerators import CPUAccelerator

from helpers.components import make_components
from helpers.pools import InProcessPool
from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.rank_share import RankShare

SHAPES = [  # (prompts, group_size, micro_batch_size, mini_batches, world)
    (8, 4, 4, 2, 2),
    (16, 2, 2, 4, 2),
    (24, 2, 4, 2, 3),
    (32, 8, 16, 2, 4),
    (12, 2, 2, 3, 4),
    (64, 4, 8, 1, 8),
    (6, 2, 2, 1, 3),
]


@pytest.mark.parametrize("prompts, group_size, micro_batch_size, mini_batches, world", SHAPES)
def test_every_slot_is_trained_by_one_rank_in_its_own_step(prompts, group_size, micro_batch_size, mini_batches, world):
    """The ranks' slots partition the iteration; each rank's k-th optimizer step trains a contiguous part of the
    iteration's k-th block of slots, rank r's part after rank r-1's, so every step is the single-device mini-batch."""
    shape = IterationShape(prompts, group_size, micro_batch_size, mini_batches)
    shares = [RankShare(shape, world, rank) for rank in range(world)]
    slots = [share.slots for share in shares]
    assert sorted(slot for rank in slots for slot in rank) == list(range(prompts))
    block = prompts // mini_batches
    part = block // world
    for rank, mine in enumerate(slots):
        assert len(mine) == shares[rank].local.prompts == prompts // world and mine == sorted(mine)
        for step in range(mini_batches):
            taken = mine[step * part : (step + 1) * part]  # the local slots of this rank's step-th mini-batch
            assert all(slot // block == step for slot in taken), (rank, step, taken)
            assert taken == list(range(taken[0], taken[0] + part)), (
                f"rank {rank}'s part of block {step} is not contiguous"
            )
            assert taken[0] == step * block + rank * part, f"rank {rank}'s part of block {step} is out of rank order"


def test_an_uneven_split_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"3 ranks cannot split the iteration evenly.*multiple of 6"):
        RankShare(IterationShape(8, 4, 4, 2), world=3, rank=0)


def test_a_rank_trains_the_share_of_its_global_rank():
    """Two nodes with one device each: both ranks have local rank 0. The rank of global rank 1 must request and
    train global rank 1's slots; with the local rank it would train rank 0's, and half of every iteration never."""
    pool = InProcessPool()
    module, data = make_components(pool=pool, prompts=8, group_size=4, micro_batch_size=4, mini_batches=2)
    data.trainer = SimpleNamespace(
        world_size=2,
        global_rank=1,
        local_rank=0,
        node_rank=1,
        accelerator=CPUAccelerator(),
        precision="32-true",
        loggers=[],
    )
    data.setup("fit")
    try:
        pool.sync_weights([list(module.policy.named_parameters())], version=0)
        data.open_iteration(0)
        trained = sorted({prompt_id for batch in data.train_dataloader() for prompt_id in batch.prompt_ids})
    finally:
        data.teardown("fit")
    assert data.share.rank == 1
    assert trained == RankShare(data.shape, world=2, rank=1).slots == [2, 3, 6, 7]


def test_under_two_ranks_a_shared_pool_is_joined_at_rank_0s_address_not_started_again():
    """Rank 1's datamodule with a pool every rank reaches (SGLang servers) joins the pool rank 0 started, at the
    address rank 0 broadcast; it never starts one of its own (the servers would be launched twice)."""

    class Servers(InProcessPool):
        shared_across_ranks = True

        def join(self, spec, address):
            self.joined_at = address

    pool = Servers()
    module, data = make_components(pool=pool, prompts=8, group_size=4, micro_batch_size=4, mini_batches=2)
    said = {"urls": ["http://rank0:30000"], "router": None}
    collectives = SimpleNamespace(broadcast=lambda obj, src=0: said, reduce_boolean_decision=lambda d, all=True: d)
    data.trainer = SimpleNamespace(
        world_size=2,
        global_rank=1,
        local_rank=1,
        node_rank=0,
        accelerator=CPUAccelerator(),
        precision="32-true",
        loggers=[],
        strategy=collectives,
    )
    data.setup("fit")
    try:
        assert getattr(pool, "joined_at", None) == said and not pool.health().started
    finally:
        data.teardown("fit")
