"""Prompt rows and the sources that make them: what a run trains (and evaluates) on.

A ``PromptSource`` hands out ``PromptRow``s by index: a dataset file
(``lit_parl.prompts.dataset_prompts.DatasetPrompts``), or a procedural task (``lit_parl.tasks``: digit strings,
countdown). A row is either raw text (``prompt``) or a chat (``messages``, rendered by
``lit_parl.prompts.prompt_format.PromptFormat``), with an optional ``answer`` and the row's other columns as
``metadata``; rewards see all of them (``lit_parl.rewards``).

A finite source (``num_rows`` an int) is read in a shuffled order per data epoch
(``lit_parl.data.prompt_schedule.PromptSchedule``); a procedural one (``num_rows=None``) makes row ``i`` for
every ``i >= 0``, already a random draw, and is read in index order.

Example::

    >>> row = PromptRow(index=3, messages=[{"role": "user", "content": "2+2?"}], answer="4")
    >>> row.is_chat, row.answer
    (True, '4')
    >>> PromptRow(index=4, prompt="")
    Traceback (most recent call last):
    ...
    ValueError: row 4: the prompt is empty
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class PromptRow:
    """One prompt: raw text or chat messages, its answer and any other columns.

    Args:
        index: the row's index in its source (named in every error and log about it).
        prompt: the prompt text, given to the model as is (or wrapped in a user turn by a chat format).
        messages: the prompt as chat turns, each a dict with string ``role`` and ``content``.
        answer: the reference answer rewards compare against (``None``: the task has none).
        metadata: the row's other columns, passed to rewards untouched.
    """

    index: int
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    answer: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(f"row {self.index}: give exactly one of a prompt text or chat messages")
        if self.prompt is not None:
            if not isinstance(self.prompt, str):
                raise ValueError(f"row {self.index}: the prompt must be a string, got {type(self.prompt).__name__}")
            if not self.prompt.strip():
                raise ValueError(f"row {self.index}: the prompt is empty")
        if self.messages is not None:
            object.__setattr__(self, "messages", tuple(check_messages(self.messages, self.index)))
        if self.answer is not None and not isinstance(self.answer, str):
            raise ValueError(
                f"row {self.index}: the answer must be a string, got {type(self.answer).__name__} {self.answer!r} "
                "(convert the column to text, e.g. str(), when the dataset stores numbers)"
            )

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def check_messages(messages: Any, index: int) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str}``; a clear error naming the row otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(
            f"row {index}: messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
            f"got {messages!r:.80}"
        )
    checked = []
    for turn, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"row {index}: message {turn} must be a dict with string 'role' and 'content', got {message!r:.80}"
            )
        checked.append({"role": message["role"], "content": message["content"]})
    if not any(m["content"].strip() for m in checked):
        raise ValueError(f"row {index}: every message is empty")
    return checked


@runtime_checkable
class PromptSource(Protocol):
    """What the schedule draws prompts from.

    ``num_rows``: how many rows (an int), or ``None`` for a procedural source whose ``row(i)`` exists for
    every ``i >= 0``. ``row(i)`` must be deterministic: a resumed run asks for the same indices again.
    """

    @property
    def num_rows(self) -> int | None: ...

    def row(self, index: int) -> PromptRow: ...
