"""Evaluation during training: held-out prompts through the same rollout pool, with the weights it holds.

Every ``every_n_iterations`` iterations (and after the last, or the one a stopped fit ends with), once the
iteration's last optimizer step
is taken and before the next weight sync, the pool still holds θ_k, the policy this iteration's
rollouts came from: the held-out prompts are generated with those weights, under the version gate
(requests for version k, which the pool confirmed), with no extra sync. Nothing of it reaches the
training data. Measured, for ``lit_parl.trainer.grpo_module.GRPOModule.validation_step`` to log:

- ``val/greedy_accuracy``, ``val/greedy_reward``: one greedy sample per prompt (temperature 0);
- ``val/mean@k``, ``val/pass@k``, ``val/reward@k``: ``k`` samples per prompt at the training sampling
  parameters: the mean share correct, the share of prompts with at least one correct sample, the mean reward.

A sample is correct when its total reward reaches ``correct_reward`` (the training accuracy's rule).

Example::

    >>> settings = EvalSettings(every_n_iterations=10, prompts=64, samples=4)
    >>> [settings.due(i, last=99) for i in (0, 9, 10, 99)]
    [False, True, False, True]
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.errors import OffPolicyError
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.rollout_pool import RolloutPool

if TYPE_CHECKING:
    from lit_parl.episodes.episode_runner import EpisodeRunner


@dataclass(frozen=True)
class EvalSettings:
    """When and how much to evaluate.

    Args:
        every_n_iterations: evaluate after iterations ``n-1, 2n-1, ...`` (0: never).
        prompts: held-out prompts per evaluation (``None``: every row of a finite eval source).
        samples: ``k`` of mean@k and pass@k (0: only the greedy pass).
        greedy: also run the greedy pass (one sample per prompt at temperature 0).
        at_end: evaluate after the last iteration too.
    """

    every_n_iterations: int = 0
    prompts: int | None = None
    samples: int = 0
    greedy: bool = True
    at_end: bool = True

    def __post_init__(self) -> None:
        if self.every_n_iterations < 0:
            raise ValueError(f"evaluation.every_n_iterations={self.every_n_iterations} must be >= 0 (0: never)")
        if self.prompts is not None and self.prompts < 1:
            raise ValueError(f"evaluation.prompts={self.prompts} must be >= 1 (or null: the whole eval set)")
        if self.samples < 0 or (self.samples == 0 and not self.greedy):
            raise ValueError(
                f"evaluation needs samples >= 1 or greedy=true (got samples={self.samples}, greedy={self.greedy})"
            )

    @property
    def enabled(self) -> bool:
        return self.every_n_iterations > 0

    def due(self, iteration: int, last: int | None) -> bool:
        """Whether to evaluate after ``iteration`` (0-based) of a run whose last is ``last``."""
        if not self.enabled:
            return False
        return (iteration + 1) % self.every_n_iterations == 0 or (self.at_end and iteration == last)


class Evaluator:
    """Generates and scores the held-out prompts; returns the metrics.

    Args:
        settings: the cadence and sizes.
        schedule: a ``PromptSchedule`` over the held-out source (its own seed: its order and sample seeds
            are not the training ones).
        scorer: the training rewards.
        correct_reward: a sample is correct when its total reward reaches this.
        max_samples_per_call: samples sent to the pool in one ``generate`` call (the training iteration's
            N x G, which the pool was checked to serve): a large eval set goes in chunks.
        episodes: plays multi-turn episodes over the pool (``None``: one completion per sample).
    """

    def __init__(
        self,
        settings: EvalSettings,
        schedule: PromptSchedule,
        scorer: GroupScorer,
        correct_reward: float,
        max_samples_per_call: int = 256,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        rows = schedule.usable_rows
        if settings.prompts is None and rows is None:
            raise ValueError("evaluation.prompts is needed with a procedural task (it has no fixed eval set)")
        if settings.prompts is not None and rows is not None and settings.prompts > rows:
            raise ValueError(
                f"evaluation.prompts={settings.prompts} is more than the {rows} rows of the eval set; "
                "lower it or null (all rows)"
            )
        self.settings, self.schedule, self.scorer, self.correct_reward = settings, schedule, scorer, correct_reward
        self.prompts = settings.prompts if settings.prompts is not None else rows
        self.max_samples_per_call = max_samples_per_call
        self.episodes = episodes

    @classmethod
    def for_run(
        cls,
        settings: EvalSettings,
        held_out,
        make_schedule,
        scorer: GroupScorer,
        correct_reward: float,
        max_samples_per_call: int,
        episodes: EpisodeRunner | None = None,
    ) -> Evaluator | None:
        """The run's evaluator (``None`` when evaluation is off): ``held_out`` prompts (a ``PromptSource``) drawn by
        ``make_schedule(held_out)``."""
        if not settings.enabled:
            return None
        if held_out is None:
            raise ValueError(
                f"evaluation.every_n_iterations={settings.every_n_iterations} but there are no held-out prompts: "
                "give eval_data, or a data source with an eval split "
                "(e.g. DatasetPrompts(eval_split=... or eval_rows=...))"
            )
        return cls(settings, make_schedule(held_out), scorer, correct_reward, max_samples_per_call, episodes)

    def run(self, pool: RolloutPool, version: int, sampling: SamplingParams) -> dict[str, float]:
        """Every configured pass on the held-out prompts with the pool's weights (version ``version``)."""
        drawn = self.schedule.draw(list(range(self.prompts)), version)
        metrics: dict[str, float] = {}
        passes = [("greedy", 1, replace(sampling, temperature=0.0, top_p=1.0, top_k=0))] if self.settings.greedy else []
        if self.settings.samples:
            passes.append(("sampled", self.settings.samples, sampling))
        for kind, k, params in passes:
            requests = [
                GroupRequest(
                    d.request.prompt_id,
                    d.request.prompt_tokens,
                    version,
                    tuple(sample_seed(self.schedule.seed, version, pid, s) for s in range(k)),
                )
                for pid, d in drawn.items()
            ]
            correct, rewards = [], []
            chunk = max(1, self.max_samples_per_call // k)
            for start in range(0, len(requests), chunk):
                chunk_requests = requests[start : start + chunk]
                if self.episodes is not None:
                    stream = self.episodes.generate(pool, chunk_requests, params, drawn)
                else:
                    stream = pool.generate(chunk_requests, params)
                for completions in stream:
                    group = self.scorer.score(drawn[completions.prompt_id], completions)
                    rewards.extend(group.rewards)
                    correct.append([r >= self.correct_reward for r in group.rewards])
            n = len(correct)
            if kind == "greedy":
                metrics["val/greedy_accuracy"] = sum(c[0] for c in correct) / n
                metrics["val/greedy_reward"] = sum(rewards) / len(rewards)
            else:
                metrics[f"val/mean@{k}"] = sum(sum(c) / k for c in correct) / n
                metrics[f"val/pass@{k}"] = sum(any(c) for c in correct) / n
                metrics[f"val/reward@{k}"] = sum(rewards) / len(rewards)
        return metrics

    def after_iteration(
        self, trainer, iterations_done: int, version: int, pool: RolloutPool, sampling: SamplingParams
    ) -> dict[str, float]:
        """The metrics of the iteration just trained when it is due, with its weights (``version``); else nothing.
        Lightning validates after each epoch, also mid-epoch when a stop (``max_time``) cut it: then nothing.
        Under W ranks rank 0 evaluates, through its own pool (it holds the same θ_k as every rank's), and every
        rank logs its metrics: each rank then runs the same validation step, and its collectives, alike."""
        iteration = trainer.current_epoch
        if iterations_done != iteration + 1:
            return {}  # the iteration is unfinished
        last = trainer.max_epochs - 1 if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        if trainer.should_stop:  # stopped early (max_time, max_steps, a callback): this is the last iteration
            last = iteration
        if not self.settings.due(iteration, last):
            return {}
        if pool.version != version:  # the weights of the iteration just trained, synced at its start
            raise OffPolicyError(
                f"evaluation after iteration {iteration} expects the pool to hold version {version}, "
                f"it holds {pool.version}"
            )
        if trainer.world_size == 1:
            return self.run(pool, version, sampling)
        metrics = [self.run(pool, version, sampling) if trainer.global_rank == 0 else None]
        torch.distributed.broadcast_object_list(metrics, src=0)
        return metrics[0]
