"""Episode: one sample's multi-turn state, and the limits that end it.

The driver (``lit_parl.episodes.episode_runner``) feeds it the model's turns and the environment's
steps; it keeps the tokens (the model's as sampled, the environment's appended), the loss mask, the
sampler's log-probs (0.0 on environment tokens) and the text of each turn, and decides when the episode
ends: done (``"stop"``), or cut by a limit (``"length"``: truncated).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from lit_parl.episodes.environment import Environment, Step
from lit_parl.episodes.episode_settings import EpisodeSettings
from lit_parl.rollout.records import EpisodeTrace


def turn_seed(sample_seed: int, turn: int) -> int:
    """The seed of model turn ``turn`` of the episode whose sample seed is ``sample_seed``: turn 0 keeps the
    sample's (a one-turn episode samples what a single-turn run samples), each later turn its own."""
    if turn == 0:
        return sample_seed
    digest = hashlib.blake2b(f"{sample_seed}/turn/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(eq=False)
class Episode:
    """One sample's episode, from its environment's reset to its end."""

    prompt_id: int
    sample: int
    seed: int
    prompt_tokens: tuple[int, ...]
    environment: Environment
    messages: list[dict] | None  # the chat so far (None: raw text)
    role: str = "user"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[tuple[str, str]] = field(default_factory=list)
    env_reward: float = 0.0
    model_turns: int = 0
    last_turn: list[int] = field(default_factory=list)  # the latest model turn's tokens
    versions: set[int] = field(default_factory=set)
    finish: str | None = None  # "stop" (done) or "length" (truncated); None while it runs
    failed: str | None = None

    @property
    def ended(self) -> bool:
        return self.finish is not None

    def model_turn(
        self, tokens: list[int], logprobs: list[float], reason: str, text: str, version: int, settings: EpisodeSettings
    ) -> bool:
        """Append the model's turn (cut where the episode's token budget ends); whether the environment steps next."""
        self.versions.add(version)
        left = settings.episode_tokens_left(len(self.tokens))
        cut = len(tokens) > left
        tokens, logprobs = tokens[:left], logprobs[:left]
        self.tokens += tokens
        self.logprobs += logprobs
        self.loss_mask += [1] * len(tokens)
        self.model_turns += 1
        self.last_turn = tokens
        self.turns.append(("assistant", text))
        if self.messages is not None:
            self.messages.append({"role": "assistant", "content": text})
        if cut or reason == "length":  # cut by the episode's or the turn's limit: truncated
            self.finish = "length"
            return False
        return True

    def step(self, step: Step, settings: EpisodeSettings) -> bool:
        """Take the environment's answer; whether the model takes another turn (the observation still to append)."""
        self.env_reward += float(step.reward)
        if step.done:
            self.finish = "stop"
            return False
        if self.model_turns >= settings.max_turns:
            self.finish = "length"
            return False
        return True

    def observe(self, text: str, tokens: list[int], settings: EpisodeSettings) -> bool:
        """Append the observation's tokens; whether they leave room for another model turn (else truncated)."""
        if len(tokens) >= settings.episode_tokens_left(len(self.tokens)):
            self.finish = "length"
            return False
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.loss_mask += [0] * len(tokens)
        self.turns.append((self.role, text))
        if self.messages is not None:
            self.messages.append({"role": self.role, "content": text})
        return True

    def fail(self, why: str, end: bool = True) -> None:
        """The environment failed (scored by the policy): the episode ends where it is (``end``), or after the
        model's first turn (a failed reset: every sample has that turn)."""
        self.failed = why
        if end:
            self.finish = "stop"

    def continuation(self) -> tuple[tuple[int, ...], int]:
        """The next model turn's context (prompt and episode so far) and seed."""
        return self.prompt_tokens + tuple(self.tokens), turn_seed(self.seed, self.model_turns)

    def trace(self) -> EpisodeTrace:
        return EpisodeTrace(list(self.loss_mask), list(self.turns), self.env_reward, self.failed)
