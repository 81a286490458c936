"""GroupScorer: rewards for finished groups, computed in the trainer's process, off the training step.

The rollout pool only generates (``GroupCompletions``, unscored); scoring needs the prompt rows, the
rewards and the tokenizer, which live with the trainer. Scoring never runs on an event loop of the pool
or in a generation worker. Each group's samples are given to every reward with the fields it asks for
(``lit_parl.rewards.Reward``; a completion is decoded only when some reward reads text), under the
``ScoringPolicy`` (timeout, what a failing call does).

With ``workers >= 1`` a thread of its own reads the pool's stream and a thread pool scores groups as
they arrive, so a slow reward (a verifier, a sandbox) stalls neither generation nor the training step;
groups then leave in the order their scores finish, and a group whose score is ready never waits behind
a slow one. With ``workers=0`` each group is scored in the consumer's thread as it arrives: for a reward
of microseconds this is the fastest (the thread hops cost more than the reward: 9% of the default job's
throughput on a 2-core CPU, benchmarks/RESULTS.md).

Example::

    >>> from lit_parl.data.prompt_schedule import PromptSchedule
    >>> from lit_parl.tasks import CopyTask, positional_reward
    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> from lit_parl.rollout.records import GroupCompletions
    >>> tokenizer = build_char_tokenizer()
    >>> drawn = PromptSchedule(CopyTask(seed=0), tokenizer, group_size=2).draw([0], version=0)
    >>> answer = list(drawn[0].answer_ids) + [tokenizer.eos_token_id]
    >>> done = GroupCompletions(0, 0, [0, 1], [answer, answer[1:]], [[0.0] * len(answer), [0.0] * (len(answer) - 1)],
    ...     ["stop", "stop"])
    >>> scorer = GroupScorer([positional_reward], tokenizer, workers=1)
    >>> [group.rewards[0] for group in scorer.stream(iter([done]), drawn)]
    [1.0]
    >>> scorer.close()
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from lit_parl.data.head_start import Beside
from lit_parl.data.prompt_schedule import DrawnPrompt
from lit_parl.rewards.reward import Reward, as_reward
from lit_parl.rewards.scoring_policy import ScoringPolicy, score_group
from lit_parl.rollout.records import Group, GroupCompletions

ENVIRONMENT_FAILURES = "environment"  # where a failed environment is counted: reward/environment/failures


class GroupScorer:
    """Scores streamed groups with every reward, on ``workers`` threads.

    Args:
        rewards: ``lit_parl.rewards.Reward``s (weights and names) or plain functions (weight 1).
        tokenizer: decodes completions for rewards that read text; its end token is the ``eos_id`` field.
        workers: threads that score groups concurrently (rewards that release the GIL, or wait on a
            verifier, gain from more than one); 0 scores inline in the consumer's thread; ``None``: the
            largest ``concurrent_groups`` of the rewards (a reward model's or a judge's; 0 for plain functions).
        policy: timeout and error handling of each reward call.
    """

    def __init__(
        self,
        rewards: Sequence[Reward | Callable],
        tokenizer: PreTrainedTokenizerBase,
        workers: int | None = None,
        policy: ScoringPolicy | None = None,
    ) -> None:
        if callable(rewards) or isinstance(rewards, Reward):
            rewards = [rewards]
        self.rewards = [as_reward(r) for r in rewards]
        if not self.rewards:
            raise ValueError("GroupScorer needs at least one reward")
        names = [r.name for r in self.rewards]
        if len(set(names)) != len(names):
            raise ValueError(
                f"two rewards share a name in {names}: "
                "give each its own (Reward(name=...)); each is logged as reward/<name>"
            )
        if workers is None:
            workers = max(r.concurrent_groups for r in self.rewards)
        if workers < 0:
            raise ValueError(f"GroupScorer(workers={workers}) must be >= 0 (0: score inline, in the consumer's thread)")
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.workers = workers
        self.policy = policy or ScoringPolicy()
        self._fields = {f for r in self.rewards for f in r.fields}
        self._executor: ThreadPoolExecutor | None = None

    def inputs(self, drawn: DrawnPrompt, completions: GroupCompletions) -> list[dict]:
        """Each sample's reward fields: only those some reward reads, each sample with copies of its own (a
        reward that edits its ``completion_ids`` or ``metadata`` changes nothing that is trained or shared)."""
        row, fields = drawn.row, self._fields
        texts = (
            self.tokenizer.batch_decode(completions.completions, skip_special_tokens=True)
            if "completion" in fields or (completions.episodes is None and {"turns", "conversation"} & fields)
            else None
        )
        episodes = completions.episodes
        samples = []
        for k, (ids, reason) in enumerate(zip(completions.completions, completions.finish_reasons)):
            sample = {
                "completion_ids": list(ids),
                "stopped": reason == "stop",
                "prompt": drawn.text,
                "answer": row.answer,
                "eos_id": self.eos_id,
                "prompt_id": drawn.request.prompt_id,
            }
            if "completion" in fields:
                sample["completion"] = texts[k]
            if "answer_ids" in fields:
                sample["answer_ids"] = list(drawn.answer_ids)
            if "metadata" in fields:
                sample["metadata"] = copy.deepcopy(dict(row.metadata))
            if "messages" in fields:
                sample["messages"] = [dict(m) for m in row.messages] if row.is_chat else None
            if "env_reward" in fields:
                sample["env_reward"] = 0.0 if episodes is None else episodes[k].env_reward
            if "turns" in fields or "conversation" in fields:
                turns = [("assistant", texts[k])] if episodes is None else list(episodes[k].turns)
                sample["turns"] = turns
            if "conversation" in fields:
                head = [dict(m) for m in row.messages] if row.is_chat else [{"role": "user", "content": row.prompt}]
                sample["conversation"] = head + [{"role": role, "content": text} for role, text in turns]
            samples.append(sample)
        return samples

    def score(self, drawn: DrawnPrompt | None, completions: GroupCompletions) -> Group:
        """One group's rewards, in the calling thread; NaN for a group nobody requested (the acceptor refuses it)."""
        if drawn is None:
            return completions.scored([float("nan")] * len(completions.completions))
        scored = score_group(self.rewards, self.inputs(drawn, completions), self.policy, completions.prompt_id)
        for k, episode in enumerate(completions.episodes or ()):
            if episode.failed is not None:  # its environment failed: the episode scores the policy's value, counted
                scored.totals[k] = self.policy.error_score
                scored.failures.setdefault(ENVIRONMENT_FAILURES, []).append(k)
        return completions.scored(scored.totals, scored.components, scored.failures)

    def stream(self, groups: Iterator[GroupCompletions], drawn: dict[int, DrawnPrompt]) -> Iterator[Group]:
        """Score ``groups`` (the pool's stream) as they arrive; yield scored groups.

        With ``workers >= 1`` a thread of its own reads the pool's stream and hands each group to the
        scoring threads; closing this generator stops that reader.
        """
        if self.workers == 0:  # inline: score in the consumer's thread (no reader thread, no executor)
            for completions in groups:
                yield self.score(drawn.get(completions.prompt_id), completions)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="lit_parl-score")
        executor = self._executor

        def read_pool(put, fail, stop) -> None:
            def score(completions: GroupCompletions) -> None:
                try:
                    put(self.score(drawn.get(completions.prompt_id), completions))
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

        yield from Beside(read_pool, "lit_parl-pool-reader")

    def state_dict(self) -> dict:
        """What rewards with a state keep across a checkpoint (a running normalisation), by reward name."""
        return {r.name: r.state_dict() for r in self.rewards if hasattr(r, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for reward in self.rewards:
            if reward.name in state and hasattr(reward, "load_state_dict"):
                reward.load_state_dict(state[reward.name])

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        for reward in self.rewards:
            if hasattr(reward, "close"):
                reward.close()  # a reward model's thread, a judge's connections
