"""Calculator: a tool-use task whose answer needs a tool call, learnable from random init on a CPU.

``CalculatorTask`` makes row ``i`` from ``(seed, i)``: a product such as ``37*4=``, its value the answer
(too many to memorise for a small model). ``Calculator`` is the tool: a model turn that starts with ``?``
is a call, and the rest of the turn is evaluated (digits and ``+ - *`` only, parsed, never executed);
the observation is ``=`` and the value (``=?`` for an expression it cannot read). Any other turn is the
final answer and ends the episode: after a call it is scored by position against the true value, without
one it scores 0 (the task is to use the tool; a guessed digit in place would otherwise pay more at first
than a call, and a small model would learn to guess). The first call earns a little credit, half for
calling at all and half for how closely its expression matches the prompt's: a shaping reward that makes
the call learnable from scratch.

Example::

    >>> row = CalculatorTask(seed=0).row(0)
    >>> tool = Calculator(); tool.reset(row, seed=0)
    >>> expression = row.prompt[:-1]
    >>> call = tool.step("?" + expression)
    >>> call.observation == "=" + row.answer, call.reward, call.done
    (True, 0.2, False)
    >>> tool.step(row.answer)
    Step(observation='', reward=0.8, done=True)
    >>> tool.reset(row, seed=0); tool.step(row.answer)  # an answer without a call
    Step(observation='', reward=0.0, done=True)
"""

from __future__ import annotations

import dataclasses
import random
import re
from dataclasses import dataclass

from lit_parl.episodes.environment import Step
from lit_parl.prompts.prompt_row import PromptRow

_EXPRESSION = re.compile(r"\d{1,6}([+*-]\d{1,6}){0,3}")


def positional_match(output: str, target: str) -> float:
    """Characters in place, divided by the longer of the two (1.0 only for equal strings)."""
    if not output and not target:
        return 1.0
    return sum(o == t for o, t in zip(output, target)) / max(len(output), len(target))


def evaluate(expression: str) -> int | None:
    """The value of ``expression`` (integers with ``+ - *``, products first); None if unreadable."""
    if not _EXPRESSION.fullmatch(expression):
        return None
    parts = re.split(r"([+-])", expression)  # term, sign, term, ...
    value = _product(parts[0])
    for sign, term in zip(parts[1::2], parts[2::2]):
        value += _product(term) if sign == "+" else -_product(term)
    return value


def _product(term: str) -> int:
    value = 1
    for factor in term.split("*"):
        value *= int(factor)
    return value


@dataclass
class CalculatorTask:
    """Rows ``a*b=`` with ``a`` of ``digits`` digits and ``b`` in 2..9; the product as the answer.

    Args:
        digits: digits of the first factor.
        seed: row ``i`` is drawn from ``(seed, i)``.
    """

    digits: int = 2
    seed: int | str = 0

    num_rows = None

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"CalculatorTask(digits={self.digits}) must be in 1..4")

    def row(self, index: int) -> PromptRow:
        rng = random.Random(f"{self.seed}:{index}")
        a, b = rng.randint(10 ** (self.digits - 1), 10**self.digits - 1), rng.randint(2, 9)
        return PromptRow(index=index, prompt=f"{a}*{b}=", answer=str(a * b))

    def evaluation(self) -> CalculatorTask:
        return dataclasses.replace(self, seed=f"{self.seed}/eval")


class Calculator:
    """The calculator tool and the answer's judge.

    Args:
        call_credit: the first call's reward for an expression equal to the prompt's: half of it for any call,
            half scaled by the characters of the prompt's expression in place.
    """

    role = "tool"

    def __init__(self, call_credit: float = 0.2) -> None:
        self.call_credit = call_credit

    def reset(self, row: PromptRow, seed: int) -> None:
        self.expression, self.answer, self.called = row.prompt.rstrip("="), row.answer, False

    def step(self, text: str) -> Step:
        text = text.strip()
        if text.startswith("?"):
            argument = text[1:].strip()
            match = positional_match(argument, self.expression)
            credit = 0.0 if self.called else self.call_credit * (1 + match) / 2
            self.called = True
            value = evaluate(argument)
            return Step("=?" if value is None else f"={value}", reward=round(credit, 6))
        if not self.called:
            return Step(done=True)
        return Step(reward=round((1.0 - self.call_credit) * positional_match(text, self.answer), 6), done=True)
