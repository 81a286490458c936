"""The rollout protocol: what the trainer needs from any generation backend, and what it does itself.

A backend is a subclass of ``RolloutPool`` that implements five methods, each documented below:
``_start``, ``_sync_weights``, ``_generate``, ``_worker_counts`` and ``_close``. Everything the
backends have in common is done here, once, by the public methods the trainer calls:

- **Lifecycle.** ``start(spec)`` launches or attaches the engine from a ``PoolSpec``: a saved model
  directory and the token ids it needs, never a live model, so a remote engine gets what it can use.
  A second ``start``, and any other call before ``start`` or after ``close``, fails with a clear error;
  ``start`` after ``close`` starts the pool afresh (a second fit).
- **Version.** ``version`` is read-only: the policy version every worker has confirmed, ``None`` before
  the first sync and while a sync is under way. A backend never sets it; ``sync_weights`` records it
  once ``_sync_weights`` has returned (which it does only when every worker confirmed).
- **The version gate and request checks.** ``generate`` refuses requests for any version other than
  the confirmed one, duplicated prompt ids and mixed group sizes, before the backend sees them; and it
  refuses a result the backend returns for a prompt that was not requested, or twice, or that is missing.
- **Timing.** ``busy_intervals`` reports when the engine worked during the last ``generate``.

What a backend does **not** do: score. ``generate`` yields ``GroupCompletions``, unscored; the trainer's
process scores them (``lit_parl.data.group_scorer.GroupScorer``: inline, or on threads of its own),
because scoring needs the task and the tokenizer, which live there. So a slow reward never stalls
generation, whichever backend runs.

Weights arrive as a stream of buckets (lists of ``(name, tensor)``) pushed by one process: a sharded
trainer gathers and sends one bucket at a time, so the extra memory is one bucket, not a model copy.

Example, a complete backend that "generates" by echoing the prompt (``tests/rollout/test_rollout_protocol.py``
trains with one like it)::

    >>> from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
    >>> class EchoPool(RolloutPool):
    ...     backend = "echo"
    ...     def _start(self, spec): self.eos = spec.eos_id
    ...     def _sync_weights(self, buckets, version): self.held = version; [b for b in buckets]
    ...     def _generate(self, requests, sampling):
    ...         for r in requests:
    ...             tokens = [list(r.prompt_tokens[:1]) + [self.eos] for _ in r.seeds]
    ...             yield GroupCompletions(r.prompt_id, self.held, list(range(r.group_size)), tokens,
    ...                                    [[0.0] * len(t) for t in tokens], ["stop"] * r.group_size)
    ...     def _worker_counts(self): return (1, 1)
    ...     def _close(self): pass
    >>> pool = EchoPool()
    >>> pool.start(PoolSpec(model_dir="unused", eos_id=1, pad_id=0))
    >>> pool.sync_weights([[("w", torch.zeros(1))]], version=0)
    >>> request = GroupRequest(prompt_id=7, prompt_tokens=(4, 5), version=0, seeds=(1, 2))
    >>> [(g.prompt_id, g.completions) for g in pool.generate([request], SamplingParams())]
    [(7, [[4, 1], [4, 1]])]
    >>> pool.health().version, pool.health().started
    (0, True)
    >>> pool.close()
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar, final

import torch

from lit_parl.rollout.pool_records import PoolHealth, PoolSpec
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams

WeightBucket = Sequence[tuple[str, torch.Tensor]]

# Mean |Δ log-prob| per token a group of an engine may differ from a float32 trainer on the same weights
# (benchmarks/RESULTS.md, "A pool that keeps old weights"). A float32 engine agrees to ~1e-7 on the tiny
# model, and one missed step at lr 1e-5 already shows ~1e-3. The bfloat16 bound is a chosen margin over
# bf16 rounding (not measured here): it catches weights never loaded, not one missed step.
FP32_LOGPROB_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 0.05


def widened_for_trainer(tolerance: float | None, precision: str, on_accelerator: bool) -> float | None:
    """A pool's bound for a trainer in ``precision``: at least the bfloat16 bound under a lower precision, or on an
    accelerator (the float32 bounds were measured against a float32 trainer on the CPU; an accelerator's float32
    kernels, TF32 matmuls and other reductions, were not)."""
    if tolerance is None:
        return None
    low_precision = str(precision) not in ("32-true", "32", "64-true", "64")
    return max(tolerance, BF16_LOGPROB_TOLERANCE) if low_precision or on_accelerator else tolerance


class RolloutPool(ABC):
    """Base of every rollout backend: the checks, the version and the timing; the backend generates.

    Subclasses set ``backend`` (a short name) and implement the five abstract methods. Their
    constructors take the backend's own settings and must call ``super().__init__()``. The public
    methods are ``@final``: overriding one would skip the checks every backend is held to.
    """

    backend: ClassVar[str] = "unnamed"
    # False: an embedded pool, one per rank (each rank of a multi-device run starts its own and syncs its own
    # weights). True: servers that every rank's pool object reaches (one weight push for all of them).
    shared_across_ranks: ClassVar[bool] = False

    def __init__(self) -> None:
        self._version: int | None = None
        self._started = False
        self._closed = False
        self._intervals: list[tuple[float, float]] = []
        self.joined = False  # a shared pool another rank started (``SharedRolloutPool.join``): it never pushes

    # -- what a backend implements ---------------------------------------------------------------------
    @abstractmethod
    def _start(self, spec: PoolSpec) -> None:
        """Launch or attach the engine(s) for ``spec``; return once they can take a weight sync.

        Raise (with what failed and where to look: a log path, a URL) if an engine does not come up;
        anything started so far must be stopped by ``_close``, which the base calls on failure.
        """

    @abstractmethod
    def _sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Load the weights of every bucket on every worker; return once each worker confirmed ``version``.

        Buckets come in order and together name every parameter of the policy once; tensors may live on
        any device and must not be kept after the call returns (copy what must outlive it). Raise if a
        worker refuses or reports another version: the pool then holds no confirmed version.
        """

    @abstractmethod
    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        """Yield one ``GroupCompletions`` per request, each as soon as its ``group_size`` samples are done.

        Requests have been checked: one version (the confirmed one), distinct prompt ids, one group size.
        Sample ``k`` of a request uses ``request.seeds[k]``. Each result carries the version the worker
        *held* when it sampled (the trainer refuses any other), the sampled tokens with the end token
        kept, the sampler's log-prob of each token at ``sampling.temperature``, and ``"stop"`` or
        ``"length"`` per sample. A stop string (``sampling.stop``) ends a sample at the token whose text
        completes it in the decoded completion: that token is kept, none after it, and the reason is
        ``"stop"`` (also on the last token the limit allows). Temperature 0 is greedy: the argmax token,
        whatever the seed, with its log-prob in the plain softmax (T = 1). All of a call's requests should
        be in flight at once: the trainer trains on early groups while later ones are generated. Raise,
        never hang, when a worker dies (within the backend's own timeout); the caller may stop iterating
        early, and ``close`` must then still work.
        """

    @abstractmethod
    def _worker_counts(self) -> tuple[int, int]:
        """``(workers, alive)``: engine processes or servers driven, and how many are up."""

    @abstractmethod
    def _close(self) -> None:
        """Stop everything the backend started (and only that); idempotent; leave no process behind."""

    def _details(self) -> dict:
        """Backend-specific facts for ``PoolHealth.details``."""
        return {}

    def _busy_intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` monotonic times the engine computed during the last ``_generate``.

        The default is the span from the call to its last result; backends that know better override it.
        """
        return list(self._intervals)

    def reserved_cpus(self, colocated: bool) -> int:
        """CPU threads the engine takes on the trainer's machine while the trainer runs (0: none)."""
        return 0

    def check_capacity(self, shape, sampling: SamplingParams) -> None:
        """Raise, before anything starts, if this pool's settings cannot serve ``shape``'s iterations at ``sampling``.

        ``shape`` is the ``lit_parl.IterationShape``. Only what the backend knows from its own settings (a
        configured context length, a cap on concurrent sequences); the default knows nothing and accepts.
        """

    def logprob_tolerance(self) -> float | None:
        """The largest mean |engine - trainer| log-prob per token this engine's numerics explain.

        The trainer stops the run when a group's rollout log-probs differ more from θ_k's on the same
        tokens (``lit_parl.trainer.guards.off_policy_problem``): the engine then sampled with other weights than it
        reported. The default, ``BF16_LOGPROB_TOLERANCE``, suits a bfloat16 engine beside a float32 trainer;
        a backend that knows its numerics are tighter returns less (``None``: never checked).
        """
        return BF16_LOGPROB_TOLERANCE

    # -- what the trainer calls ------------------------------------------------------------------------
    @property
    @final
    def version(self) -> int | None:
        """The policy version every worker confirmed; ``None`` before the first sync or during one."""
        return self._version

    @final
    def start(self, spec: PoolSpec) -> None:
        if self._started:
            raise RuntimeError(f"{type(self).__name__}.start called twice (close it first)")
        self._closed, self._version, self._started, self.joined = False, None, True, False
        try:
            self._start(spec)
        except BaseException:
            self.close()
            raise

    @final
    def sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Push the weights in ``buckets`` as policy ``version``; return once every worker confirmed it."""
        self._push("sync_weights", self._sync_weights, buckets, version)

    def _push(self, doing: str, load, buckets: Iterable[WeightBucket], version: int) -> None:
        """``load(buckets, version)``, after which every worker holds ``version`` (a push's one bookkeeping)."""
        self._require_started(doing)
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"{doing}(version={version!r}): a version is an int >= 0")
        if self.joined:
            raise RuntimeError(
                f"this {type(self).__name__} joined a pool another rank started: that rank pushes the weights "
                f"(version {version} was not pushed from here; WeightSync pushes from rank 0 under several ranks)"
            )
        self._version = None  # nothing may be generated until every worker confirmed the new version
        load(buckets, version)
        self._version = version

    @final
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        """Yield each request's completions (unscored) as soon as they are finished, in completion order."""
        self._require_started("generate")
        self.check_requests(requests)
        waiting = {r.prompt_id: r.group_size for r in requests}
        start = time.monotonic()
        self._intervals = []
        for group in self._generate(requests, sampling):
            size = waiting.pop(group.prompt_id, None)
            if size is None:
                raise RuntimeError(
                    f"the {self.backend} pool returned prompt_id {group.prompt_id}, "
                    "which was not requested or already returned"
                )
            if sorted(group.sample_indices) != list(range(size)):
                raise RuntimeError(
                    f"the {self.backend} pool returned samples {group.sample_indices} for prompt {group.prompt_id}; "
                    f"expected 0..{size - 1}"
                )
            if not len(group.completions) == len(group.logprobs) == len(group.finish_reasons) == size:
                raise RuntimeError(
                    f"the {self.backend} pool returned {len(group.completions)} completions, "
                    f"{len(group.logprobs)} log-prob lists and {len(group.finish_reasons)} finish reasons "
                    f"for the {size} samples of prompt {group.prompt_id}"
                )
            for sample, tokens, logprobs in zip(group.sample_indices, group.completions, group.logprobs):
                if len(tokens) != len(logprobs):  # a missing log-prob would be trained as 0.0 on a real token
                    raise RuntimeError(
                        f"the {self.backend} pool returned {len(logprobs)} log-probs for the {len(tokens)} tokens "
                        f"of prompt {group.prompt_id} sample {sample}: one per token expected"
                    )
            self._intervals = [(start, time.monotonic())]
            yield group
        if waiting:
            raise RuntimeError(
                f"the {self.backend} pool ended its stream with prompts {sorted(waiting)[:10]} "
                f"({len(waiting)} in all) never returned"
            )

    @final
    def busy_intervals(self) -> list[tuple[float, float]]:
        """``(start, end)`` monotonic times the engine computed during the last ``generate``."""
        return self._busy_intervals()

    @final
    def health(self) -> PoolHealth:
        workers, alive = self._worker_counts() if self._started else (0, 0)
        details = self._details() if self._started else {}
        return PoolHealth(self.backend, self._started, workers, alive, self._version, details)

    @final
    def close(self) -> None:
        """Stop everything the pool started; idempotent; safe from another thread while ``generate`` waits."""
        self._started, self._closed, self._version = False, True, None
        self._close()

    @final
    def check_requests(self, requests: list[GroupRequest]) -> None:
        """The pool side of the version gate: every request is for the confirmed version, once."""
        if self._version is None:
            raise RuntimeError("the rollout pool has no confirmed weights: sync_weights must run before generate")
        stale = sorted({r.version for r in requests} - {self._version})
        if stale:
            raise RuntimeError(
                f"version gate: requests for policy version(s) {stale} reached a pool holding version {self._version}; "
                "weights must be synced (WeightSync callback) before the iteration's requests are sent"
            )
        ids = [r.prompt_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("duplicate prompt_id in one generate call: every prompt is generated exactly once")
        if len({r.group_size for r in requests}) > 1:
            raise ValueError(f"one generate call takes one group size, got {sorted({r.group_size for r in requests})}")

    def _require_started(self, doing: str) -> None:
        if not self._started:
            state = "was closed" if self._closed else "is not started"
            raise RuntimeError(f"{type(self).__name__}.{doing}: the pool {state} (call start(spec) first)")
