"""``check_arguments``: the datamodule's arguments refused at construction, before any engine starts.

Each refusal names the argument and the fix; a value that could only fail minutes later (a greedy sampler
that cannot train, a tolerance of the wrong kind) fails here instead.

Example::

    >>> from lit_parl.rollout.records import SamplingParams
    >>> check_arguments("eager", None, SamplingParams(), "auto", config=None, shape=None)
    Traceback (most recent call last):
    ...
    ValueError: RolloutDataModule(mode='eager'); choose one of ('async', 'sync')
"""

from __future__ import annotations

from transformers import PretrainedConfig

from lit_parl.data.iteration_shape import IterationShape
from lit_parl.episodes.episode_settings import EpisodeSettings
from lit_parl.models.limits import check_context
from lit_parl.rollout.records import SamplingParams
from lit_parl.rollout.rollout_pool import RolloutPool

MODES = ("async", "sync")


def check_arguments(
    mode: str,
    pool: RolloutPool,
    sampling: SamplingParams,
    logprob_tolerance: float | str | None,
    config: PretrainedConfig,
    shape: IterationShape,
    episodes: EpisodeSettings | None = None,
) -> None:
    """Raise ``ValueError`` (``TypeError`` for a pool of the wrong kind) naming the argument and the fix: the
    mode, the pool, sampling that cannot train, the tolerance, the model's context (``check_context``) and the
    pool's capacity for the iteration (``RolloutPool.check_capacity``)."""
    if mode not in MODES:
        raise ValueError(f"RolloutDataModule(mode={mode!r}); choose one of {MODES}")
    if not isinstance(pool, RolloutPool):
        raise TypeError(
            f"RolloutDataModule(pool={type(pool).__name__}): a pool subclasses lit_parl.rollout.RolloutPool"
        )
    if sampling.greedy:
        raise ValueError(
            "sampling.temperature=0 (greedy) cannot train: GRPO needs a distribution to sample and differentiate; "
            "greedy is for evaluation"
        )
    positive = isinstance(logprob_tolerance, (int, float)) and logprob_tolerance > 0
    if not (positive or logprob_tolerance is None or logprob_tolerance == "auto"):
        raise ValueError(
            f"RolloutDataModule(logprob_tolerance={logprob_tolerance!r}): give a number > 0, 'auto' (the pool's) "
            "or None (no check)"
        )
    if episodes is None:
        check_context(config, sampling.max_new_tokens)
    else:
        check_context(config, episodes.max_episode_tokens, "episodes.max_episode_tokens")
    pool.check_capacity(shape, sampling)
