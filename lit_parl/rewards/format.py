"""Format rewards over tags: ``<think>...</think><answer>...</answer>``, and reading a tag's content.

``tag_format_reward`` is all or nothing: 1.0 for the tags in order, each exactly once, with nothing but
whitespace outside them; else 0.0. There is no partial credit per tag on purpose: a point for each tag
pays a model for printing tags, and a softer format term is better made by weighting this reward
against the correctness reward. Other tags are bound with ``functools.partial`` (or Hydra's
``_partial_: true`` with ``tags: [reasoning, answer]``), since ``tags`` is not a reward field.

Example::

    >>> tag_format_reward("<think>2 + 2 is 4</think>\\n<answer>4</answer>")
    1.0
    >>> tag_format_reward("<answer>4</answer><think>2 + 2 is 4</think>")
    0.0
    >>> answer_tag("<think>3?</think><answer> 4 </answer>")
    '4'
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

_TAG_NAME = re.compile(r"[A-Za-z_][\w.-]*")


def tag_format_reward(completion: str, tags: Sequence[str] = ("think", "answer")) -> float:
    """1.0 when ``completion`` is ``<tag>...</tag>`` for each of ``tags``, in order, each once, with only
    whitespace outside them (the content is free, but holds none of the tags); else 0.0.

    Args:
        completion: the completion text.
        tags: the tag names, in the order they must appear.
    """
    return float(_format_pattern(_tag_names(tags)).fullmatch(completion) is not None)


def answer_tag(text: str, tag: str = "answer") -> str | None:
    """The stripped content of the last ``<tag>...</tag>`` in ``text``; ``None`` when there is none."""
    (name,) = _tag_names((tag,))
    matches = re.findall(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def _tag_names(tags: Sequence[str]) -> tuple[str, ...]:
    # tags may come as a list (or Hydra's ListConfig); the pattern cache needs a hashable tuple
    if isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags):
        raise ValueError(f"tags must be a list of tag names such as ['think', 'answer'], got {tags!r}")
    names = tuple(tags)
    bad = [tag for tag in names if not _TAG_NAME.fullmatch(tag)]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(
            f"tags must be distinct names of letters, digits, '_', '-' or '.' (without '<' '>'), got {list(names)!r}"
        )
    return names


@functools.lru_cache(maxsize=64)
def _format_pattern(tags: tuple[str, ...]) -> re.Pattern[str]:
    # a tag's content may not open or close any of the tags: each appears exactly once
    markers = "|".join(rf"</?{re.escape(tag)}>" for tag in tags)
    content = rf"(?:(?!{markers}).)*"
    body = r"\s*".join(rf"<{re.escape(tag)}>{content}</{re.escape(tag)}>" for tag in tags)
    return re.compile(rf"\s*{body}\s*", flags=re.DOTALL)
