"""ScoreBatcher: samples of several groups share calls of at most batch_size, a lone group waits at most
max_wait_s for company, each group gets its own scores back in order, a cancelled group is left out without
disturbing the groups beside it, and an error reaches every group of its call."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lit_parl.rewards.score_batcher import ScoreBatcher


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))  # a lost result fails here instead of hanging the suite


def test_groups_share_calls_of_at_most_batch_size_in_their_own_order():
    calls = []

    def doubled(items):
        calls.append(list(items))
        return [2.0 * x for x in items]

    batcher = ScoreBatcher(doubled, batch_size=4, max_wait_s=60.0)  # past run()'s 10 s: only full batches may go

    async def three_groups():
        return await asyncio.gather(batcher.submit([1, 2, 3]), batcher.submit([4, 5]), batcher.submit([6, 7, 8]))

    assert run(three_groups()) == [[2.0, 4.0, 6.0], [8.0, 10.0], [12.0, 14.0, 16.0]]
    assert calls == [[1, 2, 3, 4], [5, 6, 7, 8]]  # full batches go at once; the wait never came into it
    batcher.close()


def test_a_lone_group_is_scored_after_max_wait_s():
    batcher = ScoreBatcher(lambda items: [0.5] * len(items), batch_size=64, max_wait_s=0.05)
    assert run(batcher.submit(["a", "b"])) == [0.5, 0.5]
    assert batcher.batch_sizes == [2]
    batcher.close()


def test_a_cancelled_group_leaves_the_groups_of_its_call_their_scores():
    release = threading.Event()

    def held(items):
        release.wait(10)
        return [float(len(x)) for x in items]

    batcher = ScoreBatcher(held, batch_size=4, max_wait_s=5.0)

    async def one_cancelled():
        cancelled = asyncio.ensure_future(batcher.submit(["a", "bb"]))
        kept = asyncio.ensure_future(batcher.submit(["ccc", "dddd"]))
        await asyncio.sleep(0.05)  # the call of four is running on the batcher's thread
        cancelled.cancel()
        await asyncio.sleep(0)
        release.set()
        later = await batcher.submit(["eeeee"] * 4)  # and the batcher goes on
        return await kept, later, cancelled.cancelled()

    assert run(one_cancelled()) == ([3.0, 4.0], [5.0] * 4, True)
    batcher.close()


def test_a_group_cancelled_before_its_call_is_left_out_of_it():
    calls = []
    batcher = ScoreBatcher(lambda items: calls.append(list(items)) or [1.0] * len(items), batch_size=8, max_wait_s=0.1)

    async def cancelled_early():
        gone = asyncio.ensure_future(batcher.submit(["x", "y"]))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0.3)  # past max_wait_s: its timer finds nobody waiting
        nothing_yet = list(calls)
        return nothing_yet, await batcher.submit(["z"])

    assert run(cancelled_early()) == ([], [1.0])
    assert calls == [["z"]]
    batcher.close()

    calls.clear()  # and when the next groups fill a batch before any timer: the cancelled one is not in it
    batcher = ScoreBatcher(lambda items: calls.append(list(items)) or [1.0] * len(items), batch_size=3, max_wait_s=60)

    async def cancelled_then_filled():
        gone = asyncio.ensure_future(batcher.submit(["x", "y"]))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        return await batcher.submit(["z", "w", "v"])

    assert run(cancelled_then_filled()) == [1.0, 1.0, 1.0]
    assert calls == [["z", "w", "v"]]
    batcher.close()


def test_an_error_reaches_every_group_of_its_call():
    def fails(items):
        raise RuntimeError("device lost")

    batcher = ScoreBatcher(fails, batch_size=4, max_wait_s=5.0)

    async def two_groups():
        return await asyncio.gather(batcher.submit([1, 2]), batcher.submit([3, 4]), return_exceptions=True)

    errors = run(two_groups())
    assert [str(e) for e in errors] == ["device lost", "device lost"]
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 items"):
        short = ScoreBatcher(lambda items: [0.0], batch_size=2)
        run(short.submit([1, 2]))
    batcher.close(), short.close()


def test_settings_are_checked():
    with pytest.raises(ValueError, match="batch_size=0"):
        ScoreBatcher(len, batch_size=0)
    with pytest.raises(ValueError, match="max_wait_s=-1"):
        ScoreBatcher(len, max_wait_s=-1)
