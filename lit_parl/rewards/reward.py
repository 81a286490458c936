"""Reward: one reward function, how it is called, and what its value may be.

A reward is a plain Python function (or any callable) whose **keyword parameters** name the fields it
wants, from this list (it gets only those, so a reward that never reads text never pays for decoding):

==================  ==============  ===============================================================
parameter           type            what it holds
==================  ==============  ===============================================================
``prompt``          ``str``         the prompt as the model saw it (chat template applied)
``completion``      ``str``         the completion, decoded without special tokens
``completion_ids``  ``list[int]``   the completion's token ids as sampled, the end token kept
``stopped``         ``bool``        ``True``: it ended itself (end token, stop token or stop string);
                                    ``False``: cut at ``max_new_tokens``
``answer``          ``str | None``  the row's answer column
``metadata``        ``dict``        the row's other columns
``messages``        ``list | None`` the row's chat messages (``None`` for a raw-text prompt)
``answer_ids``      ``list[int]``   the answer, tokenized without special tokens
``eos_id``          ``int``         the tokenizer's end token
``prompt_id``       ``int``         the prompt's draw index in the run
``env_reward``      ``float``       a multi-turn episode's environment rewards, summed (0.0 without one)
``turns``           ``list``        the episode's turns as ``(role, text)`` pairs, the model's role
                                    ``"assistant"`` (one such turn for a single-turn sample)
``conversation``    ``list[dict]``  the whole exchange as chat messages (``role``, ``content``): the
                                    row's messages (a raw prompt as one user turn), then ``turns``;
                                    what a reward model or a judge reads through its own template
==================  ==============  ===============================================================

It returns a number (``float``, ``int`` or ``bool``), or a ``dict`` of named numbers: the reward is
then their sum, and each is logged as ``reward/<name>/<key>``. A string, ``None`` or anything else is an
error, always. A raised exception, a timeout or a NaN/inf value follows the scorer's policy
(``lit_parl.rewards.ScoringPolicy``): stop the run, or score a configured value and count it.

**Batched** (``Reward(fn, batched=True)``, or a callable with an attribute ``batched = True``): each
parameter receives a list, one entry per sample of a group, and the function returns a list of values.
**Async** (``async def``): the samples of a group are awaited concurrently, on one long-lived event loop
of the rewards' own, in a thread of its own (never the pool's, and never one the caller runs).

Example::

    >>> def exact(completion: str, answer: str) -> float:
    ...     return float(completion.strip() == answer)
    >>> reward = Reward(exact, weight=2.0)
    >>> reward.name, reward.fields, reward.needs_text
    ('exact', ('completion', 'answer'), True)
    >>> reward.values(reward.call({"completion": " 4", "answer": "4"}))
    {'exact': 1.0}
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

REWARD_FIELDS = (
    "prompt",
    "completion",
    "completion_ids",
    "stopped",
    "answer",
    "metadata",
    "messages",
    "answer_ids",
    "eos_id",
    "prompt_id",
    "env_reward",
    "turns",
    "conversation",
)
TEXT_FIELDS = ("prompt", "completion", "turns", "conversation")  # decoded only when a reward asks for them


class RewardError(RuntimeError):
    """A reward failed (raised, timed out, or returned a non-finite value) under ``on_error="error"``."""


def _signature_fields(fn: Callable, name: str) -> tuple[str, ...]:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"reward {name!r}: cannot read its signature ({error}); "
            f"define it with keyword parameters from {REWARD_FIELDS}"
        ) from error
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return REWARD_FIELDS  # **kwargs: everything
    fields = []
    for p in parameters:
        if p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY):
            raise TypeError(
                f"reward {name!r}: parameter {p.name!r} must be passable by keyword "
                f"(rewards are called with keywords from {REWARD_FIELDS})"
            )
        if p.name in REWARD_FIELDS:
            fields.append(p.name)
        elif p.default is p.empty:
            raise TypeError(
                f"reward {name!r} requires a parameter {p.name!r}, which is not a reward field; name its parameters "
                f"from {REWARD_FIELDS} (bind anything else with functools.partial or Hydra's _partial_)"
            )
    if not fields:
        raise TypeError(f"reward {name!r} takes none of the reward fields {REWARD_FIELDS}")
    return tuple(fields)


class Reward:
    """A reward function with its name and weight in the total.

    Args:
        fn: the function (sync or ``async def``), or any callable; its keyword parameters name its fields. A
            string names one: ``package.module.function``, or ``path/to/file.py:function`` for a file of one's own.
        name: the metric name (``reward/<name>``); default the function's name.
        weight: its factor in the total reward (the sum over rewards of weight x value).
        batched: called once per group with lists (default: the callable's own ``batched`` attribute, else False).

    A subclass may set ``concurrent_groups``: how many groups it should be given at once (a reward model batches
    their samples together; a judge overlaps their requests). With ``score_workers`` left ``None`` the scorer
    runs as many threads as the largest such number (0, the default: each group scored where the batcher runs).
    """

    concurrent_groups: int = 0
    failure_reported: bool = False  # set by score_group once it has reported this reward's first failure

    def __init__(
        self, fn: Callable | str, name: str | None = None, weight: float = 1.0, batched: bool | None = None
    ) -> None:
        if isinstance(fn, str):
            fn = load_function(fn)
        if not callable(fn):
            raise TypeError(f"Reward(fn={fn!r}): a reward is a callable (a function, or an object with __call__)")
        self.fn = fn
        inner = (
            fn.func if isinstance(fn, functools.partial) else fn
        )  # a partial (Hydra's _partial_) is named by its function
        self.name = name or getattr(inner, "__name__", None) or type(inner).__name__
        if not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward {self.name!r}: weight must be a finite number, got {weight!r}")
        self.weight = float(weight)
        self.batched = bool(getattr(fn, "batched", False)) if batched is None else batched
        self.fields = _signature_fields(fn, self.name)
        call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)

    @property
    def needs_text(self) -> bool:
        return any(f in TEXT_FIELDS for f in self.fields)

    def call(self, inputs: Mapping[str, Any]):
        """Call the function with the fields it takes (a coroutine for an async reward)."""
        return self.fn(**{f: inputs[f] for f in self.fields})

    def values(self, value: Any) -> dict[str, float]:
        """One sample's returned value as ``{metric name: number}``; TypeError for anything but numbers."""
        if isinstance(value, Mapping):
            if not value:
                raise TypeError(
                    f"reward {self.name!r} returned an empty dict; return a number or a dict of named numbers"
                )
            if "failures" in value:  # reward/<name>/failures counts failed calls
                raise TypeError(
                    f"reward {self.name!r} returned a component named 'failures', "
                    "a name the failure count uses; rename it"
                )
            return {f"{self.name}/{key}": self._number(item, f"{self.name}/{key}") for key, item in value.items()}
        return {self.name: self._number(value, self.name)}

    def _number(self, value: Any, what: str) -> float:
        if isinstance(value, bool) or (isinstance(value, (int, float)) and not isinstance(value, complex)):
            return float(value)
        try:  # numpy and torch scalars
            import numbers

            if isinstance(value, numbers.Real):
                return float(value)
            if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
                return float(value.item())
        except (TypeError, ValueError):
            pass
        raise TypeError(
            f"reward {what!r} returned {type(value).__name__} {value!r:.60}; "
            "a reward returns a number (or a dict of named numbers)"
        )

    def __repr__(self) -> str:
        return (
            f"Reward({self.name!r}, weight={self.weight}, fields={self.fields}"
            f"{', batched' if self.batched else ''}{', async' if self.is_async else ''})"
        )


def load_function(spec: str) -> Callable:
    """The function ``spec`` names: ``package.module.function`` or ``path/to/file.py:function``."""
    import importlib
    import importlib.util
    from pathlib import Path

    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, name = spec.split(":", 1)
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise ImportError(f"reward {spec!r}: no file {file} (a path is read from the directory the run starts in)")
        module_spec = importlib.util.spec_from_file_location(f"lit_parl_user_rewards.{file.stem}", file)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module_name, _, name = spec.rpartition(".")
        if not module_name:
            raise ImportError(
                f"reward {spec!r}: name a function as package.module.function or path/to/file.py:function"
            )
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(
                f"reward {spec!r}: cannot import module {module_name!r} ({error}); "
                f"for a file of your own use path/to/file.py:{name}"
            ) from error
    if not hasattr(module, name):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))[:20]
        raise ImportError(f"reward {spec!r}: {module.__name__} has no {name!r} (it has: {', '.join(public)})")
    return getattr(module, name)


def as_reward(value: Reward | Callable) -> Reward:
    """A ``Reward`` as is; a plain callable wrapped with weight 1."""
    return value if isinstance(value, Reward) else Reward(value)
