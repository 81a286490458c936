"""SharedRolloutPool: a pool whose engines every rank of a multi-process trainer reaches, such as SGLang servers.

An embedded pool lives inside one process, so each rank of a data-parallel trainer starts its own. A pool of
servers is one service for the whole trainer: one set of servers, launched once, loaded once per iteration.
Each rank still holds a pool object of its own (it sends its own share of the iteration's requests), in one
of two roles:

- **the rank that started it** (rank 0): ``start`` launches or attaches the servers, ``address`` says where
  they are, ``sync_weights`` pushes each iteration's weights, ``close`` stops what it launched;
- **a rank that joined it**: ``join(spec, address)`` attaches to the same servers without launching
  anything; it never pushes weights (``sync_weights`` is refused) and never stops a server. Once the servers
  confirmed the weights rank 0 pushed, ``adopt_version`` follows the servers rank 0 pushed to (its ``address``
  after the push: servers may join and leave at a push) and checks that each reports that version, then takes
  it as this rank's confirmed version: the version gate then opens on the same weights on every rank.

The collectives that carry the address and the outcome of each push between ranks are the trainer's
(``lit_parl.data.pool_start`` at setup, ``lit_parl.callbacks.WeightSync`` at each iteration): a pool object
never talks to another rank.

Example, an in-memory pool standing for the servers (two ranks' pool objects in one process)::

    >>> SERVERS = {"version": None}
    >>> class Servers(SharedRolloutPool):
    ...     backend = "memory"
    ...     def _start(self, spec): pass
    ...     def _join(self, spec, address): assert address == {"at": "memory"}
    ...     def _address(self): return {"at": "memory"}
    ...     def _sync_weights(self, buckets, version): SERVERS["version"] = version
    ...     def _adopt_version(self, version, address): assert SERVERS["version"] == version
    ...     def _generate(self, requests, sampling): return iter(())
    ...     def _worker_counts(self): return (1, 1)
    ...     def _close(self): pass
    >>> spec = PoolSpec(model_dir="unused", eos_id=1, pad_id=0)
    >>> first, second = Servers(), Servers()
    >>> first.start(spec); second.join(spec, first.address())
    >>> first.sync_weights([[("w", torch.zeros(1))]], version=0)
    >>> second.adopt_version(0, first.address())
    >>> first.version, second.version, second.joined
    (0, 0, True)
    >>> second.sync_weights([[("w", torch.zeros(1))]], version=1)
    Traceback (most recent call last):
    ...
    RuntimeError: this Servers joined a pool another rank started: that rank pushes the weights (...)
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, final

import torch  # noqa: F401 - the example's tensors

from lit_parl.rollout.pool_records import PoolSpec
from lit_parl.rollout.rollout_pool import RolloutPool


class SharedRolloutPool(RolloutPool):
    """A ``RolloutPool`` every rank reaches: one rank starts it and pushes the weights, the others join it.

    Subclasses implement ``_address``, ``_join`` and ``_adopt_version`` besides the five methods of every
    pool; ``_start``, ``_sync_weights`` and ``_close`` are the starting rank's. ``joined`` tells the roles apart.
    """

    shared_across_ranks: ClassVar[bool] = True

    # -- what a backend implements ---------------------------------------------------------------------
    @abstractmethod
    def _address(self) -> dict:
        """Where the started pool's engines are, as plain data another process can receive (URLs, ports)."""

    @abstractmethod
    def _join(self, spec: PoolSpec, address: dict) -> None:
        """Attach to the engines at ``address`` without starting or owning any; return once they answer."""

    @abstractmethod
    def _adopt_version(self, version: int, address: dict | None) -> None:
        """Drive the engines at ``address`` (``None``: those driven now), then return once every live one reports
        ``version`` (pushed by another rank); raise otherwise."""

    # -- what one rank learns of the engines, for the rank that pushes --------------------------------
    def failed_engines(self) -> list[str]:
        """The engines this rank's own requests saw fail (``lit_parl.callbacks.shared_push`` gathers every rank's
        before each push, so that rank 0 drops them); a backend that tells none returns ``[]``."""
        return []

    def mark_failed(self, engines: list[str]) -> None:
        """Take ``engines``, which some rank saw fail, as failed here too: the next push drops them (a backend that
        tells none ignores them)."""

    # -- what the trainer calls ------------------------------------------------------------------------
    @final
    def address(self) -> dict:
        """What the other ranks pass to ``join``; only the rank that started the pool has it."""
        self._require_started("address")
        if self.joined:
            raise RuntimeError(f"this {type(self).__name__} joined a pool: ask the rank that started it")
        return self._address()

    @final
    def join(self, spec: PoolSpec, address: dict) -> None:
        """Start as a view of a pool another rank started (``address``): generate on its engines, own none."""
        if self._started:
            raise RuntimeError(f"{type(self).__name__}.join called on a started pool (close it first)")
        self._closed, self._version, self._started, self.joined = False, None, True, True
        try:
            self._join(spec, address)
        except BaseException:
            self.close()
            raise

    @final
    def adopt_version(self, version: int, address: dict | None = None) -> None:
        """Hold ``version``, which the starting rank pushed and the engines at its ``address`` (``None``: the same
        as before) confirmed, as this rank's version."""
        self._require_started("adopt_version")
        if not self.joined:
            raise RuntimeError(f"this {type(self).__name__} pushed the weights itself: it holds their version")
        self._version = None
        self._adopt_version(version, address)
        self._version = version
