"""``check_run``: the settings that would otherwise fail late (inside ``trainer.fit``, once per rank) or do
nothing without a word, refused by the CLI once it has built the run's objects and before any process starts.

- ``iterations`` below 1 trains nothing;
- the optimizer's settings (``optimizer.lr=-1e-3``) are checked by building it on a stand-in parameter: torch
  refuses them only in ``configure_optimizers``, after the pool has started;
- the ranks must split every optimizer step's prompts into equal parts of whole micro-batches: checked once
  here, before Lightning starts the other ranks (each would refuse, the same message once per rank), with
  each set of values that does split.

Example::

    >>> from lit_parl.data.iteration_shape import IterationShape
    >>> shape = IterationShape(prompts=32, group_size=8, micro_batch_size=64)
    >>> rank_split_fixes(shape, world=3)
    ['shape.prompts=48', 'shape.prompts=33 shape.micro_batch_size=44', 'trainer.devices=2']
"""

from __future__ import annotations

import dataclasses

import torch

from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.rank_share import RankShare


def _splits(shape: IterationShape, world: int) -> bool:
    try:
        RankShare(shape, world)
    except ValueError:
        return False
    return True


def _valid(shape: IterationShape, **changes) -> IterationShape | None:
    try:
        return dataclasses.replace(shape, **changes)
    except ValueError:
        return None


def rank_split_fixes(shape: IterationShape, world: int, nodes: int = 1) -> list[str]:
    """Overrides that each make ``world`` ranks split ``shape``: the next ``shape.prompts`` that does with the same
    micro-batches; the next one that ``world`` x ``mini_batches`` divides, with the largest micro-batch that then
    fits; the largest smaller number of devices (``nodes`` nodes) that does."""
    fixes = []
    step = world * shape.mini_batches
    for prompts in range(shape.prompts + 1, shape.prompts * 4 + step + 1):
        candidate = _valid(shape, prompts=prompts)
        if candidate is not None and _splits(candidate, world):
            fixes.append(f"shape.prompts={prompts}")
            break
    prompts = -(-shape.prompts // step) * step
    per_rank = prompts // step * shape.group_size
    for micro in range(min(shape.micro_batch_size, per_rank), 0, -1):
        candidate = _valid(shape, prompts=prompts, micro_batch_size=micro)
        if per_rank % micro == 0 and candidate is not None and _splits(candidate, world):
            fix = " ".join(
                part
                for part in (
                    f"shape.prompts={prompts}" if prompts != shape.prompts else "",
                    f"shape.micro_batch_size={micro}",
                )
                if part
            )
            if fix not in fixes:
                fixes.append(fix)
            break
    for devices in range(world // nodes - 1, 0, -1):
        if _splits(shape, devices * nodes):
            fixes.append(f"trainer.devices={devices}")
            break
    return fixes


def check_run(iterations: int, shape: IterationShape, optimizer_factory, world: int, nodes: int = 1) -> None:
    """Refuse, naming the fix, what ``iterations``, the optimizer's settings or ``world`` ranks cannot run."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} trains nothing: set iterations to 1 or more")
    try:
        optimizer_factory([torch.nn.Parameter(torch.zeros(1))])
    except (ValueError, TypeError) as error:
        raise ValueError(f"config optimizer: {error}") from None
    if world > 1 and not _splits(shape, world):
        per_step = shape.prompts_per_step
        raise ValueError(
            f"{world} ranks cannot split the iteration: each optimizer step's {per_step} prompts x group_size "
            f"{shape.group_size} must divide into {world} equal parts of whole micro-batches of "
            f"{shape.micro_batch_size} completions (micro_batch_size is per rank); set "
            + ", or ".join(rank_split_fixes(shape, world, nodes))
        )
