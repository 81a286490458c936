"""The trainer's side of a sample (``Trajectory``) and the micro-batch one ``training_step`` trains on.

``collate`` lays a micro-batch's trajectories out for the forward pass: shared-prompt packed (each group's
prompt once) or padded (one row per completion), as ``Packing`` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lit_parl.kernels.packing import PackedTokens, pack


@dataclass(slots=True)  # 8 per group, built between training steps: slots make them cheaper
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
    loss_mask: list[int] | None = None  # 0 on an episode's environment tokens (None: every token the model's)


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
    reward_components: dict[str, tuple[float, int]] = field(
        default_factory=dict
    )  # metric -> (sum, samples) over this micro-batch
    reward_failures: dict[str, int] = field(default_factory=dict)  # reward -> failed calls in this micro-batch
    trajectories: list[Trajectory] = field(
        default_factory=list
    )  # the records it was built from, in row order (for logs)

    @property
    def size(self) -> int:
        return int(self.advantages.shape[0])

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.tokens.completion_mask

    def to_device(self, device: torch.device, move: Callable[[MicroBatch], MicroBatch]) -> MicroBatch:
        """This batch on ``device`` by ``move`` (Lightning's walk over its tensors); itself when already there.

        Batches are built on the CPU: training there skips the walk (measured at ~5 ms per step on the default
        job, about a fifth of a step). The trajectories (for logs, on the CPU) are kept out of the walk."""
        if self.advantages.device == device:
            return self
        moved = move(dataclasses.replace(self, trajectories=[]))
        moved.trajectories = self.trajectories
        return moved


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
    if any(t.loss_mask is not None for t in ordered):  # an episode's environment tokens: no loss, no normaliser
        keep = [m for t in ordered for m in (t.loss_mask or [1] * len(t.completion_tokens))]
        dropped = tokens.label_slots[torch.tensor(keep, dtype=torch.bool).logical_not()]
        tokens.completion_mask = tokens.completion_mask.clone()
        tokens.completion_mask.view(-1)[dropped] = False
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
        shaped_rewards=torch.tensor(
            [t.reward if t.shaped_reward is None else t.shaped_reward for t in ordered], dtype=torch.float32
        ),
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
