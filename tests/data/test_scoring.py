"""GroupScorer: inline and threaded scoring give the same groups; with threads, a slow reward does not
hold up reading the pool, and a group whose score is ready never waits behind a slow one; a failing
reward reaches the consumer; rewards that read no text never decode."""

from __future__ import annotations

import threading
import time

import pytest

from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rewards import Reward, RewardError
from lit_parl.rollout.records import GroupCompletions
from lit_parl.tasks import CopyTask, positional_reward

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


def _drawn(n: int):
    return PromptSchedule(CopyTask(seed=0), TOKENIZER, group_size=2).draw(list(range(n)), version=0)


def _completions(n: int) -> list[GroupCompletions]:
    drawn = _drawn(n)
    out = []
    for i in range(n):
        answer = list(drawn[i].answer_ids)
        out.append(
            GroupCompletions(
                i,
                0,
                [0, 1],
                [[*answer, EOS], [answer[0], EOS]],
                [[-0.1] * (len(answer) + 1), [-0.2] * 2],
                ["stop", "stop"],
            )
        )
    return out


def slow_positional(answer_ids, completion_ids, eos_id, delay_s=0.15):
    time.sleep(delay_s)
    return positional_reward(answer_ids, completion_ids, eos_id)


def failing(completion_ids):
    raise ZeroDivisionError("the verifier failed")


@pytest.mark.parametrize("workers", [1, 3])
def test_threaded_scoring_gives_the_same_groups_as_inline(workers):
    inline = {
        g.prompt_id: g
        for g in GroupScorer([positional_reward], TOKENIZER, workers=0).stream(iter(_completions(12)), _drawn(12))
    }
    scorer = GroupScorer([positional_reward], TOKENIZER, workers=workers)
    threaded = {g.prompt_id: g for g in scorer.stream(iter(_completions(12)), _drawn(12))}
    scorer.close()
    assert inline == threaded and len(inline) == 12
    answer = list(_drawn(1)[0].answer_ids)
    assert inline[0].rewards == [1.0, positional_reward(answer, [answer[0], EOS], EOS)] and inline[0].rewards[1] < 1.0


def test_with_threads_a_slow_reward_does_not_hold_up_reading_the_pool():
    pulled: list[float] = []

    def pool_stream():
        for group in _completions(4):
            pulled.append(time.monotonic())
            yield group

    scorer = GroupScorer([slow_positional], TOKENIZER, workers=2)  # 0.3 s per group, two at a time
    start = time.monotonic()
    first = next(scorer.stream(pool_stream(), _drawn(4)))
    waited = time.monotonic() - start
    scorer.close()
    assert first.prompt_id in (0, 1) and waited >= 0.25
    # every group was read from the pool while the first one was still being scored
    assert len(pulled) == 4 and pulled[-1] - start < 0.2, (
        f"the pool was read at {[round(p - start, 3) for p in pulled]} s"
    )


def test_a_failing_reward_is_raised_in_the_consumer():
    for workers in (0, 2):
        scorer = GroupScorer([failing], TOKENIZER, workers=workers)
        with pytest.raises(
            RewardError,
            match=r"(?s)reward 'failing' raised ZeroDivisionError.*on prompt \d+, sample 0.*the verifier failed",
        ):
            list(scorer.stream(iter(_completions(3)), _drawn(3)))
        scorer.close()


def test_a_consumer_that_stops_early_stops_the_reader():
    def endless():
        yield from _completions(2)
        while True:  # a pool whose next group never comes: only the stop flag or closing it ends the reader
            time.sleep(0.01)
            yield _completions(1)[0]

    def readers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "lit_parl-pool-reader"}

    before = readers()
    scorer = GroupScorer([positional_reward], TOKENIZER, workers=1)
    stream = scorer.stream(endless(), _drawn(2))
    next(stream)
    (reader,) = readers() - before
    stream.close()
    reader.join(timeout=2.0)  # without its stop flag the reader would pull from `endless` for ever
    assert not reader.is_alive(), "the reader outlived its consumer"
    scorer.close()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match=r"GroupScorer\(workers=-1\)"):
        GroupScorer([positional_reward], TOKENIZER, workers=-1)
    with pytest.raises(TypeError, match="a reward is a callable"):
        GroupScorer([object()], TOKENIZER)
    with pytest.raises(ValueError, match="share a name"):
        GroupScorer([positional_reward, Reward(slow_positional, name="positional_reward")], TOKENIZER)


def test_a_ready_group_never_waits_behind_a_slow_reward():
    """Group 0's reward is slow; group 1's, ready later from the pool, leaves first."""

    def slow_on_first(prompt_id, completion_ids):
        time.sleep(0.5 if prompt_id == 0 else 0.0)
        return 1.0

    scorer = GroupScorer([slow_on_first], TOKENIZER, workers=2)
    start = time.monotonic()
    stream = scorer.stream(iter(_completions(2)), _drawn(2))
    first = next(stream)
    assert first.prompt_id == 1 and time.monotonic() - start < 0.4
    assert next(stream).prompt_id == 0
    scorer.close()


def test_text_is_decoded_only_for_rewards_that_read_it():
    seen = []

    def reads_text(completion, prompt, stopped, answer):
        seen.append((prompt, completion, stopped, answer))
        return 0.0

    drawn = _drawn(1)
    inputs = GroupScorer([positional_reward], TOKENIZER).inputs(drawn[0], _completions(1)[0])
    assert "completion" not in inputs[0]  # nobody reads it: never decoded
    GroupScorer([reads_text], TOKENIZER).score(drawn[0], _completions(1)[0])
    row = drawn[0].row
    assert seen[0] == (
        row.prompt,
        row.answer,
        True,
        row.answer,
    )  # the completion is the answer + the end token, decoded without it


def test_a_reward_that_edits_its_inputs_changes_nothing_trained_or_shared():
    def strips_end(completion_ids, metadata):
        completion_ids.pop()
        metadata["seen"] = True
        return 0.0

    completions = _completions(1)[0]
    before = [list(c) for c in completions.completions]
    drawn = _drawn(1)
    group = GroupScorer([strips_end], TOKENIZER).score(drawn[0], completions)
    assert group.completions == before and "seen" not in drawn[0].row.metadata
