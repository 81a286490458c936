"""GroupScorer: rewards for finished groups, computed in the trainer's process.

The rollout pool only generates (``GroupCompletions``, unscored); scoring needs the task and the
tokenizer, which live with the trainer. Scoring never runs on an event loop or in a generation worker.
With ``workers >= 1`` a thread of its own reads the pool's stream and a thread pool scores groups as
they arrive, so a slow reward (a verifier, a sandbox) stalls neither generation nor the training step;
groups then leave in the order their scores finish. With ``workers=0`` each group is scored in the
consumer's thread as it arrives: for a reward of microseconds this is the fastest (the thread hops cost
more than the reward: 9% of the default job's throughput on a 2-core CPU, benchmarks/RESULTS.md).

Example::

    >>> from lit_parl.tasks import CopyTask
    >>> from lit_parl.trajectory import GroupCompletions, GroupRequest
    >>> scorer = GroupScorer(CopyTask(), eos_id=1, workers=1)
    >>> request = GroupRequest(prompt_id=0, prompt_tokens=(5, 6, 3), answer_tokens=(5, 6), version=0, seeds=(1, 2))
    >>> done = GroupCompletions(0, 0, [0, 1], [[5, 6, 1], [5, 1]], [[0.0] * 3, [0.0] * 2], ["stop", "stop"])
    >>> [group.rewards for group in scorer.stream(iter([done]), {0: request})]
    [[1.0, 0.3333333333333333]]
    >>> scorer.close()
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence, runtime_checkable

from lit_parl.data.prefetch import beside
from lit_parl.trajectory import Group, GroupCompletions, GroupRequest


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one completion from token ids: ``answer_ids`` from the schedule, ``completion_ids`` as
    sampled (the end token kept), ``eos_id`` the end token. Every task in ``lit_parl.tasks`` is one."""

    def reward(self, answer_ids: Sequence[int], completion_ids: Sequence[int], eos_id: int) -> float: ...


class GroupScorer:
    """Scores streamed groups on ``workers`` threads.

    Args:
        reward_fn: a ``RewardFunction`` (a task).
        eos_id: the end token the rewards look for.
        workers: threads that score concurrently (rewards that release the GIL, or wait on a verifier,
            gain from more than one); 0 scores inline in the consumer's thread, with no thread of its own.
    """

    def __init__(self, reward_fn: RewardFunction, eos_id: int, workers: int = 0) -> None:
        if not isinstance(reward_fn, RewardFunction):
            raise TypeError(f"GroupScorer(reward_fn={type(reward_fn).__name__}): needs a reward(answer_ids, completion_ids, eos_id) method")
        if workers < 0:
            raise ValueError(f"GroupScorer(workers={workers}) must be >= 0 (0: score inline, in the consumer's thread)")
        self.reward_fn = reward_fn
        self.eos_id = eos_id
        self.workers = workers
        self._executor: ThreadPoolExecutor | None = None

    def score(self, request: GroupRequest | None, completions: GroupCompletions) -> Group:
        """One group's rewards, in the calling thread; NaN for a group nobody requested (the acceptor refuses it)."""
        if request is None:
            return completions.scored([float("nan")] * len(completions.completions))
        answer = list(request.answer_tokens)
        return completions.scored([float(self.reward_fn.reward(answer, c, self.eos_id)) for c in completions.completions])

    def stream(self, groups: Iterator[GroupCompletions], requests: dict[int, GroupRequest]) -> Iterator[Group]:
        """Score ``groups`` (the pool's stream) as they arrive; yield scored groups.

        With ``workers >= 1`` a thread of its own reads the pool's stream and hands each group to the
        scoring threads; closing this generator stops that reader.
        """
        if self.workers == 0:  # inline: score in the consumer's thread (no reader thread, no executor)
            for completions in groups:
                yield self.score(requests.get(completions.prompt_id), completions)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="lit_parl-score")
        executor = self._executor

        def read_pool(put, fail, stop) -> None:
            def score(completions: GroupCompletions) -> None:
                try:
                    put(self.score(requests.get(completions.prompt_id), completions))
                except BaseException as error:  # noqa: BLE001 - re-raised in the consumer's thread at once
                    fail(error)

            try:
                pending = []
                for completions in groups:
                    if stop.is_set():
                        return
                    pending.append(executor.submit(score, completions))
                for future in pending:
                    future.result()  # each put its group (or failed) before finishing
            finally:
                if hasattr(groups, "close"):
                    groups.close()  # in this thread, the one that runs the pool's generator

        yield from beside(read_pool, "lit_parl-pool-reader")

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
