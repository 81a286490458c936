"""The built-in rewards over text: math answers (math-verify), tag format, and the countdown task.

Every reward is called the way the scorer calls it: ``Reward(fn).call({...})``, keywords by field name.
"""

from __future__ import annotations

import functools
import itertools
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest
from omegaconf import OmegaConf

from lit_parl.prompts.prompt_row import PromptSource
from lit_parl.rewards import Reward
from lit_parl.rewards import math_answers as math_rewards
from lit_parl.rewards.format import answer_tag, tag_format_reward
from lit_parl.rewards.math_answers import boxed_answer, boxed_reward, gsm8k_answer, gsm8k_reward, math_reward
from lit_parl.tasks import CountdownTask, countdown_reward


def score(fn, **inputs) -> float:
    """One sample's value, called as the scorer calls a reward."""
    reward = Reward(fn)
    (value,) = reward.values(reward.call(inputs)).values()
    return value


# ---------------------------------------------------------------- math: extraction


def test_gsm8k_answer_is_the_last_hash_answer_without_thousands_commas():
    assert gsm8k_answer("Natalia sold 48/2 = 24 clips.\n#### 1,234,567") == "1234567"
    assert gsm8k_answer("#### 7\nno, wait\n#### 72 \nthanks") == "72"
    assert gsm8k_answer("#### 3.5") == "3.5"
    assert gsm8k_answer("the answer is 42") is None
    assert gsm8k_answer("#### \n") is None


def test_boxed_answer_is_the_last_box_with_nested_braces():
    assert boxed_answer(r"so $\boxed{\frac{1}{\sqrt{2}}}$ and done") == r"\frac{1}{\sqrt{2}}"
    assert boxed_answer(r"first \boxed{1}, then \boxed{ 2 }") == "2"
    assert boxed_answer(r"the set \boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert boxed_answer(r"\boxed{\left\{ x \right.}") == r"\left\{ x \right."  # an escaped brace is not a group
    assert boxed_answer(r"\boxed {5}") == "5"
    assert boxed_answer("no box here") is None
    assert boxed_answer(r"\boxed{1} then cut off \boxed{\frac{1}{2}") is None  # the final answer never closed
    assert boxed_answer(r"\boxed{ }") is None


# ---------------------------------------------------------------- math: equivalence


@pytest.mark.parametrize("answer", ["Half of 84 is 84/2 = 42.\n#### 42", "42", "42.0"])
@pytest.mark.parametrize("completion", ["... so #### 42", "#### 42.0", "#### 84/2", "#### $42", "#### 42 dollars"])
def test_gsm8k_reward_matches_equal_numbers(completion, answer):
    assert score(gsm8k_reward, completion=completion, answer=answer) == 1.0


def test_gsm8k_reward_compares_numbers_with_thousands_commas():
    assert score(gsm8k_reward, completion="#### 1,500", answer="1500") == 1.0
    assert score(gsm8k_reward, completion="#### 1500", answer="#### 1,500") == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"The answer is $\boxed{0.5}$.", r"\frac{1}{2}"),
        (r"$\boxed{\dfrac{1}{2}}$", r"We get $\boxed{0.5}$."),
        (r"\boxed{\frac{84}{2}}", r"\boxed{42}"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{2^{10}}", "1024"),  # a modest power is compared, not refused
        (r"\boxed{10,080}", r"\boxed{10080}"),
    ],
)
def test_boxed_reward_matches_equivalent_latex(completion, answer):
    assert score(boxed_reward, completion=completion, answer=answer) == 1.0


@pytest.mark.parametrize(
    "fn, completion, answer",
    [
        (gsm8k_reward, "#### 41", "#### 42"),
        (gsm8k_reward, "#### 42.5", "42"),
        (boxed_reward, r"\boxed{43}", r"\boxed{42}"),
        (boxed_reward, r"\boxed{\sqrt{2}}", "2"),  # LaTeX is read whole, never as its first number
        (boxed_reward, r"\boxed{\frac{1}{3}}", "0.5"),
        (math_reward, r"\boxed{41}", "#### 42"),
    ],
)
def test_a_wrong_answer_scores_zero(fn, completion, answer):
    assert score(fn, completion=completion, answer=answer) == 0.0


@pytest.mark.parametrize("fn", [gsm8k_reward, boxed_reward, math_reward])
def test_no_answer_in_the_completion_scores_zero(fn):
    assert score(fn, completion="I think it is 42, maybe.", answer="42") == 0.0
    assert score(fn, completion="", answer="42") == 0.0


def test_answers_that_are_not_math_are_compared_as_text():
    assert score(gsm8k_reward, completion="#### no  way", answer="#### no way") == 1.0
    assert score(gsm8k_reward, completion="#### no", answer="#### no way") == 0.0


def test_gsm8k_and_boxed_rewards_read_only_their_own_format():
    assert score(gsm8k_reward, completion=r"\boxed{42}", answer="42") == 0.0
    assert score(boxed_reward, completion="#### 42", answer="42") == 0.0


def test_math_reward_reads_either_format_box_first():
    assert score(math_reward, completion="#### 42", answer=r"Thus $\boxed{42}$.") == 1.0
    assert score(math_reward, completion=r"\boxed{\frac12}", answer="0.5") == 1.0
    assert score(math_reward, completion=r"#### 41, no: \boxed{42}", answer="#### 42") == 1.0
    assert score(math_reward, completion=r"\boxed{41} #### 42", answer="42") == 0.0


def test_math_reward_takes_the_last_number_only_when_asked():
    last_number = functools.partial(math_reward, fallback_last_number=True)
    assert score(math_reward, completion="3 + 39 makes 42", answer="42") == 0.0
    assert score(last_number, completion="3 + 39 makes 42", answer="42") == 1.0
    assert score(last_number, completion="about 1,042 in all", answer="1042") == 1.0
    assert score(last_number, completion="42, or rather 41", answer="42") == 0.0
    assert score(last_number, completion="no number", answer="42") == 0.0


@pytest.mark.parametrize(
    "fn, answer",
    [(fn, answer) for fn in (gsm8k_reward, boxed_reward, math_reward) for answer in (None, "", "  ", "#### ")]
    + [(boxed_reward, r"see \boxed{42"), (math_reward, r"see \boxed{42")],  # gsm8k_reward reads no boxes
)
def test_an_unusable_reference_answer_is_a_clear_error(fn, answer):
    with pytest.raises(ValueError, match="the row's answer"):
        score(fn, completion="#### 42", answer=answer)


@pytest.mark.parametrize(
    "fn, completion",
    [
        (boxed_reward, r"\boxed{9^{9^{9}}}"),
        (boxed_reward, r"\boxed{2^{2^{30}} - 2^{2^{30}} + 42}"),  # equal to 42, but only after an exact power
        (boxed_reward, r"\boxed{(10^{10})!}"),
        (boxed_reward, r"\boxed{\left(\frac{1}{2}\right)^{9^{9}}}"),  # tiny is as costly as huge
        (gsm8k_reward, "#### 9^9^9"),
        (math_reward, r"\boxed{" + "0 + " * 300 + "42}"),  # equal to 42, but past MAX_ANSWER_CHARS
    ],
)
def test_an_answer_too_large_to_compare_scores_zero(fn, completion):
    # without the bound, SymPy computes most of these exactly, for hours: this test then never ends
    assert score(fn, completion=completion, answer="42") == 0.0


def test_a_reference_answer_too_large_to_compare_is_a_clear_error():
    with pytest.raises(ValueError, match="too long or too large"):
        score(boxed_reward, completion=r"\boxed{1}", answer=r"\boxed{9^{9^{9}}}")


def test_math_rewards_run_in_worker_threads():
    # math-verify's default timeout uses signal.alarm, which raises outside the main thread
    math_rewards._parsed.cache_clear()  # every parse below happens in a worker thread
    cases = []
    for i in range(12):
        cases += [
            (gsm8k_reward, {"completion": f"#### {2 * (7100 + i)}/2", "answer": f"#### {7100 + i}"}, 1.0),
            (boxed_reward, {"completion": rf"\boxed{{\frac{{{7200 + i}}}{{2}}}}", "answer": f"{(7200 + i) / 2}"}, 1.0),
            (math_reward, {"completion": rf"\boxed{{{7300 + i}}}", "answer": f"#### {7301 + i}"}, 0.0),
        ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        values = list(pool.map(lambda case: Reward(case[0]).call(case[1]), cases))
    assert values == [expected for _, _, expected in cases]


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion",
    [
        "<think>2 + 2 is 4</think><answer>4</answer>",
        "\n <think>\nfirst 2,\nthen 4\n</think>\n\n<answer> 4 </answer>\n",
    ],
)
def test_tag_format_accepts_think_then_answer(completion):
    assert score(tag_format_reward, completion=completion) == 1.0


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>4</answer><think>2 + 2</think>",  # out of order
        "<think>2 + 2</think>",  # no answer
        "<think>2</think><think>+2</think><answer>4</answer>",  # a tag twice
        "<think>2 + 2 <answer>4</answer></think><answer>4</answer>",  # a tag inside another
        "Sure! <think>2 + 2</think><answer>4</answer>",  # text before
        "<think>2 + 2</think>so<answer>4</answer>",  # text between
        "<think>2 + 2</think><answer>4</answer> Done.",  # text after
        "<think>2 + 2</think><answer>4",  # not closed
        "",
    ],
)
def test_tag_format_rejects_anything_else(completion):
    assert score(tag_format_reward, completion=completion) == 0.0


def test_tag_format_takes_other_tags_bound_with_partial_or_hydra():
    for tags in (("reasoning", "answer"), ["reasoning", "answer"], OmegaConf.create(["reasoning", "answer"])):
        reward = Reward(functools.partial(tag_format_reward, tags=tags))
        assert reward.fields == ("completion",)
        assert reward.call({"completion": "<reasoning>r</reasoning> <answer>a</answer>"}) == 1.0
        assert reward.call({"completion": "<think>r</think> <answer>a</answer>"}) == 0.0
    single = Reward(functools.partial(tag_format_reward, tags=("a",)))
    assert single.call({"completion": " <a>x</a> "}) == 1.0


@pytest.mark.parametrize("tags", ["answer", (), ("think", "think"), ("<think>",), ("a b",), (1, 2)])
def test_bad_tags_are_a_clear_error(tags):
    with pytest.raises(ValueError, match="tags must be"):
        tag_format_reward("<think>x</think>", tags=tags)


def test_answer_tag_is_the_last_answer_stripped():
    assert answer_tag("<answer>1</answer> no, <answer>\n 2 \n</answer>") == "2"
    assert answer_tag("<final>3</final>", tag="final") == "3"
    assert answer_tag("<answer>open") is None


# ---------------------------------------------------------------- countdown

METADATA = {"numbers": [2, 4, 8, 100], "target": 24}


def solve(numbers: list[int], target: int) -> str | None:
    """An expression over all ``numbers`` that equals ``target``, by brute force."""
    items = [(Fraction(n), str(n)) for n in numbers]

    def search(items):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j in itertools.permutations(range(len(items)), 2):
            (a, x), (b, y) = items[i], items[j]
            rest = [item for k, item in enumerate(items) if k not in (i, j)]
            options = [(a + b, f"({x} + {y})"), (a - b, f"({x} - {y})"), (a * b, f"({x} * {y})")]
            options += [(a / b, f"({x} / {y})")] if b else []
            for option in options:
                if (found := search([*rest, option])) is not None:
                    return found
        return None

    return search(items)


def test_countdown_rows_are_deterministic_in_seed_and_index():
    task = CountdownTask(seed=3)
    assert task.num_rows is None and isinstance(task, PromptSource)
    assert [task.row(i) for i in range(20)] == [CountdownTask(seed=3).row(i) for i in range(20)]
    assert [task.row(i).metadata for i in range(20)] != [CountdownTask(seed=4).row(i).metadata for i in range(20)]
    assert len({str(task.row(i).metadata) for i in range(20)}) == 20


def test_countdown_rows_state_the_numbers_and_target_and_nothing_more():
    task = CountdownTask(min_numbers=3, max_numbers=5, max_number=20, max_target=50, seed=1)
    sizes = set()
    for i in range(200):
        row = task.row(i)
        numbers, target = row.metadata["numbers"], row.metadata["target"]
        assert set(row.metadata) == {"numbers", "target"} and row.index == i and not row.is_chat
        assert row.answer == str(target) and 1 <= target <= 50 and all(1 <= n <= 20 for n in numbers)
        assert str(numbers) in row.prompt and str(target) in row.prompt and "<answer>" in row.prompt
        sizes.add(len(numbers))
    assert sizes == {3, 4, 5}


def test_countdown_rows_are_solvable_and_a_solution_scores_one():
    task = CountdownTask(seed=0)
    for i in range(15):
        metadata = task.row(i).metadata
        expression = solve(metadata["numbers"], metadata["target"])
        assert expression is not None, metadata
        assert (
            score(countdown_reward, completion=f"<think>...</think><answer>{expression}</answer>", metadata=metadata)
            == 1.0
        )


def test_countdown_reward_has_no_power_operator():
    metadata = {"numbers": [2, 4, 8], "target": 24}
    assert score(countdown_reward, completion="<answer>4 * (8 - 2)</answer>", metadata=metadata) == 1.0
    assert score(countdown_reward, completion="<answer>2 ** 4 + 8</answer>", metadata=metadata) == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>(100 - 4) / 8 * 2</answer>",
        "<answer> 2 * (100 - 4) / 8 </answer>",
        "Let me see.\n(100 - 4) / 8 * 2\n\n",  # no tag: the last line
        "<answer>-(4 - 100) / 8 * 2</answer>",  # unary minus
        "<answer>1</answer> no: <answer>(100 - 4) / 8 * 2</answer>",  # the last answer counts
    ],
)
def test_countdown_reward_accepts_a_right_expression(completion):
    assert score(countdown_reward, completion=completion, metadata=METADATA) == 1.0


@pytest.mark.parametrize(
    "expression",
    [
        "(100 - 4) / 8 * 3",  # uses 3, not 2
        "(100 - 4) / 8 + 2",  # wrong value
        "(8 - 2) * 4",  # right value, 100 missing
        "(100 - 4) / 8 * 2 + 2 - 2",  # right value, 2 used three times
        "4 * 4 + 8",  # right value, 4 reused, 2 and 100 missing
        "100 / (8 - 2 * 4)",  # division by zero
        "(100 - 4) / 8 * 2 = 24",
        "(100 - 4.0) / 8 * 2",  # a float literal
        "(100 - 4) // 8 * 2",
        "2 ** 4 + 8 + 100 * 0",
        "9 ** 9 ** 9 ** 9",
        "1" + "0" * 5000,
        "x",
        "(24).real",
        "[24][0]",
        "True * 24",
        "'24'",
        "+24",
        "(lambda: 24)()",
        "",
    ],
)
def test_countdown_reward_rejects_anything_else(expression):
    assert score(countdown_reward, completion=f"<answer>{expression}</answer>", metadata=METADATA) == 0.0


def test_countdown_reward_refuses_an_expression_past_its_length_limit():
    padded = "(100 - 4)" + " " * 300 + "/ 8 * 2"
    assert score(countdown_reward, completion=f"<answer>{padded}</answer>", metadata=METADATA) == 0.0


def test_countdown_reward_never_executes_the_completion(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for expression in [
        "__import__('os').system('touch pwned')",
        "open('pwned', 'w').write('x')",
        'exec(\'open("pwned", "w")\')',
    ]:
        assert score(countdown_reward, completion=f"<answer>{expression}</answer>", metadata=METADATA) == 0.0
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "metadata", [{}, {"numbers": [1, 2]}, {"numbers": "abc", "target": 3}, {"numbers": [1, 2], "target": None}]
)
def test_countdown_reward_names_missing_metadata(metadata):
    with pytest.raises(ValueError, match="countdown_reward needs metadata 'numbers'"):
        score(countdown_reward, completion="<answer>1 + 2</answer>", metadata=metadata)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_numbers": 1}, "min_numbers"),
        ({"min_numbers": 4, "max_numbers": 3}, "min_numbers"),
        ({"max_number": 200, "max_target": 100}, "max_number"),
        ({"max_number": 0}, "max_number"),
        ({"template": "Reach {goal} with {numbers}"}, "template"),
    ],
)
def test_countdown_task_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CountdownTask(**kwargs)


def test_countdown_rows_start_at_zero():
    with pytest.raises(IndexError, match="start at 0"):
        CountdownTask().row(-1)
