"""ScoreBatcher: one batched call for the samples of several groups, gathered as they arrive.

A learned reward (a reward model's forward) costs far less per sample in a batch than one sample at a time, but
the scorer hands it one group at a time. Groups scored at once (``GroupScorer`` with several workers) each
``submit`` their samples here, on the rewards' event loop; the batcher calls ``score_fn`` on a thread of its own
(the model's: the loop stays free to gather the next batch) when ``batch_size`` samples wait or when the oldest has
waited ``max_wait_s``, whichever comes first, and each group gets back its own scores in its own order.

A group whose call was cancelled (its scoring timed out) is left out of the batches still to come; a batch
already running finishes, and its results for that group are dropped. An error in ``score_fn`` fails every
group with a sample in that batch (the scoring policy then decides, group by group).

Example::

    >>> import asyncio
    >>> calls = []
    >>> def lengths(texts):
    ...     calls.append(len(texts))
    ...     return [float(len(t)) for t in texts]
    >>> batcher = ScoreBatcher(lengths, batch_size=4, max_wait_s=0.05)
    >>> async def two_groups():
    ...     return await asyncio.gather(batcher.submit(["a", "bb"]), batcher.submit(["ccc", "dddd"]))
    >>> asyncio.run(two_groups()), calls
    ([[1.0, 2.0], [3.0, 4.0]], [4])
    >>> batcher.close()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Waiting:
    item: Any
    future: asyncio.Future


class ScoreBatcher:
    """Gathers submitted samples into calls of at most ``batch_size``.

    Args:
        score_fn: scores a list of items, returning one number per item; runs on the batcher's own thread.
        batch_size: the most items in one call (a call is made as soon as this many wait).
        max_wait_s: how long the oldest waiting item may wait for others before its call is made anyway.
        thread_name: the name of the thread that runs ``score_fn`` (seen in profiles and ``py-spy``).
    """

    def __init__(
        self,
        score_fn: Callable[[list], Sequence[float]],
        batch_size: int = 32,
        max_wait_s: float = 0.05,
        thread_name: str = "lit_parl-score-batch",
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"ScoreBatcher(batch_size={batch_size}) must be >= 1")
        if not max_wait_s >= 0:
            raise ValueError(f"ScoreBatcher(max_wait_s={max_wait_s}) must be >= 0 seconds")
        self.score_fn = score_fn
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self.batch_sizes: list[int] = []  # every call's size, in order (what the cost benchmark reports)
        self._waiting: list[_Waiting] = []
        self._timer: asyncio.TimerHandle | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=thread_name)

    async def submit(self, items: Sequence) -> list[float]:
        """Each item's score, in order; the items may be scored in one call with other groups' items."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._waiting.extend(_Waiting(item, future) for item, future in zip(items, futures))
        self._schedule(loop)
        try:
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()  # left out of the calls still to come
            raise

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waiting = [w for w in self._waiting if not w.future.done()]
        while len(self._waiting) >= self.batch_size:
            batch, self._waiting = self._waiting[: self.batch_size], self._waiting[self.batch_size :]
            self._start(loop, batch)
        if not self._waiting and self._timer is not None:
            self._timer.cancel()  # nothing left to wait for
            self._timer = None
        elif self._waiting and self._timer is None:
            self._timer = loop.call_later(self.max_wait_s, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._waiting = [w for w in self._waiting if not w.future.done()]
        if self._waiting:
            batch, self._waiting = self._waiting, []
            self._start(loop, batch)

    def _start(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting]) -> None:
        self.batch_sizes.append(len(batch))
        items = [w.item for w in batch]
        call = loop.run_in_executor(self._executor, self._score, items)
        call.add_done_callback(lambda done: self._finish(batch, done))

    def _score(self, items: list) -> list[float]:
        scores = list(self.score_fn(items))
        if len(scores) != len(items):
            raise RuntimeError(f"the scoring function returned {len(scores)} scores for {len(items)} items")
        return scores

    @staticmethod
    def _finish(batch: list[_Waiting], done: asyncio.Future) -> None:
        error = done.exception()
        for k, waiting in enumerate(batch):
            if waiting.future.done():  # its group was cancelled (timed out) while the call ran
                continue
            if error is not None:
                waiting.future.set_exception(error)
            else:
                waiting.future.set_result(done.result()[k])

    def close(self) -> None:
        """Stop the batcher's thread (a call still running finishes first)."""
        self._executor.shutdown(wait=True)
