"""RankShare: which of an iteration's prompt slots one rank trains, under a strategy with W ranks.

The iteration's shape is global: ``shape.prompts`` prompts per iteration across all ranks, as on one
device, so the same settings train the same algorithm on any number of devices. Each mini-batch's block
of N / M slots is cut into W equal, contiguous parts, and rank r trains part r of every block. The split
is by slot, fixed before any request is sent, so what a rank trains never depends on arrival order, and
each optimizer step sees every rank's part of the same block: the single-device mini-batch, exactly.

``micro_batch_size`` counts completions per ``training_step`` on one rank (Lightning's per-device batch).

Example (8 prompts, 2 mini-batches, 2 ranks: each block of 4 slots is split in halves)::

    >>> from lit_parl.data.iteration_shape import IterationShape
    >>> shape = IterationShape(prompts=8, group_size=4, micro_batch_size=4, mini_batches=2)
    >>> [RankShare(shape, world=2, rank=r).slots for r in (0, 1)]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    >>> RankShare(shape, world=2, rank=1).local.prompts, RankShare(shape, world=2, rank=1).local.micro_batches
    (4, 4)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lit_parl.data.iteration_shape import IterationShape


@dataclass(frozen=True)
class RankShare:
    """Rank ``rank``'s fixed share of each iteration among ``world`` ranks.

    Args:
        shape: the iteration's global shape.
        world: the number of ranks that train (Lightning's ``trainer.world_size``).
        rank: this rank (``trainer.global_rank``).

    Raises:
        ValueError: when the mini-batches' blocks do not split into ``world`` equal parts of whole micro-batches.
    """

    shape: IterationShape
    world: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"RankShare(rank={self.rank}, world={self.world}): the rank must be in [0, world)")
        shape, W = self.shape, self.world
        per_block = shape.prompts_per_step
        if per_block % W or (per_block // W * shape.group_size) % shape.micro_batch_size:
            raise ValueError(
                f"{W} ranks cannot split the iteration evenly: each optimizer step's {per_block} prompts "
                f"(shape.prompts={shape.prompts} / mini_batches={shape.mini_batches}) must divide into {W} equal parts "
                f"of whole micro-batches of {shape.micro_batch_size} completions (group_size={shape.group_size}; "
                "micro_batch_size is per rank). "
                f"Make shape.prompts a multiple of {W * shape.mini_batches}, or lower micro_batch_size."
            )

    @property
    def local(self) -> IterationShape:
        """This rank's shape: N / W prompts, the same mini-batches, passes and micro-batch size."""
        return dataclasses.replace(self.shape, prompts=self.shape.prompts // self.world)

    @property
    def slots(self) -> list[int]:
        """The global slots this rank trains, in local order (local slot i is ``slots[i]``)."""
        return [self.global_slot(i) for i in range(self.local.prompts)]

    def global_slot(self, local_slot: int) -> int:
        part = self.shape.prompts_per_step // self.world
        block, offset = divmod(local_slot, part)
        return block * self.shape.prompts_per_step + self.rank * part + offset


class SlotExchange:
    """Every rank's open slots in each round of dynamic sampling's refills, numbered over all ranks as on one device.

    The ranks exchange them on a gloo group of the data path's own, from the prefetch thread, so a rank that
    waits for the others' round never blocks its training step's gradient reduction (which the others may be
    waiting on). With one rank, or without dynamic sampling, nothing is exchanged.

    Args:
        world: the number of ranks; above 1 the group is made now (a collective: every rank makes it).
    """

    def __init__(self, world: int = 1) -> None:
        self.world = world
        self.group = torch.distributed.new_group(backend="gloo") if world > 1 else None

    def everywhere(self, mine: list[int]) -> list[int]:
        """Every rank's ``mine``, merged and sorted."""
        if self.group is None:
            return sorted(mine)
        gathered: list[list[int] | None] = [None] * self.world
        torch.distributed.all_gather_object(gathered, mine, group=self.group)
        return sorted(slot for slots in gathered for slot in slots)
