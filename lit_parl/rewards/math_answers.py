"""Math answers: extract the final answer (GSM8K ``#### x``, MATH ``\\boxed{x}``) and check it with math-verify.

The reference answer and the completion's answer are both parsed by ``math_verify.parse`` into SymPy and
compared with ``math_verify.verify``, so ``42``, ``42.0`` and ``84/2`` are one answer, as are
``\\frac{1}{2}`` and ``0.5``. When neither side parses, the two texts must be equal (whitespace aside).

Threads: math-verify bounds its work with ``signal.alarm`` by default, which raises in any thread but the
main one, and rewards are scored in worker threads. So every call here passes ``parsing_timeout=None`` and
``timeout_seconds=None`` (math-verify's switch for "no signal timeout"), and this module bounds the work
itself: an extracted answer longer than ``MAX_ANSWER_CHARS`` scores 0, and so does one holding a power,
factorial or other function whose value lies outside ``[10**-MAX_DIGITS, 10**MAX_DIGITS]`` (such as
``9^{9^{9}}``, which SymPy would otherwise compute exactly, for hours). Checking that magnitude costs a
15-digit float evaluation (``evalf``), never the exact value.

Example::

    >>> gsm8k_answer("She pays 2 * 21 = 42 dollars.\\n#### 1,042")
    '1042'
    >>> boxed_answer("so $x = \\\\boxed{\\\\frac{1}{2}}$.")
    '\\\\frac{1}{2}'
    >>> gsm8k_reward(completion="... #### 84/2", answer="6 * 7 = 42\\n#### 42")
    1.0
    >>> boxed_reward(completion="The answer is $\\\\boxed{0.5}$", answer="\\\\frac{1}{2}")
    1.0
    >>> math_reward(completion="#### 41", answer="\\\\boxed{42}")
    0.0
"""

from __future__ import annotations

import functools
import logging
import re

import sympy

from lit_parl.extras import require

require("math_verify", "math", "the math and gsm8k rewards (lit_parl.rewards.math_answers)")
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify  # noqa: E402

MAX_ANSWER_CHARS = 1000  # longer extracted answers score 0: parsing time grows with the text
MAX_DIGITS = 1000  # a power/function of the answer must lie in [1e-1000, 1e1000] (see the module docstring)

_BOXED = re.compile(r"\\boxed\s*\{")
_GSM8K = re.compile(r"####[ \t]*([^\n]*)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_LATEX = (LatexExtractionConfig(),)
_LATEX_OR_EXPR = (LatexExtractionConfig(), ExprExtractionConfig())
_LIMIT = sympy.Float(f"1e{MAX_DIGITS}")


class _TimeoutDisabledFilter(logging.Filter):
    """Drops math-verify's one-time "timeout is disabled" warning: disabling it is deliberate here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_TimeoutDisabledFilter())


def gsm8k_answer(text: str) -> str | None:
    """The text after the last ``####`` up to the end of its line, thousands separators removed;
    ``None`` when there is no ``####`` or nothing follows it."""
    matches = _GSM8K.findall(text)
    if not matches:
        return None
    answer = _THOUSANDS.sub("", matches[-1]).strip()
    return answer or None


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested and escaped braces handled); ``None`` when there is
    none, when it is empty, or when the last one is never closed (a cut-off completion has no answer)."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # \{ and \} are literal braces, not grouping
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1] : i].strip() or None
        i += 1
    return None


def gsm8k_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's ``#### x`` equals the answer (a full GSM8K solution or the bare answer)."""
    gold = _gold(answer, "gsm8k_reward", boxed=False)
    predicted = gsm8k_answer(completion)
    return float(predicted is not None and _equivalent(gold, _parsed(predicted, latex=False)))


def boxed_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's last ``\\boxed{x}`` equals the answer (``\\boxed{..}``, a full MATH
    solution, or bare LaTeX)."""
    gold = _gold(answer, "boxed_reward", boxed=True)
    predicted = boxed_answer(completion)
    return float(predicted is not None and _equivalent(gold, _parsed(predicted, latex=True)))


def math_reward(completion: str, answer: str, fallback_last_number: bool = False) -> float:
    """1.0 when the completion's answer equals the answer, in either format.

    The completion's answer is its last ``\\boxed{}``, else its last ``#### x``. With
    ``fallback_last_number`` (bind it with ``functools.partial`` or Hydra's ``_partial_``), a completion
    with neither is judged by its last number, as lm-evaluation-harness's "flexible-extract" GSM8K filter
    does; it is off by default because in RL it pays for answers given without the asked-for format.
    The reference answer is read the same way (its ``\\boxed{}``, else ``####``, else the text as LaTeX).
    """
    gold = _gold(answer, "math_reward", boxed=True)
    if (predicted := boxed_answer(completion)) is not None:
        return float(_equivalent(gold, _parsed(predicted, latex=True)))
    if (predicted := gsm8k_answer(completion)) is None and fallback_last_number:
        numbers = _LAST_NUMBER.findall(completion)
        predicted = _THOUSANDS.sub("", numbers[-1]) if numbers else None
    return float(predicted is not None and _equivalent(gold, _parsed(predicted, latex=False)))


def _gold(answer: str | None, reward: str, boxed: bool) -> tuple:
    """The reference answer, parsed; a ValueError naming the problem when a row's answer is unusable.

    ``boxed``: its last ``\\boxed{}`` first, and bare text is LaTeX; else bare text is read as free text.
    """
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError(
            f"{reward}: the row's answer is {answer!r}; it needs the reference answer as text "
            "(give the prompt source an answer column, e.g. '#### 42', '\\boxed{42}' or '42')"
        )
    if boxed and (text := boxed_answer(answer)) is not None:
        parsed = _parsed(text, latex=True)
    elif (text := gsm8k_answer(answer)) is not None:
        parsed = _parsed(text, latex=False)
    elif "####" in answer or (boxed and _BOXED.search(answer)):
        raise ValueError(f"{reward}: the row's answer {answer!r:.80} has a '####' or '\\boxed{{' with no answer in it")
    else:
        text = answer.strip()
        parsed = _parsed(text if boxed else _THOUSANDS.sub("", text), latex=boxed)
    if parsed is None:
        raise ValueError(f"{reward}: the row's answer {text!r:.80} is too long or too large to compare safely")
    return parsed


@functools.lru_cache(maxsize=4096)  # the reference answer is parsed again for every sample of its group
def _parsed(text: str, latex: bool) -> tuple | None:
    """``(text, parsed objects)``; ``None`` when the text is too long or holds a value too large to compare.

    ``latex``: read the text as the content of ``\\boxed{}`` (MATH answers are LaTeX); else as
    math-verify reads free text (LaTeX or a plain number/expression; a ``#### x`` answer).
    """
    if len(text) > MAX_ANSWER_CHARS:
        return None
    if latex:
        objects = parse(f"\\boxed{{{text}}}", extraction_config=_LATEX, parsing_timeout=None)
    else:
        objects = parse(text, extraction_config=_LATEX_OR_EXPR, parsing_timeout=None)
    if not all(_bounded(obj) for obj in objects):
        return None
    return text, tuple(objects)


def _bounded(obj) -> bool:
    """False when a power or function inside ``obj`` has a value beyond ``10**±MAX_DIGITS`` (judged by a
    float evaluation, innermost first), so that comparing it exactly could run for hours."""
    if not isinstance(obj, sympy.Basic):
        return True  # a string fallback, or a matrix math-verify compares entry by entry
    try:
        for node in sympy.postorder_traversal(obj):
            if isinstance(node, (sympy.Pow, sympy.Function)) and not node.free_symbols:
                magnitude = abs(node.evalf(15))
                if magnitude.is_Number and magnitude != 0 and not (1 / _LIMIT < magnitude < _LIMIT):
                    return False
    except (ArithmeticError, TypeError, ValueError, RecursionError):
        return False
    return True


def _equivalent(gold: tuple, predicted: tuple | None) -> bool:
    if predicted is None:
        return False
    (gold_text, gold_objects), (text, objects) = gold, predicted
    if gold_objects and objects:
        return verify(list(gold_objects), list(objects), timeout_seconds=None)
    return " ".join(gold_text.split()) == " ".join(text.split())
