"""GroupScorer: inline and threaded scoring give the same groups; with threads, a slow reward does not
hold up reading the pool; a failing reward reaches the consumer."""

from __future__ import annotations

import threading
import time

import pytest

from lit_parl.data.scoring import GroupScorer
from lit_parl.tasks import CopyTask
from lit_parl.trajectory import GroupCompletions, GroupRequest

EOS = 1


def _requests(n: int) -> dict[int, GroupRequest]:
    return {i: GroupRequest(prompt_id=i, prompt_tokens=(4, 5), answer_tokens=(4 + i % 3, 5), version=0, seeds=(1, 2)) for i in range(n)}


def _completions(n: int) -> list[GroupCompletions]:
    return [GroupCompletions(i, 0, [0, 1], [[4 + i % 3, 5, EOS], [4, EOS]], [[-0.1] * 3, [-0.2] * 2], ["stop", "stop"]) for i in range(n)]


class SlowTask(CopyTask):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def reward(self, answer_ids, completion_ids, eos_id):
        time.sleep(self.delay_s)
        return super().reward(answer_ids, completion_ids, eos_id)


class FailingTask(CopyTask):
    def reward(self, answer_ids, completion_ids, eos_id):
        raise ZeroDivisionError("the verifier failed")


@pytest.mark.parametrize("workers", [1, 3])
def test_threaded_scoring_gives_the_same_groups_as_inline(workers):
    inline = {g.prompt_id: g for g in GroupScorer(CopyTask(), EOS, workers=0).stream(iter(_completions(12)), _requests(12))}
    scorer = GroupScorer(CopyTask(), EOS, workers=workers)
    threaded = {g.prompt_id: g for g in scorer.stream(iter(_completions(12)), _requests(12))}
    scorer.close()
    assert inline == threaded and len(inline) == 12
    assert inline[0].rewards == [1.0, CopyTask().reward([4, 5], [4, EOS], EOS)]


def test_with_threads_a_slow_reward_does_not_hold_up_reading_the_pool():
    pulled: list[float] = []

    def pool_stream():
        for group in _completions(4):
            pulled.append(time.monotonic())
            yield group

    scorer = GroupScorer(SlowTask(delay_s=0.15), EOS, workers=2)  # 0.3 s per group, two at a time
    start = time.monotonic()
    first = next(scorer.stream(pool_stream(), _requests(4)))
    waited = time.monotonic() - start
    scorer.close()
    assert first.prompt_id in (0, 1) and waited >= 0.25
    # every group was read from the pool while the first one was still being scored
    assert len(pulled) == 4 and pulled[-1] - start < 0.2, f"the pool was read at {[round(p - start, 3) for p in pulled]} s"


def test_a_failing_reward_is_raised_in_the_consumer():
    for workers in (0, 2):
        scorer = GroupScorer(FailingTask(), EOS, workers=workers)
        with pytest.raises(ZeroDivisionError, match="the verifier failed"):
            list(scorer.stream(iter(_completions(3)), _requests(3)))
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
    scorer = GroupScorer(CopyTask(), EOS, workers=1)
    stream = scorer.stream(endless(), _requests(2))
    next(stream)
    (reader,) = readers() - before
    stream.close()
    reader.join(timeout=2.0)  # without its stop flag the reader would pull from `endless` for ever
    assert not reader.is_alive(), "the reader outlived its consumer"
    scorer.close()


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match=r"GroupScorer\(workers=-1\)"):
        GroupScorer(CopyTask(), EOS, workers=-1)
    with pytest.raises(TypeError, match="reward"):
        GroupScorer(object(), EOS)
