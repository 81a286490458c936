"""The records that cross the trainer/pool boundary, and the micro-batch the trainer trains on.

Every result carries ``prompt_id``, sample index and policy ``version``: the trainer pairs results with
prompts by id (never by arrival order) and refuses a version other than the iteration's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from lit_parl.kernels.packing import PackedTokens, pack


@dataclass(frozen=True)
class SamplingParams:
    """How every sample of a request is drawn.

    Args:
        max_new_tokens: the length limit; a sample cut there finishes with ``"length"``.
        temperature: logits are divided by it; log-probs are those of the full softmax at it. 0: greedy
            (the argmax token), for evaluation only: training needs a distribution to differentiate.
        top_p, top_k: filters on what is drawn (0 / 1.0: off); log-probs stay the full softmax.
        stop_token_ids: tokens that end a sample besides the end token (kept in the completion).
        stop: strings that end a sample once the decoded completion contains one; the completion keeps
            the tokens up to and including the one that completed the string, and finishes with ``"stop"``.
    """

    max_new_tokens: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Hydra and JSON give lists; the parameters are hashable and frozen
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"sampling.temperature must be > 0 (log-probs are computed at logits / T), or 0 for greedy evaluation; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:  # vLLM and SGLang read -1 as "off", the hf sampler any value < 1: one spelling here
            raise ValueError(f"sampling.top_k must be >= 0 (0: no top-k filter), got {self.top_k}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"sampling.stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0: every backend takes the argmax token (evaluation)."""
        return self.temperature == 0


def sample_seed(base_seed: int, version: int, prompt_id: int, sample_index: int) -> int:
    """A 63-bit seed, distinct per (run, version, prompt, sample): no two samples of a group share one."""
    digest = hashlib.blake2b(f"{base_seed}/{version}/{prompt_id}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class GroupRequest:
    """Generate ``len(seeds)`` completions of one prompt with policy ``version``."""

    prompt_id: int  # the prompt's global draw index
    prompt_tokens: tuple[int, ...]
    version: int
    seeds: tuple[int, ...]

    @property
    def group_size(self) -> int:
        return len(self.seeds)


@dataclass
class GroupCompletions:
    """One request's finished samples as a rollout pool returns them: not yet scored.

    ``version`` is the policy version the worker held when it sampled (not the one it was asked for);
    ``completions[k]`` are sample ``sample_indices[k]``'s token ids, the end token kept; ``logprobs[k]``
    the sampler's log-prob of each of those tokens; ``finish_reasons[k]`` is ``"stop"`` (end or stop
    token) or ``"length"`` (cut at ``max_new_tokens``).
    """

    prompt_id: int
    version: int
    sample_indices: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]

    def scored(self, rewards: list[float], components: dict[str, list[float | None]] | None = None, failures: dict[str, list[int]] | None = None) -> "Group":
        return Group(
            self.prompt_id, self.version, self.sample_indices, self.completions, self.logprobs, list(rewards), self.finish_reasons,
            dict(components or {}), dict(failures or {}),
        )


@dataclass
class Group:
    """A finished group with one reward per sample: what the trainer's data path accepts."""

    prompt_id: int
    version: int
    sample_indices: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    rewards: list[float]  # each sample's total: the weighted sum of its rewards
    finish_reasons: list[str]  # "stop" (end/stop token) or "length" (cut at max_new_tokens)
    reward_components: dict[str, list[float | None]] = field(default_factory=dict)  # metric -> per sample (None: the call failed)
    reward_failures: dict[str, list[int]] = field(default_factory=dict)  # reward -> samples (positions) whose call failed


@dataclass
class Trajectory:
    prompt_id: int
    sample_index: int
    version: int
    prompt_tokens: list[int]
    completion_tokens: list[int]
    rollout_logprobs: list[float]
    reward: float
    advantage: float
    truncated: bool
    shaped_reward: float | None = None  # the reward after the objective's shaping (None: same as reward)
    correct: bool = False  # the task's notion of a correct answer (accuracy)
    zero_variance: bool = False  # its group's (shaped) rewards were all equal
    reward_components: dict[str, float] = field(default_factory=dict)  # each reward's value (failed calls left out)
    reward_failures: tuple[str, ...] = ()  # rewards whose call failed on this sample (scored by the policy)


@dataclass
class MicroBatch:
    """The trajectories of one ``training_step``, laid out for the forward pass (``lit_parl.kernels.pack``).

    Per-sample tensors are ordered group by group (samples of one prompt next to each other), the order
    of ``tokens.completion_mask``'s rows. ``T`` is the longest completion.
    """

    tokens: PackedTokens
    rollout_logprobs: torch.Tensor  # [n, T] the sampler's log-probs, 0 off the completion mask
    advantages: torch.Tensor  # [n]
    rewards: torch.Tensor  # [n] the task's rewards
    shaped_rewards: torch.Tensor  # [n] after the objective's reward shaping (what the advantages come from)
    truncated: torch.Tensor  # [n] bool: cut at the length limit
    correct: torch.Tensor  # [n] bool
    zero_variance: torch.Tensor  # [n] bool: the sample's group had all-equal rewards
    prompt_ids: list[int] = field(default_factory=list)  # each sample's prompt_id (draw index), not tokens
    sample_indices: list[int] = field(default_factory=list)
    version: int = -1
    sample_offset: int = 0  # samples of this pass over the iteration trained before this micro-batch
    ends_step: bool = True  # an optimizer step follows this micro-batch (the end of a mini-batch)
    group_size: int = 0
    pass_index: int = 0  # which pass over the iteration's samples (several with IterationShape.passes > 1)
    logprob_tolerance: float | None = None  # largest mean |rollout - θ_k| log-prob per token accepted (None: unchecked)
    reward_components: dict[str, tuple[float, int]] = field(default_factory=dict)  # metric -> (sum, samples) over this micro-batch
    reward_failures: dict[str, int] = field(default_factory=dict)  # reward -> failed calls in this micro-batch
    trajectories: list[Trajectory] = field(default_factory=list)  # the records it was built from, in row order (for logs)

    @property
    def size(self) -> int:
        return int(self.advantages.shape[0])

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.tokens.completion_mask


PACKING_MODES = ("auto", "shared_prompt", "padded")


@dataclass(frozen=True)
class Packing:
    """How ``collate`` lays out a micro-batch.

    Args:
        mode: ``shared_prompt`` (each group's prompt computed once), ``padded`` (one row per completion),
            or ``auto``: shared-prompt packing when the padded layout would compute at least ``min_gain``
            times as many tokens (below that, the gathered attention costs more than it saves).
        min_gain: the threshold of ``auto``.
        max_row_tokens: split packed micro-batches into rows of at most this many tokens (None: one row).
    """

    mode: str = "auto"
    min_gain: float = 1.5
    max_row_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in PACKING_MODES:
            raise ValueError(f"Packing(mode={self.mode!r}); choose one of {PACKING_MODES}")


def padded_token_count(groups: list[tuple[list[int], list[list[int]]]]) -> int:
    """Tokens a padded layout computes: one row per completion, every row as long as the longest."""
    rows = [len(p) + len(c) - 1 for p, cs in groups for c in cs]
    return len(rows) * max(rows)


def shared_prompt_token_count(groups: list[tuple[list[int], list[list[int]]]]) -> int:
    return sum(len(p) + sum(len(c) - 1 for c in cs) for p, cs in groups)


def collate(
    trajectories: list[Trajectory],
    pad_id: int,
    sample_offset: int = 0,
    packing: str = "auto",
    min_packing_gain: float = 1.5,
    max_row_tokens: int | None = None,
    group_size: int = 0,
) -> MicroBatch:
    """``packing``: ``shared_prompt``, ``padded``, or ``auto``: shared-prompt packing when the padded layout
    would compute at least ``min_packing_gain`` times as many tokens (below that, the gathered attention
    costs more than the tokens it saves)."""
    if packing not in PACKING_MODES:
        raise ValueError(f"collate(packing={packing!r}); choose one of {PACKING_MODES}")
    versions = {t.version for t in trajectories}
    if len(versions) != 1:
        raise ValueError(f"a micro-batch mixes policy versions {sorted(versions)}")
    by_prompt: dict[int, list[Trajectory]] = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_id, []).append(t)
    ordered = [t for group in by_prompt.values() for t in group]
    groups = [(group[0].prompt_tokens, [t.completion_tokens for t in group]) for group in by_prompt.values()]
    if packing == "auto":
        shared = padded_token_count(groups) >= min_packing_gain * shared_prompt_token_count(groups)
    else:
        shared = packing == "shared_prompt"
    tokens = pack(groups, pad_id, shared_prompt=shared, max_row_tokens=max_row_tokens)
    rollout_logprobs = torch.zeros(tokens.completion_mask.shape, dtype=torch.float32)
    if all(len(t.rollout_logprobs) == len(t.completion_tokens) for t in ordered):
        # one log-prob per completion token: they fill exactly the label slots, in order
        flat = [lp for t in ordered for lp in t.rollout_logprobs]
        rollout_logprobs.view(-1)[tokens.label_slots] = torch.tensor(flat, dtype=torch.float32)
    else:
        for i, t in enumerate(ordered):
            rollout_logprobs[i, : len(t.rollout_logprobs)] = torch.tensor(t.rollout_logprobs)
    components: dict[str, tuple[float, int]] = {}
    failures: dict[str, int] = {}
    for t in ordered:
        for name, value in t.reward_components.items():
            total, count = components.get(name, (0.0, 0))
            components[name] = (total + value, count + 1)
        for name in t.reward_failures:
            failures[name] = failures.get(name, 0) + 1
    return MicroBatch(
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        advantages=torch.tensor([t.advantage for t in ordered], dtype=torch.float32),
        rewards=torch.tensor([t.reward for t in ordered], dtype=torch.float32),
        shaped_rewards=torch.tensor([t.reward if t.shaped_reward is None else t.shaped_reward for t in ordered], dtype=torch.float32),
        truncated=torch.tensor([t.truncated for t in ordered], dtype=torch.bool),
        correct=torch.tensor([t.correct for t in ordered], dtype=torch.bool),
        zero_variance=torch.tensor([t.zero_variance for t in ordered], dtype=torch.bool),
        prompt_ids=[t.prompt_id for t in ordered],
        sample_indices=[t.sample_index for t in ordered],
        version=versions.pop(),
        sample_offset=sample_offset,
        group_size=group_size,
        reward_components=components,
        reward_failures=failures,
        trajectories=ordered,
    )
