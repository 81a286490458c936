"""``as_settings``: a settings dataclass taken as itself, as a dict of its fields, or as ``None`` (its defaults).

Components take their settings this way so one argument serves Python callers (the object), Hydra (a config
node without ``_target_`` arrives as a dict) and JSON alike.

Example::

    >>> from lit_parl.rollout.records import SamplingParams
    >>> as_settings(SamplingParams, {"max_new_tokens": 8}).max_new_tokens
    8
    >>> as_settings(SamplingParams, None) == SamplingParams()
    True
"""

from __future__ import annotations

from typing import Any, TypeVar

Settings = TypeVar("Settings")


def as_settings(kind: type[Settings], value: Settings | dict[str, Any] | None) -> Settings:
    """A ``kind`` from itself, a dict of its fields (Hydra, JSON) or ``None`` (the defaults)."""
    return value if isinstance(value, kind) else kind(**(value or {}))
