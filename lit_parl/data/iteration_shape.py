"""IterationShape: how many prompts an iteration draws and how its samples are cut into steps.

One object, handed to both the module (how many optimizer steps an iteration has, so whether it keeps
an exact θ_k snapshot) and the datamodule (what it requests and how it batches), so the two can never
disagree. Each micro-batch the datamodule emits says whether an optimizer step follows it; the module
never recomputes boundaries.

Example::

    >>> shape = IterationShape(prompts=8, group_size=4, micro_batch_size=8, mini_batches=2, passes=2)
    >>> shape.samples, shape.micro_batches_per_pass, shape.micro_batches, shape.optimizer_steps
    (32, 4, 8, 4)
    >>> IterationShape(prompts=8, group_size=4, micro_batch_size=12)
    Traceback (most recent call last):
    ...
    ValueError: IterationShape(micro_batch_size=12) does not divide the iteration's 8 prompts
    x group_size 4 = 32 samples; pick a divisor of 32
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IterationShape:
    """The shape of one RL iteration.

    Args:
        prompts: prompts drawn per iteration (N).
        group_size: completions per prompt (G >= 2: GRPO compares them).
        micro_batch_size: completions per ``training_step``; divides N x G.
        mini_batches: optimizer steps per pass over the iteration's samples; each mini-batch is a fixed
            block of N / mini_batches prompt slots made of whole micro-batches.
        passes: passes over the iteration's samples (PPO epochs). With several optimizer steps per
            iteration the module keeps an exact snapshot of θ_k as the old policy.
    """

    prompts: int = 32
    group_size: int = 8
    micro_batch_size: int = 64
    mini_batches: int = 1
    passes: int = 1

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(
                f"IterationShape(group_size={self.group_size}): "
                "GRPO needs at least 2 completions per prompt to compare them"
            )
        if self.prompts < 1:
            raise ValueError(f"IterationShape(prompts={self.prompts}) must be >= 1")
        if self.micro_batch_size < 1 or self.samples % self.micro_batch_size:
            raise ValueError(
                f"IterationShape(micro_batch_size={self.micro_batch_size}) does not divide the iteration's "
                f"{self.prompts} prompts x group_size {self.group_size} = {self.samples} samples; "
                f"pick a divisor of {self.samples}"
            )
        if self.mini_batches < 1 or self.passes < 1:
            raise ValueError(
                f"IterationShape(mini_batches={self.mini_batches}, passes={self.passes}): both must be >= 1"
            )
        if self.prompts % self.mini_batches or self.samples_per_step % self.micro_batch_size:
            raise ValueError(
                f"IterationShape(mini_batches={self.mini_batches}) must split the iteration's {self.prompts} prompts "
                f"into equal blocks of whole micro-batches (micro_batch_size={self.micro_batch_size}, "
                f"group_size={self.group_size})"
            )

    @property
    def samples(self) -> int:
        """Completions per iteration (N x G)."""
        return self.prompts * self.group_size

    @property
    def prompts_per_step(self) -> int:
        return self.prompts // self.mini_batches

    @property
    def samples_per_step(self) -> int:
        return self.samples // self.mini_batches

    @property
    def micro_batches_per_pass(self) -> int:
        return self.samples // self.micro_batch_size

    @property
    def micro_batches(self) -> int:
        """``training_step`` calls per iteration, all passes included."""
        return self.micro_batches_per_pass * self.passes

    @property
    def optimizer_steps(self) -> int:
        return self.mini_batches * self.passes
