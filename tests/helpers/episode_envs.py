"""Environments of the episode tests: uneven episode lengths, rewards that differ, and faults on request."""

from __future__ import annotations

import asyncio
import time

from lit_parl.episodes import Step

# turns end on any digit: a random-init model's turns then end by a stop token, not at the length limit
DIGIT_STOPS = tuple(range(3, 13))  # the character tokenizer's ids of "0".."9"


class TurnTaker:
    """Plays ``1 + seed % 3`` model turns (uneven lengths), answering each with ``"+"`` x (turn + 1); rewards
    each turn that holds a "7" (so groups' rewards differ)."""

    role = "user"

    def reset(self, row, seed: int) -> None:
        self.turns, self.played = 1 + seed % 3, 0

    def step(self, text: str) -> Step:
        self.played += 1
        reward = 0.5 * ("7" in text) + 0.1 * len(text) / 8
        if self.played >= self.turns:
            return Step(reward=reward, done=True)
        return Step("+" * (self.played + 1), reward=reward)


class AsyncTurnTaker(TurnTaker):
    """The same game, stepped by ``async def`` methods that wait (as a tool's I/O would)."""

    async def reset(self, row, seed: int) -> None:
        await asyncio.sleep(0.001)
        super().reset(row, seed)

    async def step(self, text: str) -> Step:
        await asyncio.sleep(0.05)
        return super().step(text)


class Endless:
    """Never done: every episode ends at a limit."""

    def reset(self, row, seed: int) -> None:
        pass

    def step(self, text: str) -> Step:
        return Step("++")


class LongAnswer(Endless):
    """Answers with more text than an episode can hold."""

    def step(self, text: str) -> Step:
        return Step("+" * 40)


class FailsOnSecondStep(TurnTaker):
    def step(self, text: str) -> Step:
        if self.played == 1:
            raise ConnectionError("tool server down")
        return super().step(text)


class HangsOnStep(TurnTaker):
    def step(self, text: str) -> Step:
        time.sleep(30)
        return super().step(text)


class FailsOnReset(TurnTaker):
    def reset(self, row, seed: int) -> None:
        raise ValueError("no such game")


class ReturnsText(TurnTaker):
    def step(self, text: str):
        return "+"
