"""full_tensors: a module's parameters as full tensors, one at a time, whatever shards them.

Under DDP (or one device) a parameter is already whole. Under FSDP2 (``fully_shard``; Lightning's
``ModelParallelStrategy``) each rank holds a shard of every parameter, a ``DTensor``: ``full_tensor()``
gathers it. Each gather is a collective, so every rank reads the same parameters in the same order, which
``full_tensors`` guarantees by walking ``named_parameters`` on every rank alike. A tensor is gathered only
when the consumer asks for it, so a consumer that copies each one (a weight push, an export) holds one
whole parameter at a time beside the shards, never a second copy of the model.

Example::

    >>> import torch
    >>> [(name, tuple(t.shape)) for name, t in full_tensors(torch.nn.Linear(3, 2))]
    [('weight', (2, 3)), ('bias', (2,))]
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether a rank holds only a piece of some parameter of ``module`` (so reading it whole takes a gather)."""
    return any(hasattr(p, "full_tensor") for p in module.parameters())


def full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full detached tensor)`` for every parameter of ``module``, in ``named_parameters`` order."""
    for name, parameter in module.named_parameters():
        tensor = parameter.detach()  # the receiver copies values: it must not hold the autograd graph's leaves
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
