"""The rollout pool protocol: what the trainer needs from any generation backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
from transformers import PreTrainedModel

from lit_parl.trajectory import Group, GroupRequest, SamplingParams


class RewardFunction(Protocol):
    def reward(self, answer_ids: list[int], completion_ids: list[int], eos_id: int) -> float: ...


class RolloutPool(ABC):
    """Generates scored groups with one confirmed policy version at a time.

    ``version`` is the version every worker has confirmed; ``None`` before the first sync. ``generate``
    refuses requests of any other version (the pool side of the version gate) and stamps each group with
    the version the worker actually held.
    """

    version: int | None = None

    @abstractmethod
    def start(self, policy: PreTrainedModel, reward_fn: RewardFunction, eos_id: int, pad_id: int, colocated: bool) -> None:
        """Start the workers for ``policy``'s architecture. ``colocated``: generation and training take
        turns on the same hardware (sync mode), so each may use all of it."""

    @abstractmethod
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load these weights on every worker and return once all of them confirmed ``version``."""

    @abstractmethod
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[Group]:
        """Yield each request's scored group as soon as it is finished, in completion order."""

    @abstractmethod
    def health(self) -> dict:
        """A small status dict: workers alive, confirmed version."""

    @abstractmethod
    def close(self) -> None:
        """Stop everything the pool started; idempotent; leaves no process behind."""

    def reserved_cpus(self, colocated: bool) -> int:
        """CPU threads the pool's workers take while the trainer runs (0 for accelerator backends)."""
        return 0

    def busy_intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` monotonic times the workers spent generating during the last ``generate``."""
        return []

    def check_requests(self, requests: list[GroupRequest]) -> None:
        if self.version is None:
            raise RuntimeError("the rollout pool has no weights yet: sync_weights must run before generate")
        stale = sorted({r.version for r in requests} - {self.version})
        if stale:
            raise RuntimeError(
                f"version gate: requests for policy version(s) {stale} reached a pool holding version {self.version}; "
                "weights must be synced (WeightSync callback) before the iteration's requests are sent"
            )
        ids = [r.prompt_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate prompt_id in one generate call: every prompt is generated exactly once")
