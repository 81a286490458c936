"""ScoringPolicy and score_group: every reward of one group, under a timeout and an error policy.

Each reward is called as its kind needs (``lit_parl.rewards.Reward``): once per sample, one after
another; once per group (batched); or, for ``async def`` rewards, a group's samples awaited together on
one long-lived event loop of the scorer's own, in a thread of its own (never the pool's loop, and never
one the caller may already run). With ``timeout_s`` set, a call that has not returned in time counts as
failed; so does one that raised or returned NaN or inf. A failure either stops the run (``on_error="error"``: a
``RewardError`` naming the prompt, the reward and the traceback) or scores ``error_score`` for that reward and
is counted (``"score"``); it is never a silent 0 and never a NaN that reaches the advantages. A value that is
not a number (a string, ``None``) is a bug in the reward and always raises.

A synchronous call with a timeout runs on a daemon thread of its own, so the scorer stops waiting at
its deadline (each call has its own: calls run one at a time, so CPU-bound rewards do not share a
deadline under the GIL). Python cannot kill a thread: a call that never returns keeps its thread, and
an async reward that blocks its loop holds the loop (a verifier that can hang should run its work in a
subprocess it can kill).

Example::

    >>> from lit_parl.rewards.reward import Reward
    >>> def length(completion_ids): return len(completion_ids)
    >>> def broken(completion_ids): raise ValueError("verifier down")
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):  # a reward's first failure is also reported, as a warning
    ...     scored = score_group([Reward(length), Reward(broken, weight=0.5)], [{"completion_ids": [1, 2]}],
    ...                          ScoringPolicy(on_error="score", error_score=-1.0), prompt_id=7)
    >>> scored.totals, scored.failures
    ([1.5], {'broken': [0]})
"""

from __future__ import annotations

import asyncio
import math
import threading
import traceback
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lit_parl.rewards.reward import Reward, RewardError

ERROR_POLICIES = ("error", "score")


@dataclass(frozen=True)
class ScoringPolicy:
    """What a failing reward call does.

    Args:
        timeout_s: seconds one call (one sample; one group for a batched reward) may take; ``None``: no limit.
        on_error: ``error``: stop the run with the prompt id, the reward's name and the traceback;
            ``score``: use ``error_score`` for that reward on that sample and count it
            (``reward/<name>/failures``).
        error_score: the value of a failed call under ``on_error="score"``.
    """

    timeout_s: float | None = None
    on_error: str = "error"
    error_score: float = 0.0

    def __post_init__(self) -> None:
        if self.on_error not in ERROR_POLICIES:
            raise ValueError(f"ScoringPolicy(on_error={self.on_error!r}); choose one of {ERROR_POLICIES}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"ScoringPolicy(timeout_s={self.timeout_s}) must be > 0 or None")
        if not math.isfinite(self.error_score):
            raise ValueError(f"ScoringPolicy(error_score={self.error_score}) must be finite: it reaches the advantages")


@dataclass
class ScoredGroup:
    """A group's total rewards (weighted sums), each metric's values (``None`` where the call failed), and
    the samples (positions in the group) on which each reward's call failed."""

    totals: list[float]
    components: dict[str, list[float | None]] = field(default_factory=dict)
    failures: dict[str, list[int]] = field(default_factory=dict)


class _Failure(Exception):
    def __init__(self, why: str, detail: str) -> None:
        super().__init__(why)
        self.why, self.detail = why, detail


def _failure(error: BaseException) -> _Failure:
    return _Failure(f"raised {type(error).__name__}: {error}", traceback.format_exc())


def _call_with_deadline(call, timeout_s: float):
    """``call()`` on a daemon thread; its result, or a ``_Failure`` (raised, or not returned in ``timeout_s``)."""
    box: list = []
    done = threading.Event()

    def run() -> None:
        try:
            box.append(call())
        except Exception as error:  # noqa: BLE001 - judged by the policy in the caller
            box.append(_failure(error))
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="lit_parl-reward-call").start()
    if not done.wait(timeout_s):
        return _Failure(f"timed out after {timeout_s} s", "")
    return box[0]


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's one loop for async rewards, running in a daemon thread: clients an async reward keeps
    between calls (an HTTP session) stay on the loop they were made on."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, daemon=True, name="lit_parl-reward-loop").start()
        return _loop


def _await(coroutine, timeout_s: float | None):
    """Run ``coroutine`` on the rewards' loop; its result, or a ``_Failure``. The deadline is kept by this
    thread, so it holds even when the reward blocks the loop."""
    future = asyncio.run_coroutine_threadsafe(coroutine, event_loop())
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        return _Failure(f"timed out after {timeout_s} s", "")
    except Exception as error:  # noqa: BLE001
        return _failure(error)


def _call_each(reward: Reward, inputs: Sequence[Mapping[str, Any]], timeout_s: float | None) -> list:
    """One result per sample (a value, or a ``_Failure``)."""
    if reward.is_async:

        async def one(sample):
            try:
                return await asyncio.wait_for(reward.call(sample), timeout_s)
            except asyncio.TimeoutError:
                return _Failure(f"timed out after {timeout_s} s", "")
            except Exception as error:  # noqa: BLE001
                return _failure(error)

        async def all_samples():
            return await asyncio.gather(*(one(sample) for sample in inputs))

        results = _await(all_samples(), None if timeout_s is None else timeout_s + 1.0)  # per-sample deadlines inside
        return [results] * len(inputs) if isinstance(results, _Failure) else results
    results = []
    for sample in inputs:  # one at a time: each call has its own deadline, and a reward need not be thread-safe
        if timeout_s is not None:
            results.append(_call_with_deadline(lambda sample=sample: reward.call(sample), timeout_s))
            continue
        try:
            results.append(reward.call(sample))
        except Exception as error:  # noqa: BLE001
            results.append(_failure(error))
    return results


def _call_batched(reward: Reward, inputs: Sequence[Mapping[str, Any]], timeout_s: float | None) -> list:
    columns = {f: [sample[f] for sample in inputs] for f in reward.fields}
    if reward.is_async:
        result = _await(reward.fn(**columns), timeout_s)
    elif timeout_s is not None:
        result = _call_with_deadline(lambda: reward.fn(**columns), timeout_s)
    else:
        try:
            result = reward.fn(**columns)
        except Exception as error:  # noqa: BLE001
            result = _failure(error)
    if isinstance(result, _Failure):
        return [result] * len(inputs)
    if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Sequence) or len(result) != len(inputs):
        raise TypeError(
            f"batched reward {reward.name!r} returned {type(result).__name__} {result!r:.60}; it must return a list "
            f"of {len(inputs)} values, one per sample"
        )
    return list(result)


def score_group(
    rewards: Sequence[Reward], inputs: Sequence[Mapping[str, Any]], policy: ScoringPolicy, prompt_id: int
) -> ScoredGroup:
    """Every reward on every sample of one group (``inputs``: one dict of fields per sample)."""
    scored = ScoredGroup(totals=[0.0] * len(inputs))
    for reward in rewards:
        call = _call_batched if reward.batched else _call_each
        for k, result in enumerate(call(reward, inputs, policy.timeout_s)):
            if not isinstance(result, _Failure):
                values = reward.values(result)  # TypeError for a non-number, whatever the policy
                bad = [name for name, v in values.items() if not math.isfinite(v)]
                if not bad:
                    for name, v in values.items():
                        scored.components.setdefault(name, [None] * len(inputs))[k] = v
                    scored.totals[k] += reward.weight * sum(values.values())
                    continue
                result = _Failure(f"returned a non-finite value {values}", "")
            if policy.on_error == "error":
                raise RewardError(
                    f"reward {reward.name!r} {result.why} on prompt {prompt_id}, sample {k}; "
                    f"set scoring.on_error=score to score such samples {policy.error_score} instead "
                    f"(counted as reward/{reward.name}/failures)" + (f"\n{result.detail}" if result.detail else "")
                )
            if not reward.failure_reported:  # once per reward: the counter says how often, this says why
                reward.failure_reported = True
                warnings.warn(
                    f"reward {reward.name!r} {result.why} on prompt {prompt_id}, sample {k}; such samples score "
                    f"{policy.error_score} (scoring.on_error=score), counted as reward/{reward.name}/failures. "
                    "Later failures of this reward are counted without this message"
                    + (f"\n{result.detail}" if result.detail else ""),
                    RuntimeWarning,
                    stacklevel=2,
                )
            scored.failures.setdefault(reward.name, []).append(k)
            scored.totals[k] += reward.weight * policy.error_score
    return scored
