r"""What the callbacks of ``lit_parl.callbacks`` need from the Trainer's module, datamodule and callbacks.

Each callback states its needs as the ``typing.Protocol`` classes below and checks them once, when fit
starts, so that a project missing a piece fails there with a message naming the attribute, the class
that lacks it and how to provide it, instead of training while a callback silently records nothing.
Any LightningModule / LightningDataModule satisfies them by having the attributes: nothing here has to
be subclassed, and nothing here imports the rest of lit_parl.

============================  ==================================  =========================================
callback                      needs                               from
============================  ==================================  =========================================
``WeightSync``                ``WeightReceiver``                  its ``pool`` argument, or the datamodule's
                                                                  ``pool`` (``HasRolloutPool``)
\                             ``SharedWeightReceiver`` (a         the same receiver
                              receiver every rank reaches)
\                             ``AdapterReceiver`` (optional)      the same receiver
\                             ``HasPolicy`` (unless               the LightningModule
                              ``policy_tensors`` is overridden)
\                             ``IterationGate`` (optional)        the datamodule
``RunSummary``                ``IterationHistory``                the datamodule
\                             ``TrainIntervals``                  the LightningModule
``PipelineTimeline``          ``IterationHistory``                the datamodule
\                             ``TrainIntervals``                  the LightningModule
\                             ``SyncTimes`` (optional)            one other callback (``WeightSync``)
``HFExport``                  ``HasPolicy``, and the policy a     the LightningModule
                              ``SavesPretrained``
``CompletionSamples``         ``HasTokenizer``                    the LightningModule
\                             ``SampleBatch``, ``SampleRecord``   each training batch and its samples
============================  ==================================  =========================================

The protocols are ``runtime_checkable``, but the callbacks check them with ``contract_problems``: it
reads attributes with ``getattr``, so a submodule a ``torch.nn.Module`` keeps in ``_modules`` counts (from
Python 3.12 ``isinstance`` looks attributes up statically and would miss it), and it checks the declared
types of attributes (``policy`` a ``torch.nn.Module``, ``history`` a sequence, ...), not just their names.

Example::

    >>> import torch
    >>> class Module:
    ...     policy = torch.nn.Linear(2, 2)
    >>> contract_problems(Module(), HasPolicy)
    []
    >>> class Pool:
    ...     sync_weights = None
    >>> class DataModule:
    ...     pool = Pool()
    >>> contract_problems(DataModule(), HasRolloutPool)
    ['has `pool.sync_weights` that is not callable']
    >>> require(object(), HasPolicy, owner="HFExport", role="the LightningModule", fix="Set `self.policy`.")
    Traceback (most recent call last):
    ...
    TypeError: HFExport needs the LightningModule to satisfy lit_parl.callbacks.HasPolicy, but object has no `policy`.
    Set `self.policy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .contract_check import contract_problems, require

__all__ = [
    "AdapterReceiver",
    "HasPolicy",
    "HasRolloutPool",
    "HasTokenizer",
    "IterationGate",
    "IterationHistory",
    "IterationRecord",
    "SampleBatch",
    "SampleRecord",
    "SavesPretrained",
    "SharedWeightReceiver",
    "SyncTimes",
    "TokenDecoder",
    "TrainIntervals",
    "WeightReceiver",
    "contract_problems",
    "require",
]

WeightBucket = Sequence[tuple[str, torch.Tensor]]
Interval = tuple[float, float]  # (start, end), time.monotonic() seconds


@runtime_checkable
class WeightReceiver(Protocol):
    """Takes the policy's weights: a rollout pool (``lit_parl.rollout.RolloutPool``), a parameter server, ...

    ``buckets`` is an iterable of buckets, each a sequence of ``(name, tensor)``; together they name every
    parameter once. It may be a generator that gathers each bucket only when asked for it, so consume it
    once, in order, and copy what must outlive the call. Return once ``version`` is loaded everywhere.
    """

    def sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None: ...


@runtime_checkable
class AdapterReceiver(Protocol):
    """A receiver whose engines load LoRA adapters beside the base they hold (``takes_lora_adapters``): for a policy
    with LoRA layers ``WeightSync`` pushes the base once per fit (``sync_weights``), then each version's adapter
    alone: ``buckets`` of its A and B under peft's names, ``config`` peft's adapter config (a JSON-able dict)."""

    takes_lora_adapters: bool

    def sync_adapter(self, buckets: Iterable[WeightBucket], config: dict, version: int) -> None: ...


@runtime_checkable
class SharedWeightReceiver(Protocol):
    """A receiver every rank reaches (``shared_across_ranks``: SGLang servers): rank 0 pushes, and every other
    rank's object then takes the version the push left on it, on the engines at rank 0's ``address()``
    (``lit_parl.rollout.shared_pool``)."""

    shared_across_ranks: bool

    def sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None: ...

    def address(self) -> dict: ...

    def adopt_version(self, version: int, address: dict | None) -> None: ...


@runtime_checkable
class IterationGate(Protocol):
    """Holds back an iteration's data until its weights are in place (``lit_parl.RolloutDataModule`` does)."""

    def open_iteration(self, version: int) -> None: ...


@runtime_checkable
class HasRolloutPool(Protocol):
    """A datamodule that owns the pool it generates with."""

    pool: WeightReceiver


@runtime_checkable
class HasPolicy(Protocol):
    """A LightningModule whose trained model is the ``policy`` submodule."""

    policy: torch.nn.Module


@runtime_checkable
class SavesPretrained(Protocol):
    """A Hugging Face ``PreTrainedModel`` (or anything that saves itself the same way)."""

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> Any: ...


@runtime_checkable
class IterationRecord(Protocol):
    """One iteration's rollout side, as ``lit_parl.data.iteration_stats.IterationStats`` records it."""

    version: int
    requested_at: float  # monotonic time of the iteration's first request
    completed_at: float  # monotonic time of its last micro-batch
    completions: int
    completion_tokens: int
    reward_sum: float
    prompts_drawn: int
    dropped_groups: int
    gen_intervals: Sequence[Interval]  # when the pool was generating

    @property
    def reward_mean(self) -> float: ...

    @property
    def gen_busy_s(self) -> float: ...


@runtime_checkable
class IterationHistory(Protocol):
    """A datamodule that appends one ``IterationRecord`` per iteration before the iteration's epoch ends."""

    history: Sequence[IterationRecord]


@runtime_checkable
class TrainIntervals(Protocol):
    """A LightningModule that times its training steps of the current iteration (reset at each epoch start)."""

    train_intervals: Sequence[Interval]


@runtime_checkable
class SyncTimes(Protocol):
    """A callback that times each weight sync, one interval per iteration (``WeightSync``)."""

    sync_intervals: Sequence[Interval]


@runtime_checkable
class TokenDecoder(Protocol):
    """Turns token ids back into text: any Hugging Face tokenizer (``PreTrainedTokenizerBase``)."""

    def batch_decode(self, sequences: Any, **kwargs: Any) -> list[str]: ...


@runtime_checkable
class HasTokenizer(Protocol):
    """A LightningModule that keeps the tokenizer of its policy as ``tokenizer``."""

    tokenizer: TokenDecoder


@runtime_checkable
class SampleRecord(Protocol):
    """One trained sample, as ``lit_parl.data.micro_batch.Trajectory`` records it."""

    prompt_id: int
    sample_index: int
    version: int  # the policy version that generated it
    prompt_tokens: Sequence[int]
    completion_tokens: Sequence[int]
    reward: float  # the total: the weighted sum of the reward components
    advantage: float
    truncated: bool  # cut at the length limit
    correct: bool
    reward_components: Mapping[str, float]  # each reward's value (failed calls left out)
    reward_failures: Sequence[str]  # the rewards whose call failed on this sample


@runtime_checkable
class SampleBatch(Protocol):
    """A training batch that carries the samples it was built from (``lit_parl.data.micro_batch.MicroBatch``).

    A batch may also have ``pass_index``: 0 on the first pass over an iteration's samples, more when later
    passes train on the same samples again (none: every batch is a first pass).
    """

    trajectories: Sequence[SampleRecord]
