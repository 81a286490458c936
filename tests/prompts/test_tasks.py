"""The procedural digit tasks and their positional reward, against hand-computed values."""

from __future__ import annotations

import pytest

from lit_parl.tasks import CopyTask, ReverseTask, positional_reward


def _ids(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text).input_ids)


EOS = 1


@pytest.mark.parametrize(
    "answer, completion, expected",
    [
        ([5, 6], [5, 6, EOS], 1.0),  # exact answer then the end token
        ([5, 6], [5, 6], 2 / 3),  # truncated: 2 matches of target [5, 6, eos]
        ([5, 6], [5, 6, 7], 2 / 3),  # cut at the limit with an extra token, no eos: 2 of max(3, 3)
        ([5, 6], [5, 6, 7, EOS], 2 / 4),  # one extra token before eos: output longer than target
        ([5, 6], [5, 6, 7, 8, 9, 9], 2 / 6),  # runaway completion without eos
        ([5, 6], [5, 6, EOS, 9, 9, 9], 1.0),  # tokens after the end token are ignored
        ([5, 6], [5, 6, EOS, EOS], 1.0),  # only the first end token counts
        ([5, 6], [5, 7, EOS, 6, 6], 2 / 3),  # truncated at the first eos, then scored
        ([5, 6], [], 0.0),  # empty completion
        ([5, 6], [EOS], 0.0),  # stopping at once: eos is at the wrong position
        ([5, 6], [5], 1 / 3),  # one correct token, no eos
        ([5, 6], [9], 0.0),  # one wrong token
        ([5, 6], [5, 9, EOS], 2 / 3),  # wrong digit: partial credit
        ([5, 6], [9, 6, EOS], 2 / 3),
        ([5, 6], [6, 5, EOS], 1 / 3),  # swapped digits: only the eos slot matches
        ([5, 6, 7, 8], [5, 6, EOS], 2 / 5),  # stopped early: 2 matches of target length 5
        ([5, 6, 7, 8], [5, 0, 7, 0, EOS], 3 / 5),
        ([], [EOS], 1.0),  # empty answer: the end token alone is right
        ([], [3, EOS], 0.0),
    ],
)
def test_positional_reward_hand_computed(answer, completion, expected):
    assert positional_reward(answer, completion, EOS) == pytest.approx(expected, abs=1e-12)


def test_positional_reward_never_one_without_eos():
    for completion in ([5, 6], [5, 6, 5, 6], [5, 6, 0, 0, 0, 0]):
        assert positional_reward([5, 6], completion, EOS) < 1.0


def test_task_reward_uses_positional_reward(tok):
    task = ReverseTask(seed=3)
    prompt, answer = task.make(0)
    answer_ids = list(_ids(tok, answer))
    assert task.reward(answer_ids, [*answer_ids, tok.eos_token_id], tok.eos_token_id) == 1.0
    assert task.reward(answer_ids, answer_ids, tok.eos_token_id) < 1.0


@pytest.mark.parametrize("task_cls, transform", [(CopyTask, lambda d: d), (ReverseTask, lambda d: d[::-1])])
def test_digit_tasks_deterministic_and_well_formed(task_cls, transform):
    task = task_cls(min_digits=2, max_digits=5, seed=7)
    again = task_cls(min_digits=2, max_digits=5, seed=7)
    other = task_cls(min_digits=2, max_digits=5, seed=8)
    lengths = set()
    for i in range(200):
        prompt, answer = task.make(i)
        assert (prompt, answer) == again.make(i) == task.make(i)  # same seed and index: same prompt
        assert prompt.endswith("=")
        digits = prompt[:-1]
        assert digits.isdigit() and set(digits) <= set("0123456789")
        assert 2 <= len(digits) <= 5
        assert answer == transform(digits)
        lengths.add(len(digits))
    assert lengths == {2, 3, 4, 5}, "every length in [min, max] should occur in 200 prompts"
    assert sum(task.make(i) != other.make(i) for i in range(50)) > 25, "another seed must give other prompts"
    assert len({task.make(i) for i in range(200)}) > 100, "prompts of different indices must differ"
    assert task.max_answer_tokens() == 5


def test_digit_task_single_length():
    task = CopyTask(min_digits=3, max_digits=3, seed=0)
    assert all(len(task.make(i)[1]) == 3 for i in range(20))


@pytest.mark.parametrize("task_cls", [CopyTask, ReverseTask])
@pytest.mark.parametrize("min_digits, max_digits", [(0, 3), (-1, 2), (5, 4), (0, 0)])
def test_digit_task_invalid_lengths_raise(task_cls, min_digits, max_digits):
    with pytest.raises(ValueError):
        task_cls(min_digits=min_digits, max_digits=max_digits)
