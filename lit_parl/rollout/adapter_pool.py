"""AdapterPool: a rollout pool whose engines load the policy's LoRA adapters beside the base they hold.

With ``takes_lora_adapters`` true (SGLang's ``pool.sync.lora=adapter``, vLLM's ``pool.lora=adapter``),
``lit_parl.callbacks.WeightSync`` pushes a
LoRA policy's frozen base once per fit (``sync_weights``) and then, each iteration, only its adapter
(``sync_adapter``): the A and B tensors under peft's names, and peft's config of them. The engine serves the
version's adapter under a name of its own (``adapter_name``), and the pool names it in every request of that
iteration, so every rollout of iteration k still comes from θ_k = base + (α / r) B_k A_k.

Example::

    >>> adapter_name(3)
    'lit_parl-v3'
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Iterable
from typing import final

from lit_parl.rollout.rollout_pool import RolloutPool, WeightBucket

ADAPTER_MODES = ("merged", "adapter")  # how a LoRA policy reaches the engines (each pool's ``lora`` setting)


def adapter_name(version: int) -> str:
    """The name version ``version``'s adapter is loaded under: one per version, since an engine refuses (SGLang) or
    keeps serving (vLLM, by id) an adapter loaded under a name it already holds."""
    return f"lit_parl-v{version}"


def check_adapter_rank(config: dict, max_rank: int, setting: str) -> None:
    """Refuse an adapter above the engines' room for ranks before anything is sent (``setting``: where it is set)."""
    rank = config.get("r")
    if not isinstance(rank, int) or rank > max_rank:
        raise ValueError(
            f"the LoRA adapter's rank {rank} is above the engines' max_lora_rank {max_rank}: set {setting}={rank} "
            "(launched engines take it; restart attached ones with it)"
        )


def check_adapter_mode(mode: str, owner: str) -> None:
    if mode not in ADAPTER_MODES:
        raise ValueError(f"{owner}(lora={mode!r}): choose one of {ADAPTER_MODES}")


class AdapterPool(RolloutPool):
    """A ``RolloutPool`` that can take a LoRA policy as base + adapter (``lit_parl.callbacks.AdapterReceiver``)."""

    @property
    @abstractmethod
    def takes_lora_adapters(self) -> bool:
        """Whether ``WeightSync`` sends this pool the adapters alone (the pool is set up to load them)."""

    @final
    def sync_adapter(self, buckets: Iterable[WeightBucket], config: dict, version: int) -> None:
        """Load the adapter in ``buckets`` (peft's names; ``config`` peft's) beside the base the engines hold, as
        policy ``version``; return once every engine serves it."""
        if not self.takes_lora_adapters:
            raise RuntimeError(
                f"{type(self).__name__} was not set up to load LoRA adapters (SGLang: pool.sync.lora=adapter; vLLM: "
                "pool.lora=adapter): push merged weights"
            )
        self._push("sync_adapter", functools.partial(self._load_adapter, config=config), buckets, version)

    @abstractmethod
    def _load_adapter(self, buckets: Iterable[WeightBucket], version: int, config: dict) -> None:
        """Load the adapter as ``adapter_name(version)`` on every engine, retire the previous one, confirm."""
