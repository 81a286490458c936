"""The policy's copy in shared memory, which every spawned worker loads its weights from.

The first sync allocates one shared tensor per name; every later sync copies into the same tensors, so
a worker whose parameters became those tensors (``HFEngine``) needs no copy of its own. A later sync must
bring the same names and shapes.

Example::

    >>> weights = SharedWeights()
    >>> weights.write([[("w", torch.ones(2))]], version=0)
    True
    >>> weights.write([[("w", torch.zeros(2))]], version=1), weights.version, weights.tensors["w"].is_shared()
    (False, 1, True)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from lit_parl.rollout.worker_messages import Attach, LoadAdapter, Sync


class SharedWeights:
    """Shared-memory tensors by name, and the version they hold (``None`` before one was written whole).

    A replacement worker attaches ``tensors`` and loads ``version``, then the LoRA adapter held beside them, if any
    (``catch_up``): what the other workers hold.
    """

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        self.adapter: LoadAdapter | None = None  # the adapter the workers hold beside the base, since the last write

    def hold_adapter(self, message: LoadAdapter) -> None:
        """The workers are given ``message``'s adapter beside the base these tensors hold: its version is theirs."""
        self.adapter, self.version = message, message.version

    def catch_up(self, version: int) -> list:
        """The messages that bring a new worker to ``version``: attach, load, and the adapter held, if any."""
        adapter = [self.adapter] if self.adapter is not None else []
        return [Attach(self.tensors), Sync(version), *adapter]

    def write(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], version: int) -> bool:
        """Copy every bucket in as it arrives (the caller may free it right after); True on the first write.

        Raises on a name given twice, and on names or shapes other than the first write's.
        """
        first = self.tensors is None
        shared = {} if first else self.tensors
        self.version, self.adapter = None, None  # half-written until the last bucket is in; no adapter on it yet
        seen: set[str] = set()
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    if name in seen:
                        raise ValueError(f"sync_weights got tensor {name!r} twice in one sync")
                    seen.add(name)
                    tensor = tensor.detach()
                    if first:
                        shared[name] = tensor.to("cpu", copy=True).share_memory_()
                    elif name not in shared:
                        raise ValueError(f"sync_weights got tensor {name!r}, which the first sync did not have")
                    elif shared[name].shape != tensor.shape:
                        raise ValueError(
                            f"sync_weights got {name!r} of shape {tuple(tensor.shape)}, "
                            f"not {tuple(shared[name].shape)} as before"
                        )
                    else:
                        shared[name].copy_(tensor)
        missing = set(shared) - seen
        if missing:
            raise ValueError(f"sync_weights lacks {len(missing)} tensor(s) the first sync had: {sorted(missing)[:5]}")
        self.tensors = shared  # kept only once complete: a failed first write allocates afresh next time
        self.version = version
        return first
