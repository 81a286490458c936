"""The prefetch thread: micro-batches received and collated beside the trainer, with nothing changed but when."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from lightning.pytorch import Callback

from helpers.components import fit, make_components, policy_state
from lit_parl import GRPOObjective
from lit_parl.rollout import HFRolloutPool
from lit_parl.tasks import CopyTask


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lit_parl-prefetch")]


def _wait_for_no_prefetch_thread(timeout_s: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout_s
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    return _prefetch_threads()


class Recorder(Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(
            (
                trainer.current_epoch,
                batch.pass_index,
                batch.sample_offset,
                list(batch.prompt_ids),
                batch.tokens.input_ids.clone(),
            )
        )


def test_prefetch_trains_bit_identical_weights_on_the_same_micro_batches():
    """Several mini-batches and passes: the thread changes when a micro-batch is built, never what is in it."""
    runs = {}
    for prefetch in (False, True):
        module, data = make_components(objective=GRPOObjective(beta=0.04), mini_batches=2, passes=2)
        data.prefetch = prefetch
        recorder = Recorder()
        fit(module, data, iterations=3, callbacks=[recorder])
        runs[prefetch] = (policy_state(module), recorder.batches, data.schedule.cursor, data.iterations_done)
    (weights_a, batches_a, cursor_a, done_a), (weights_b, batches_b, cursor_b, done_b) = runs[False], runs[True]
    assert (cursor_a, done_a) == (cursor_b, done_b) == (24, 3)
    assert len(batches_a) == len(batches_b) == 3 * 2 * 4  # iterations x passes x micro-batches
    for a, b in zip(batches_a, batches_b):
        assert a[:4] == b[:4]
        assert torch.equal(a[4], b[4])
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name


def test_prefetch_is_off_by_default_when_training_on_the_cpu():
    module, data = make_components()
    assert data.prefetch is None
    fit(module, data, iterations=1)
    assert data.prefetching is False


def test_the_next_iterations_prompts_are_tokenized_ahead_and_equal_on_demand_tokenization():
    module, data = make_components()
    data.prefetch = True
    fit(module, data, iterations=2)
    assert _wait_for_no_prefetch_thread() == []  # it tokenizes after handing out its last micro-batch
    # the prefetch thread of the last iteration tokenized the prompts the next iteration would draw
    schedule = data.schedule
    assert sorted(schedule._cache) == list(range(schedule.cursor, schedule.cursor + data.shape.prompts))
    ahead = schedule.requests(list(range(schedule.cursor, schedule.cursor + 3)), version=5)
    assert not set(ahead) & set(schedule._cache), "requests() must consume what it takes from the cache"
    _, fresh = make_components()
    assert fresh.schedule.requests(list(ahead), version=5) == ahead
    data.load_state_dict(data.state_dict())
    assert schedule._cache == {}, "a resume may move the cursor: nothing tokenized for the old one may linger"


def test_no_prefetch_thread_outlives_a_fit():
    module, data = make_components()
    data.prefetch = True
    fit(module, data, iterations=2)
    assert _wait_for_no_prefetch_thread() == []


class FailingStep(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        raise RuntimeError("boom in the trainer")


class SlowAfterFirstGroupTask(CopyTask):
    """Scores its first group at once, then takes a second per completion."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.fast_calls = group_size

    def reward(self, answer_ids, completion_ids, eos_id):
        self.fast_calls -= 1
        if self.fast_calls < 0:
            time.sleep(1.0)
        return super().reward(answer_ids, completion_ids, eos_id)


@pytest.mark.parametrize("score_workers", [0, 1])
def test_a_failing_step_stops_the_prefetch_thread_while_it_waits_for_groups(score_workers):
    """The trainer fails on its first micro-batch while the thread waits for the next group (scored in the
    thread itself, or on the scorer's threads); the failed fit closes the pool and the scorer, and the
    thread must end then, not poll for the response timeout."""
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=1, colocated_threads=1)
    module, data = make_components(
        pool=pool, prompts=4, group_size=4, micro_batch_size=4, task=SlowAfterFirstGroupTask(4)
    )
    data.prefetch = True
    data.scorer.workers = score_workers
    with pytest.raises(RuntimeError, match="boom in the trainer"):
        fit(module, data, iterations=1, callbacks=[FailingStep()])
    assert not pool.health().started
    assert _wait_for_no_prefetch_thread(timeout_s=15.0) == []


def test_closing_the_consumer_stops_the_prefetch_thread_between_items():
    from lit_parl.data.head_start import prefetched

    def endless():  # a producer that never ends by itself: only the stop flag ends the thread
        while True:
            time.sleep(0.01)
            yield 1

    before = set(_prefetch_threads())
    stream = prefetched(endless(), "lit_parl-prefetch-unit")
    assert next(stream) == 1
    (thread,) = set(_prefetch_threads()) - before
    stream.close()
    thread.join(timeout=2.0)
    assert not thread.is_alive(), "the prefetch thread outlived its consumer"


def test_an_error_in_the_prefetch_thread_is_raised_in_the_consumer():
    from lit_parl.data.head_start import prefetched

    def failing():
        yield 1
        raise KeyError("in the thread")

    stream = prefetched(failing(), "lit_parl-prefetch-unit")
    assert next(stream) == 1
    with pytest.raises(KeyError, match="in the thread"):
        next(stream)
