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
import json
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
    """Rows ``a*b=`` with ``a`` of ``digits`` digits and ``b`` in 2..9; the product as the answer (the expression
    also in the metadata, for the tool).

    Args:
        digits: digits of the first factor.
        seed: row ``i`` is drawn from ``(seed, i)``.
        shots: with ``shots > 0`` a row is a chat: that many solved examples (the question, a call in
            ``ToolCallCalculator``'s format, the tool's value, the answer), then the question. A small instruct
            model calls a tool it is shown, where the tool's description alone does not get it to.
    """

    digits: int = 2
    seed: int | str = 0
    shots: int = 0

    num_rows = None

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 4:
            raise ValueError(f"CalculatorTask(digits={self.digits}) must be in 1..4")
        if self.shots < 0:
            raise ValueError(f"CalculatorTask(shots={self.shots}) must be >= 0")

    def row(self, index: int) -> PromptRow:
        rng = random.Random(f"{self.seed}:{index}")
        expression, value = self._product(rng)
        metadata = {"expression": expression}
        if not self.shots:
            return PromptRow(index=index, prompt=f"{expression}=", answer=str(value), metadata=metadata)
        messages = []
        for _ in range(self.shots):
            shown, result = self._product(rng)
            call = json.dumps([{"name": "calculator", "arguments": {"expression": shown}}])
            messages += [
                {"role": "user", "content": f"{shown}="},
                {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": str(result)},
                {"role": "assistant", "content": str(result)},
            ]
        messages.append({"role": "user", "content": f"{expression}="})
        return PromptRow(index=index, messages=messages, answer=str(value), metadata=metadata)

    def _product(self, rng: random.Random) -> tuple[str, int]:
        a, b = rng.randint(10 ** (self.digits - 1), 10**self.digits - 1), rng.randint(2, 9)
        return f"{a}*{b}", a * b

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
        self.expression, self.answer, self.called = row.metadata["expression"], row.answer, False

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


TOOL = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression of integers with + - *",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_LAST_NUMBER = re.compile(r"-?\d+(?!.*\d)", re.DOTALL)


class ToolCallCalculator(Calculator):
    """The calculator for an instruct model, in the tool-call format of SmolLM2 and Qwen: a turn holding
    ``<tool_call>[{"name": "calculator", "arguments": {"expression": "37*4"}}]</tool_call>`` (a list or one
    object) is a call, answered by the tool's turn with the value; any other turn is the answer, its last
    number scored by position against the value (after a call; 0 without one). ``TOOL`` is the tool's schema,
    for the system prompt (``conf/experiment/smollm2_calculator.yaml``).

    Example::

        >>> row = CalculatorTask(seed=0).row(0)
        >>> tool = ToolCallCalculator(); tool.reset(row, seed=0)
        >>> call = '<tool_call>[{"name": "calculator", "arguments": {"expression": "%s"}}]</tool_call>'
        >>> tool.step(call % row.prompt[:-1]).observation == row.answer
        True
        >>> tool.step(f"The answer is {row.answer}.").reward
        0.8
    """

    role = "tool"

    def step(self, text: str) -> Step:
        found = _TOOL_CALL.search(text)
        if found is None:
            if not self.called:
                return Step(done=True)
            number = _LAST_NUMBER.search(text)
            answer = number.group(0) if number else ""
            return Step(reward=round((1.0 - self.call_credit) * positional_match(answer, self.answer), 6), done=True)
        argument = _expression(found.group(1))
        match = positional_match(argument or "", self.expression)
        credit = 0.0 if self.called else self.call_credit * (1 + match) / 2
        self.called = True
        value = evaluate(argument.replace(" ", "")) if argument else None
        return Step("error: cannot evaluate that" if value is None else str(value), reward=round(credit, 6))


def _expression(call: str) -> str | None:
    """The ``expression`` argument of a calculator call's JSON (a list of calls or one), else None."""
    try:
        parsed = json.loads(call)
    except ValueError:
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    for item in calls:
        arguments = item.get("arguments") if isinstance(item, dict) else None
        if isinstance(arguments, dict) and isinstance(arguments.get("expression"), str):
            return arguments["expression"].strip()
    return None
