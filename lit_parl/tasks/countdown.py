"""Countdown: reach a target number from given numbers with ``+ - * /`` and parentheses (as in TinyZero).

``CountdownTask`` makes row ``i`` from ``(seed, i)``: 3 to 4 numbers and a target built by combining all
of them in a random order with random operations, so every row is solvable (the expression it was built
from is thrown away: neither the prompt nor the metadata holds a solution).

``countdown_reward`` reads the completion's expression (the last ``<answer>...</answer>``, else the last
non-empty line) and scores 1.0 when it uses each given number exactly once (TinyZero's rule) and equals
the target, else 0.0 (``... = 24`` is not an expression, so it scores 0, as in TinyZero). The expression
is parsed with ``ast`` and evaluated by walking the tree: only integer literals, ``+ - * /``, unary minus
and parentheses are accepted, so nothing is ever executed, and no power operator exists to make huge
numbers. Division is exact (``fractions.Fraction``); dividing by zero
scores 0. There is no partial credit for the format: weight ``lit_parl.rewards.format.tag_format_reward``
beside it for that.

Example::

    >>> task = CountdownTask(seed=0)
    >>> row = task.row(7)
    >>> row.answer == str(row.metadata["target"]) and 3 <= len(row.metadata["numbers"]) <= 4
    True
    >>> countdown_reward("<answer>(100 - 4) / 8 * 2</answer>", {"numbers": [2, 4, 8, 100], "target": 24})
    1.0
    >>> countdown_reward("<answer>__import__('os')</answer>", {"numbers": [2, 4, 8, 100], "target": 24})
    0.0
"""

from __future__ import annotations

import ast
import dataclasses
import random
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from lit_parl.prompts.prompt_row import PromptRow
from lit_parl.rewards.format import answer_tag

TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and parentheses, and each number must be used exactly once. Show your work in "
    "<think> </think> tags, then give the final expression in <answer> </answer> tags, for example "
    "<answer>(1 + 2) / 3</answer>."
)
# catch_warnings swaps the process's filters: two threads scoring at once would restore each other's
_PARSING = threading.Lock()
MAX_EXPRESSION_CHARS = 300  # a longer expression scores 0 unparsed: the given numbers never need more
_OPERATORS = {
    ast.Add: Fraction.__add__,
    ast.Sub: Fraction.__sub__,
    ast.Mult: Fraction.__mul__,
    ast.Div: Fraction.__truediv__,
}


@dataclass
class CountdownTask:
    """A procedural countdown task: row ``i`` for every ``i >= 0``, deterministic in ``seed`` and ``i``.

    Args:
        min_numbers: the fewest numbers a row gives (at least 2).
        max_numbers: the most numbers a row gives.
        max_number: the numbers are drawn from ``1..max_number``.
        max_target: every intermediate result, and so the target, lies in ``1..max_target`` (>= max_number).
        seed: the task's seed.
        template: the prompt text, with ``{numbers}`` (a list such as ``[3, 7, 25]``) and ``{target}``.
    """

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 100
    max_target: int = 1000
    seed: int = 0
    template: str = TEMPLATE

    num_rows = None  # procedural: row(i) exists for every i >= 0

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError(
                f"CountdownTask needs 2 <= min_numbers <= max_numbers, "
                f"got min_numbers={self.min_numbers}, max_numbers={self.max_numbers}"
            )
        if not 1 <= self.max_number <= self.max_target:
            raise ValueError(
                f"CountdownTask needs 1 <= max_number <= max_target, "
                f"got max_number={self.max_number}, max_target={self.max_target}"
            )
        try:
            self.template.format(numbers=[1, 2], target=3)
        except (KeyError, IndexError, ValueError) as error:
            raise ValueError(
                f"CountdownTask template may only use the fields {{numbers}} and {{target}}: {error!r}"
            ) from error

    def row(self, index: int) -> PromptRow:
        """Prompt ``index``: its numbers and target in the prompt, ``answer=str(target)``, and both in metadata."""
        if index < 0:
            raise IndexError(f"CountdownTask rows start at 0, got index {index}")
        rng = random.Random(f"{self.seed}:{index}")
        numbers = [rng.randint(1, self.max_number) for _ in range(rng.randint(self.min_numbers, self.max_numbers))]
        target = self._target(numbers, rng)
        return PromptRow(
            index=index,
            prompt=self.template.format(numbers=numbers, target=target),
            answer=str(target),
            metadata={"numbers": numbers, "target": target},
        )

    def evaluation(self) -> CountdownTask:
        """Held-out prompts: the same task from another seed."""
        return dataclasses.replace(self, seed=f"{self.seed}/eval")

    def _target(self, numbers: list[int], rng: random.Random) -> int:
        """Combine random pairs until one value is left; each step keeps a whole number in 1..max_target.

        One step always can: ``a - b`` for ``a > b`` (both <= max_target), else ``a / a = 1``.
        """
        values = list(numbers)
        while len(values) > 1:
            a, b = (values.pop(rng.randrange(len(values))) for _ in range(2))
            a, b = max(a, b), min(a, b)
            results = [a + b, a * b, a - b] + ([a // b] if a % b == 0 else [])
            values.append(rng.choice([r for r in results if 1 <= r <= self.max_target]))
        return values[0]


def countdown_reward(completion: str, metadata: Mapping[str, Any]) -> float:
    """1.0 when the completion's expression uses each of ``metadata["numbers"]`` once and equals
    ``metadata["target"]``; 0.0 otherwise (see the module docstring)."""
    try:
        numbers = sorted(int(n) for n in metadata["numbers"])
        target = Fraction(int(metadata["target"]))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(
            f"countdown_reward needs metadata 'numbers' (a list of integers) and 'target' (an integer), as "
            f"CountdownTask rows have; got {dict(metadata)!r:.120} ({error!r})"
        ) from error
    expression = answer_tag(completion)
    if expression is None:
        lines = [line for line in completion.splitlines() if line.strip()]
        expression = lines[-1] if lines else ""
    literals: list[int] = []
    value = _evaluate(expression, literals)
    return float(value is not None and sorted(literals) == numbers and value == target)


def _evaluate(expression: str, literals: list[int]) -> Fraction | None:
    """The exact value of an arithmetic ``expression``, appending its integer literals to ``literals``;
    ``None`` for anything else (a name, a call, an attribute, ``**``, a float...) or a division by zero."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    try:
        with _PARSING, warnings.catch_warnings():  # a model's text such as "2if 3" warns: not worth the console
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expression.strip(), mode="eval")
        return _value(tree.body, literals)
    except (SyntaxError, ValueError, RecursionError, MemoryError, ZeroDivisionError):
        return None


def _value(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:  # not bool, float or str
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left, literals), _value(node.right, literals))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, literals)
    raise ValueError(f"not allowed in a countdown expression: {ast.dump(node)[:60]}")
