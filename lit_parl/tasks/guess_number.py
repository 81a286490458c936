"""Guess the number: a multi-turn game with feedback, learnable from random init on a CPU.

``GuessNumberTask`` makes row ``i`` from ``(seed, i)``: a secret number in ``[low, high]`` (the row's
answer; the prompt only states the range, e.g. ``0-9:``). ``GuessNumber`` plays one episode: each model
turn is a guess; the answer is ``+`` (the secret is higher), ``-`` (lower), or ``?`` (not a number in the
range); a right guess ends the episode with reward ``1 - turn_penalty * (turns - 1)``, so a binary search
scores more than guessing at random. Learning shows in two steps: first the format (a number, then the end
token), then the use of the feedback.

Example::

    >>> task = GuessNumberTask(seed=0)
    >>> row = task.row(3)
    >>> game = GuessNumber(); game.reset(row, seed=0)
    >>> secret = int(row.answer)
    >>> game.step(str(secret - 1) if secret else "x").observation in ("+", "?")
    True
    >>> game.step(row.answer)
    Step(observation='', reward=0.9, done=True)
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from lit_parl.episodes.environment import Step
from lit_parl.prompts.prompt_row import PromptRow


@dataclass
class GuessNumberTask:
    """Rows of the game: a range in the prompt, a secret number as the answer.

    Args:
        low, high: the secret's range, both included.
        seed: row ``i``'s secret is drawn from ``(seed, i)``.
    """

    low: int = 0
    high: int = 9
    seed: int | str = 0

    num_rows = None  # procedural: row(i) for every i >= 0

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"GuessNumberTask needs 0 <= low < high, got low={self.low}, high={self.high}")

    def row(self, index: int) -> PromptRow:
        secret = random.Random(f"{self.seed}:{index}").randint(self.low, self.high)
        return PromptRow(index=index, prompt=f"{self.low}-{self.high}:", answer=str(secret))

    def evaluation(self) -> GuessNumberTask:
        """Held-out games: the same ranges from another seed."""
        return dataclasses.replace(self, seed=f"{self.seed}/eval")


class GuessNumber:
    """One game: ``+``/``-`` feedback on each guess, the reward when the secret is found.

    Args:
        turn_penalty: subtracted from the reward of 1.0 for each guess before the right one.
        low, high: the accepted range (a guess outside it, or not a number, is answered ``?``).
    """

    role = "user"

    def __init__(self, turn_penalty: float = 0.1, low: int = 0, high: int = 9) -> None:
        self.turn_penalty, self.low, self.high = turn_penalty, low, high

    def reset(self, row: PromptRow, seed: int) -> None:
        self.secret, self.guesses = int(row.answer), 0

    def step(self, text: str) -> Step:
        self.guesses += 1
        text = text.strip()
        guess = int(text) if text.isdigit() and len(text) <= 6 else None
        if guess is None or not self.low <= guess <= self.high:
            return Step("?")
        if guess == self.secret:
            return Step(reward=round(1.0 - self.turn_penalty * (self.guesses - 1), 6), done=True)
        return Step("+" if guess < self.secret else "-")
