"""IterationStats: what one iteration's rollouts were, for logging, the run summary and the timeline.

Example::

    >>> IterationStats(gen_intervals=[(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]).gen_busy_s  # two workers overlapping
    4.0
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IterationStats:
    """The rollout side of one iteration, booked by the datamodule as its groups are accepted.

    Args:
        version: the policy version the iteration trained.
        requested_at, completed_at: monotonic times of its first request and of its last micro-batch.
        completions, completion_tokens: every accepted sample and its tokens, dropped groups included.
        reward_sum: sum of those samples' rewards, before any shaping.
        prompts_drawn: prompts scheduled (more than the iteration's N with dynamic sampling).
        dropped_groups: zero-variance groups dropped by dynamic sampling.
        gen_intervals: ``(start, end)`` monotonic times the pool was generating, over every round of
            requests (dynamic sampling may need several).
        generation_done: the pool has returned every group of the round requested last (``CoreShare`` lends
            the pool's cores to the trainer then).
        lent_from: the first micro-batch (0-based) trained with the pool's cores lent; ``None``: none was.
    """

    version: int = -1
    requested_at: float = 0.0
    completed_at: float = 0.0
    completions: int = 0
    completion_tokens: int = 0
    reward_sum: float = 0.0
    prompts_drawn: int = 0
    dropped_groups: int = 0
    gen_intervals: list[tuple[float, float]] = field(default_factory=list)
    generation_done: bool = False
    lent_from: int | None = None

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / max(self.completions, 1)

    @property
    def gen_busy_s(self) -> float:
        """Seconds during which at least one worker was generating (the union of the intervals: with
        several workers or servers they overlap, and their sum could exceed the wall time)."""
        total, reached = 0.0, float("-inf")
        for start, end in sorted(self.gen_intervals):
            if end > reached:
                total += end - max(start, reached)
                reached = end
        return total
