"""Digit tasks: procedural prompt sources with a verifiable reward in [0, 1], learnable from random init on a CPU.

A task makes row ``index`` deterministically from its seed (so a resumed run sees the same prompts); it
is a ``lit_parl.prompts.prompt_row.PromptSource`` with ``num_rows=None``. Its reward, ``positional_reward``, reads
token ids, never decoded text: decoding drops the end token, and without credit for stopping a model
learns never to stop. (It is an ordinary reward function: its parameters are reward fields.)

Example::

    >>> task = CopyTask(min_digits=2, max_digits=4, seed=0)
    >>> row = task.row(0)
    >>> row.prompt.endswith("=") and row.prompt[:-1] == row.answer
    True
    >>> positional_reward(answer_ids=[5, 6], completion_ids=[5, 6, 1], eos_id=1)
    1.0
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from lit_parl.prompts.prompt_row import PromptRow


def positional_reward(answer_ids: Sequence[int], completion_ids: Sequence[int], eos_id: int) -> float:
    """One point per position matching ``answer + [eos]``, divided by the longer of output and target.

    1.0 only for the exact answer followed by the end token; a completion cut at the length limit
    (no end token) can never reach 1.0.
    """
    output = list(completion_ids)
    if eos_id in output:
        output = output[: output.index(eos_id) + 1]
    target = [*answer_ids, eos_id]
    matches = sum(o == t for o, t in zip(output, target))
    return matches / max(len(output), len(target))


@dataclass
class DigitTask(ABC):
    """Base for string-to-string digit tasks: a prompt ``<digits>=`` and an answer derived from it."""

    min_digits: int = 2
    max_digits: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got min_digits={self.min_digits}, max_digits={self.max_digits}"
            )

    num_rows = None  # procedural: row(i) for every i >= 0

    @abstractmethod
    def answer(self, digits: str) -> str:
        """The answer text for ``digits``."""

    def make(self, index: int) -> tuple[str, str]:
        """Prompt text and answer text of prompt ``index`` (deterministic in ``seed`` and ``index``)."""
        rng = random.Random(f"{self.seed}:{index}")
        length = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice("0123456789") for _ in range(length))
        return f"{digits}=", self.answer(digits)

    def row(self, index: int) -> PromptRow:
        prompt, answer = self.make(index)
        return PromptRow(index=index, prompt=prompt, answer=answer)

    def evaluation(self) -> DigitTask:
        """Held-out prompts: the same task from another seed (a draw repeats a training prompt by chance only)."""
        return dataclasses.replace(self, seed=f"{self.seed}/eval")

    def max_answer_tokens(self) -> int:
        return self.max_digits

    def reward(self, answer_ids: Sequence[int], completion_ids: Sequence[int], eos_id: int) -> float:
        """The task's reward, ``positional_reward`` (``Reward(task.reward)`` uses it as a reward function)."""
        return positional_reward(answer_ids, completion_ids, eos_id)


class CopyTask(DigitTask):
    """``3917=`` → ``3917``."""

    def answer(self, digits: str) -> str:
        return digits


class ReverseTask(DigitTask):
    """``3917=`` → ``7193``."""

    def answer(self, digits: str) -> str:
        return digits[::-1]
