"""The environment API: what a multi-turn, tool-using task implements, in the vocabulary of gymnasium's ``Env``.

One environment object plays one episode. ``reset(row, seed)`` starts it from the prompt's row; then the
model and the environment alternate: the model's turn (its text, decoded) goes to ``step``, which answers
with a ``Step``: the observation the model reads next (a tool's result, the game's feedback), a reward for
this step, and whether the episode is over. Either method may be ``async def`` (a tool that calls a
service): they run on an event loop of their own, several episodes' steps at once, never blocking
generation. An episode also ends when a limit cuts it (``EpisodeSettings``: turns, tokens), marked
truncated. The model's tokens are kept exactly as sampled; the observation is tokenized and appended
(``lit_parl.episodes.observation_tokens``), so the trainer trains the tokens that were sampled.

Why not gymnasium itself: its ``Env`` is synchronous and holds arrays, and nothing in it knows text or
chat turns; a text environment written for it (``reset(seed=...)`` / ``step(action)``) adapts in a few
lines. Rewards reach the trainer through the ordinary reward functions: the reward field ``env_reward``
holds the sum of the step rewards (``environment_reward`` passes it on), ``turns`` the episode's text.

Example: the number is found from "+" (higher) and "-" (lower) answers::

    >>> class Guess:
    ...     def reset(self, row, seed): self.secret = int(row.answer)
    ...     def step(self, text):
    ...         guess = int(text) if text.isdigit() else -1
    ...         if guess == self.secret:
    ...             return Step(reward=1.0, done=True)
    ...         return Step("+" if guess < self.secret else "-")
    >>> from lit_parl.prompts.prompt_row import PromptRow
    >>> game = Guess(); game.reset(PromptRow(index=0, prompt="g=", answer="6"), seed=0)
    >>> game.step("3"), game.step("6").done
    (Step(observation='+', reward=0.0, done=False), True)
"""

from __future__ import annotations

import math
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from lit_parl.prompts.prompt_row import PromptRow


@dataclass(frozen=True)
class Step:
    """The environment's answer to one model turn.

    Args:
        observation: the text the model reads next (a tool's result, feedback); empty when ``done``.
        reward: this step's reward; an episode's step rewards are summed into the reward field ``env_reward``.
        done: the episode is over (solved, failed, or the model gave its final answer).
    """

    observation: str = ""
    reward: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.observation, str):
            raise TypeError(f"Step(observation=...) must be text, got {type(self.observation).__name__}")
        if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"Step(reward={self.reward!r}) must be a finite number")


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: built fresh per episode by ``EpisodeSettings.environment``.

    ``role`` (optional attribute, default ``"user"``) names the environment's turns in a chat template
    (``"tool"`` for a tool's results, where the template knows that role).
    """

    def reset(self, row: PromptRow, seed: int) -> None | Awaitable[None]:
        """Start the episode of ``row``; ``seed`` is the sample's (the same episode on a re-run)."""

    def step(self, text: str) -> Step | Awaitable[Step]:
        """The model's turn ``text`` (decoded, special tokens left out); the observation, reward and end."""


def environment_reward(env_reward: float) -> float:
    """The episode's environment rewards, summed: a reward function (``conf/reward/environment.yaml``)."""
    return env_reward
