"""The records that cross the trainer/pool boundary: how to sample, what to generate, what came back.

Every result carries ``prompt_id``, sample index and policy ``version``: the trainer pairs results with
prompts by id (never by arrival order) and refuses a version other than the iteration's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


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
            raise ValueError(
                f"sampling.temperature must be > 0 (log-probs are computed at logits / T), or 0 for greedy evaluation; "
                f"got {self.temperature}"
            )
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
    """Generate ``len(seeds)`` completions of one prompt with policy ``version``.

    ``episode``: a multi-turn episode's continuation names its episode, ``(prompt_id, sample)`` of its first
    turn, so that a pool of several servers sends it where that episode's earlier turns went (their prefix
    is cached there); ``None``: a first turn, or a single-turn sample (then ``(prompt_id, k)`` is sample k's).
    """

    prompt_id: int  # the prompt's global draw index
    prompt_tokens: tuple[int, ...]
    version: int
    seeds: tuple[int, ...]
    episode: tuple[int, int] | None = None

    @property
    def group_size(self) -> int:
        return len(self.seeds)


@dataclass
class EpisodeTrace:
    """What a multi-turn episode adds to a sample besides its tokens (``lit_parl.episodes``).

    ``loss_mask[t]`` is 1 where token ``t`` of the completion was sampled by the model, 0 where the
    environment wrote it (trained with no gradient, outside every normaliser); ``turns`` the episode's
    text as (role, text) pairs, role ``"assistant"`` or the environment's; ``env_reward`` the sum of the
    environment's step rewards; ``failed`` why the environment failed (``None``: it did not), under
    ``ScoringPolicy(on_error="score")``.
    """

    loss_mask: list[int]
    turns: list[tuple[str, str]]
    env_reward: float = 0.0
    failed: str | None = None


@dataclass
class GroupCompletions:
    """One request's finished samples as a rollout pool returns them: not yet scored.

    ``version`` is the policy version the worker held when it sampled (not the one it was asked for);
    ``completions[k]`` are sample ``sample_indices[k]``'s token ids, the end token kept; ``logprobs[k]``
    the sampler's log-prob of each of those tokens; ``finish_reasons[k]`` is ``"stop"`` (end or stop
    token) or ``"length"`` (cut at ``max_new_tokens``). A multi-turn episode's completion holds every
    token after the prompt, the environment's too (their log-probs 0.0), and ``episodes[k]`` says which.
    """

    prompt_id: int
    version: int
    sample_indices: list[int]
    completions: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    episodes: list[EpisodeTrace] | None = None  # None: single-turn samples, every token the model's

    def scored(
        self,
        rewards: list[float],
        components: dict[str, list[float | None]] | None = None,
        failures: dict[str, list[int]] | None = None,
    ) -> Group:
        return Group(
            self.prompt_id,
            self.version,
            self.sample_indices,
            self.completions,
            self.logprobs,
            list(rewards),
            self.finish_reasons,
            dict(components or {}),
            dict(failures or {}),
            None if self.episodes is None else [e.loss_mask for e in self.episodes],
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
    reward_components: dict[str, list[float | None]] = field(
        default_factory=dict
    )  # metric -> per sample (None: the call failed)
    reward_failures: dict[str, list[int]] = field(
        default_factory=dict
    )  # reward -> samples (positions) whose call failed
    loss_masks: list[list[int]] | None = None  # per sample, 0 on environment tokens (None: all the model's)
