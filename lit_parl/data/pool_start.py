"""``start_pool``: the datamodule's pool started for this rank: its own, or one pool for every rank.

An embedded pool is one per rank: each rank starts its own. A pool shared across ranks
(``lit_parl.rollout.shared_pool``: SGLang servers) must be launched once, not once per rank: rank 0 starts it,
and one broadcast over the trainer's ranks carries its address (or why it failed) to the others, which join
it. A second collective tells every rank whether every rank joined, so a rank that could not reach the
servers stops the run on every rank instead of leaving the others in the trainer's first collective.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy

from lit_parl.data.rank_share import RankShare
from lit_parl.errors import PoolStartError
from lit_parl.rollout.pool_records import PoolSpec
from lit_parl.rollout.rollout_pool import RolloutPool


def start_pool(pool: RolloutPool, spec: PoolSpec, trainer: Trainer | None, share: RankShare) -> None:
    """Start this rank's ``pool``; a shared one on rank 0, joined by the others (the trainer's collectives)."""
    if share.world == 1 or not pool.shared_across_ranks:
        pool.start(spec)
    else:
        _start_shared(pool, spec, trainer.strategy, share.rank)


def _start_shared(pool, spec: PoolSpec, strategy: Strategy, rank: int) -> None:
    """Start ``pool`` on rank 0 and join it from every other rank; raise on every rank if any rank failed."""
    failure: BaseException | None = None
    address = None
    if rank == 0:
        try:
            pool.start(spec)
            address = pool.address()
        except BaseException as error:  # noqa: BLE001 - said to the other ranks first, then raised
            failure = error
    said = strategy.broadcast(address if failure is None else f"{type(failure).__name__}: {failure}", src=0)
    if failure is not None:
        raise failure
    if isinstance(said, str):
        # rank 0 prints its own error (the cause); this rank's line only says why it stops too
        raise PoolStartError(f"rank {rank} stops: rank 0 could not start the shared {pool.backend} pool: {said}")
    if rank != 0:
        try:
            pool.join(spec, said)
        except BaseException as error:  # noqa: BLE001 - counted below, then raised
            failure = error
    if not strategy.reduce_boolean_decision(failure is None, all=True):
        if failure is not None:
            raise failure
        raise PoolStartError(
            f"another rank could not join the shared {pool.backend} pool at {said} (its error says why)"
        )
