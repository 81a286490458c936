"""EpisodeSettings: which environment plays the episodes, and the limits that cut one.

Example::

    >>> from lit_parl.tasks.guess_number import GuessNumber
    >>> settings = EpisodeSettings(environment=GuessNumber, max_turns=4, max_episode_tokens=16)
    >>> settings.turn_limit(6), settings.episode_tokens_left(14)
    (6, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lit_parl.episodes.environment import Environment


@dataclass(frozen=True)
class EpisodeSettings:
    """Multi-turn episodes: each sample alternates model turns and ``environment`` steps until done or a limit.

    Args:
        environment: builds one episode's ``Environment`` (a class, or Hydra's ``_partial_: true`` of one):
            called once per sample, with no arguments.
        max_turns: model turns per episode; an episode not done after its last turn's step is truncated.
        max_episode_tokens: tokens after the prompt (the model's and the environment's); a turn is cut
            where the episode reaches it, and an observation that would reach it ends the episode, both
            truncated. The model's context holds the longest prompt plus this. ``sampling.max_new_tokens``
            is the limit of one model turn; a turn cut there ends its episode, truncated.
    """

    environment: Callable[[], Environment]
    max_turns: int = 4
    max_episode_tokens: int = 64

    def __post_init__(self) -> None:
        if not callable(self.environment):
            raise TypeError(
                f"EpisodeSettings(environment={self.environment!r}) must build an environment: a class, or a "
                "callable (in a config: _target_ with _partial_: true)"
            )
        if self.max_turns < 1:
            raise ValueError(f"EpisodeSettings(max_turns={self.max_turns}) must be >= 1")
        if self.max_episode_tokens < 1:
            raise ValueError(f"EpisodeSettings(max_episode_tokens={self.max_episode_tokens}) must be >= 1")

    def turn_limit(self, max_new_tokens: int) -> int:
        """Tokens one model turn may take: the sampling limit, within the episode's."""
        return min(max_new_tokens, self.max_episode_tokens)

    def episode_tokens_left(self, used: int) -> int:
        return self.max_episode_tokens - used
