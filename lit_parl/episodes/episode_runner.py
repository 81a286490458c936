"""EpisodeRunner: multi-turn episodes driven over any rollout pool, turn by turn, every turn from θ_k.

The first model turn of every episode is the iteration's own requests (each group's prompt once, its G
seeds). Each later turn is a continuation: a request that carries the episode's tokens so far (the prompt,
the model's turns as sampled, the observations appended), the iteration's version, and the turn's own
seed (``lit_parl.episodes.episode.turn_seed``: per version, prompt, sample and turn). So every pool that
generates serves continuations (hf, vLLM, SGLang), the pool's version gate holds for every turn, and a
re-run episode (a replaced worker's) samples the same tokens. A turn's requests go out in one call; the
environments step as that call's groups arrive (async ones concurrently), and a group leaves for scoring
as soon as its G episodes have ended, while the others play their next turns.

Example (a pool whose "model" answers "5" every turn, against the number game; the tests train with it)::

    >>> from lit_parl.tasks.guess_number import GuessNumber, GuessNumberTask
    >>> from lit_parl.models.char_tokenizer import build_char_tokenizer
    >>> from lit_parl.data.prompt_schedule import PromptSchedule
    >>> from lit_parl.rollout.records import GroupCompletions, SamplingParams
    >>> from lit_parl.rollout.rollout_pool import RolloutPool, PoolSpec
    >>> tokenizer = build_char_tokenizer()
    >>> class Fives(RolloutPool):
    ...     def _start(self, spec): pass
    ...     def _sync_weights(self, buckets, version): [b for b in buckets]
    ...     def _generate(self, requests, sampling):
    ...         for r in requests:
    ...             five = [tokenizer.convert_tokens_to_ids("5"), tokenizer.eos_token_id]
    ...             yield GroupCompletions(r.prompt_id, r.version, list(range(r.group_size)),
    ...                 [five] * r.group_size, [[-1.0, -0.5]] * r.group_size, ["stop"] * r.group_size)
    ...     def _worker_counts(self): return (1, 1)
    ...     def _close(self): pass
    >>> pool = Fives(); pool.start(PoolSpec("unused", eos_id=1, pad_id=0)); pool.sync_weights([], version=0)
    >>> drawn = PromptSchedule(GuessNumberTask(seed=0), tokenizer, group_size=1).draw([0], version=0)
    >>> runner = EpisodeRunner(EpisodeSettings(GuessNumber, max_turns=2, max_episode_tokens=16), tokenizer)
    >>> [group] = runner.generate(pool, [d.request for d in drawn.values()], SamplingParams(max_new_tokens=3), drawn)
    >>> tokenizer.decode(group.completions[0], skip_special_tokens=True), group.episodes[0].loss_mask
    ('5+5', [1, 1, 0, 1, 1])
    >>> pool.close()
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from lit_parl.episodes.environment import Step
from lit_parl.episodes.environment_calls import EnvironmentCalls, EnvironmentFailure
from lit_parl.episodes.episode import Episode
from lit_parl.episodes.episode_settings import EpisodeSettings
from lit_parl.episodes.observation_tokens import ObservationTokens
from lit_parl.errors import OffPolicyError
from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.rewards.scoring_policy import ScoringPolicy
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import RolloutPool

if TYPE_CHECKING:
    from lit_parl.data.prompt_schedule import DrawnPrompt


class EpisodeError(RuntimeError):
    """An environment failed under ``scoring.on_error="error"``."""


class EpisodeRunner:
    """Plays one call's episodes over a pool; yields each group once its G episodes have ended.

    Args:
        settings: the environment and the limits.
        tokenizer: decodes model turns for the environment, encodes observations (and renders chat deltas).
        policy: the scoring policy: an environment call's timeout and what its failure does.
        prompt_format: whether a row's episode is a chat (then observations are template deltas).
    """

    def __init__(
        self,
        settings: EpisodeSettings,
        tokenizer: PreTrainedTokenizerBase,
        policy: ScoringPolicy | None = None,
        prompt_format: PromptFormat | None = None,
    ) -> None:
        self.settings, self.tokenizer = settings, tokenizer
        self.policy = policy or ScoringPolicy()
        self.prompt_format = prompt_format or PromptFormat()
        self._intervals: list[tuple[float, float]] = []

    def busy_intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` of the pool's calls of the last ``generate``, one per turn."""
        return list(self._intervals)

    def generate(
        self,
        pool: RolloutPool,
        requests: list[GroupRequest],
        sampling: SamplingParams,
        drawn: dict[int, DrawnPrompt],
    ) -> Iterator[GroupCompletions]:
        """Every request's G episodes; a group is yielded as soon as all of its episodes ended."""
        self._intervals = []
        yield from self._play(pool, requests, sampling, drawn, EnvironmentCalls(self.policy.timeout_s))

    def _play(self, pool, requests, sampling, drawn, calls: EnvironmentCalls) -> Iterator[GroupCompletions]:
        groups = {r.prompt_id: self._episodes(r, drawn[r.prompt_id], calls) for r in requests}
        turn = dataclasses.replace(sampling, max_new_tokens=self.settings.turn_limit(sampling.max_new_tokens))
        owners = {r.prompt_id: groups[r.prompt_id] for r in requests}  # request id -> its episodes, by sample
        version = requests[0].version if requests else None
        while requests:
            playing: list[Episode] = []
            steps: list[tuple[Episode, tuple]] = []
            start = time.monotonic()
            for done in pool.generate(requests, turn):
                for sample, tokens, logprobs, reason in zip(
                    done.sample_indices, done.completions, done.logprobs, done.finish_reasons
                ):
                    episode = owners[done.prompt_id][sample]
                    text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                    if episode.model_turn(tokens, logprobs, reason, text, done.version, self.settings):
                        if episode.failed is not None:  # its reset failed: one turn, no step
                            episode.finish = "stop"
                        else:
                            steps.append((episode, calls.start(episode.environment.step, text)))
                steps = self._settle(steps, playing, calls, wait=False)
                yield from self._finished(groups)
            self._intervals.append((start, time.monotonic()))
            self._settle(steps, playing, calls, wait=True)
            yield from self._finished(groups)
            requests, owners = [], {}
            for episode in playing:
                context, seed = episode.continuation()
                key = episode.prompt_id * len(groups[episode.prompt_id]) + episode.sample  # unique within a turn
                requests.append(GroupRequest(key, context, version, (seed,), (episode.prompt_id, episode.sample)))
                owners[key] = {0: episode}
        if groups:
            raise RuntimeError(f"episodes of prompts {sorted(groups)[:10]} never ended")  # a bug, never a loss

    def _episodes(self, request: GroupRequest, drawn: DrawnPrompt, calls: EnvironmentCalls) -> list[Episode]:
        """The request's G episodes, their environments built and reset (reset failures judged by the policy)."""
        chat = self.prompt_format.uses_chat(drawn.row)
        episodes = []
        for sample, seed in enumerate(request.seeds):
            environment = self.settings.environment()
            messages = self.prompt_format.messages(drawn.row) if chat else None
            role = getattr(environment, "role", "user")
            episode = Episode(request.prompt_id, sample, seed, request.prompt_tokens, environment, messages, role)
            try:
                calls.result(calls.start(environment.reset, drawn.row, seed))
            except EnvironmentFailure as failure:
                self._failed(episode, failure, "reset", end=False)
            episodes.append(episode)
        return episodes

    def _settle(self, steps, playing: list[Episode], calls: EnvironmentCalls, wait: bool) -> list:
        """Apply the environment steps that are done (all of them with ``wait``); return those still running."""
        running = []
        for episode, call in steps:
            if not wait and not call[0].done():
                running.append((episode, call))
                continue
            try:
                step = calls.result(call)
            except EnvironmentFailure as failure:
                self._failed(episode, failure, f"step after turn {episode.model_turns}")
                continue
            if not isinstance(step, Step):
                raise TypeError(
                    f"{type(episode.environment).__name__}.step returned {type(step).__name__} {step!r:.80}; "
                    "it must return a lit_parl.episodes.Step"
                )
            if episode.step(step, self.settings):
                ids = ObservationTokens(self.tokenizer, episode.role).delta(
                    episode.messages, episode.last_turn, step.observation
                )
                if episode.observe(step.observation, ids, self.settings):
                    playing.append(episode)
        return running

    def _failed(self, episode: Episode, failure: EnvironmentFailure, where: str, end: bool = True) -> None:
        if self.policy.on_error == "error":
            raise EpisodeError(
                f"environment {type(episode.environment).__name__} {failure.why} in {where} of prompt "
                f"{episode.prompt_id}, sample {episode.sample}; set scoring.on_error=score to score such episodes "
                f"{self.policy.error_score} instead (counted as reward/environment/failures)"
                + (f"\n{failure.detail}" if failure.detail else "")
            )
        episode.fail(failure.why, end)

    def _finished(self, groups: dict[int, list[Episode]]) -> Iterator[GroupCompletions]:
        for prompt_id in [p for p, episodes in groups.items() if all(e.ended for e in episodes)]:
            episodes = groups.pop(prompt_id)
            versions = set().union(*(e.versions for e in episodes))
            if len(versions) != 1:
                raise OffPolicyError(f"the episodes of prompt {prompt_id} were sampled by policy versions {versions}")
            yield GroupCompletions(
                prompt_id,
                versions.pop(),
                [e.sample for e in episodes],
                [list(e.tokens) for e in episodes],
                [list(e.logprobs) for e in episodes],
                [e.finish for e in episodes],
                [e.trace() for e in episodes],
            )
