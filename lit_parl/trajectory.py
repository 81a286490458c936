"""The records that cross the trainer/pool boundary, and the micro-batch the trainer trains on.

Every result carries ``prompt_id``, sample index and policy ``version``: the trainer pairs results with
prompts by id (never by arrival order) and refuses a version other than the iteration's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"sampling.temperature must be > 0 (log-probs are computed at logits / T), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")


def sample_seed(base_seed: int, version: int, prompt_id: int, sample_index: int) -> int:
    """A 63-bit seed, distinct per (run, version, prompt, sample): no two samples of a group share one."""
    digest = hashlib.blake2b(f"{base_seed}/{version}/{prompt_id}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class GroupRequest:
    """Generate ``len(seeds)`` completions of one prompt with policy ``version``."""

    prompt_id: int
    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    version: int
    seeds: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return len(self.seeds)


@dataclass
class Group:
    """A finished, scored group as the pool returns it."""

    prompt_id: int
    version: int
    sample_indices: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]
    finish_reasons: list[str]  # "stop" (end/stop token) or "length" (cut at max_new_tokens)


@dataclass
class Trajectory:
    prompt_id: int
    sample_index: int
    version: int
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: list[float]
    reward: float
    advantage: float
    truncated: bool


@dataclass
class MicroBatch:
    """Right-padded rows ``[prompt, completion, pad...]``; position t predicts token t + 1.

    Right padding needs no attention mask: under causal attention no real token sees a pad.
    """

    input_ids: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1] = input_ids[:, 1:]
    loss_mask: torch.Tensor  # [B, L-1] True where the target is a completion token
    rollout_logprobs: torch.Tensor  # [B, L-1] the sampler's log-probs, 0 off the mask
    advantages: torch.Tensor  # [B]
    rewards: torch.Tensor  # [B]
    truncated: torch.Tensor  # [B] bool: cut at the length limit
    prompt_ids: list[int] = field(default_factory=list)
    sample_indices: list[int] = field(default_factory=list)
    version: int = -1
    sample_offset: int = 0  # samples of this iteration trained before this micro-batch
    iteration_samples: int = 0  # samples in the whole iteration

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])


def collate_padded(trajectories: list[Trajectory], pad_id: int, sample_offset: int, iteration_samples: int) -> MicroBatch:
    versions = {t.version for t in trajectories}
    if len(versions) != 1:
        raise ValueError(f"a micro-batch mixes policy versions {sorted(versions)}")
    rows = [t.prompt_ids + t.completion_ids for t in trajectories]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(rows), length - 1), dtype=torch.bool)
    rollout_logprobs = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for i, (row, t) in enumerate(zip(rows, trajectories)):
        input_ids[i, : len(row)] = torch.tensor(row)
        start, end = len(t.prompt_ids) - 1, len(row) - 1  # the prompt's last position predicts c[0]
        loss_mask[i, start:end] = True
        rollout_logprobs[i, start:end] = torch.tensor(t.rollout_logprobs)
    return MicroBatch(
        input_ids=input_ids,
        targets=input_ids[:, 1:].clone(),
        loss_mask=loss_mask,
        rollout_logprobs=rollout_logprobs,
        advantages=torch.tensor([t.advantage for t in trajectories], dtype=torch.float32),
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
        truncated=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        prompt_ids=[t.prompt_id for t in trajectories],
        sample_indices=[t.sample_index for t in trajectories],
        version=versions.pop(),
        sample_offset=sample_offset,
        iteration_samples=iteration_samples,
    )
