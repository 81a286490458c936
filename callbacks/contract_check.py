"""Checking an object against a protocol of ``lit_parl.callbacks.contracts``: what it lacks, as phrases a message
can name, and the ``TypeError`` a callback raises with them (reading attributes with ``getattr``, checking the
declared types of data members, and protocols inside protocols).

Example::

    >>> from typing import Protocol
    >>> class HasName(Protocol):
    ...     name: str
    >>> contract_problems(object(), HasName)
    ['has no `name`']
"""

from __future__ import annotations

import inspect
import numbers
import typing
from typing import Any, Protocol


def _members(protocol: type) -> dict[str, bool]:
    """The protocol's attribute names, each mapped to whether it is a method (to call) or data (to read)."""
    members: dict[str, bool] = {}
    for base in reversed(protocol.__mro__):
        if base in (Protocol, typing.Generic, object) or not getattr(base, "_is_protocol", False):
            continue
        for name in getattr(base, "__annotations__", {}):
            members[name] = False
        for name, value in vars(base).items():
            if not name.startswith("_"):
                members[name] = inspect.isfunction(value)
    return members


# numbers are duck-typed: a float field may hold 0 or a numpy float, an int field a numpy int
_NUMBERS = {int: numbers.Integral, float: numbers.Real}


def contract_problems(obj: Any, protocol: type) -> list[str]:
    """What keeps ``obj`` from satisfying ``protocol``, as phrases about it; ``[]`` if nothing does.

    Data members annotated with a class (``torch.nn.Module``, ``Sequence[...]``) are checked with
    ``isinstance``; members annotated with another protocol are checked against it, recursively.
    """
    missing, wrong = _check(obj, protocol, prefix="")
    return ([f"has no {', '.join(missing)}"] if missing else []) + wrong


def _check(obj: Any, protocol: type, prefix: str) -> tuple[list[str], list[str]]:
    missing, wrong = [], []
    hints = typing.get_type_hints(protocol)
    for name, is_method in _members(protocol).items():
        try:
            value = getattr(obj, name)
        except AttributeError:
            missing.append(f"`{prefix}{name}`")
            continue
        except Exception as error:  # a property that fails on this object's data
            wrong.append(f"has `{prefix}{name}` that raised {type(error).__name__}: {error}")
            continue
        if is_method:
            if not callable(value):
                wrong.append(f"has `{prefix}{name}` that is not callable")
            continue
        expected = typing.get_origin(hints.get(name)) or hints.get(name)
        expected = _NUMBERS.get(expected, expected)
        if getattr(expected, "_is_protocol", False):
            inner_missing, inner_wrong = _check(value, expected, prefix=f"{prefix}{name}.")
            missing += inner_missing
            wrong += inner_wrong
        elif isinstance(expected, type) and not isinstance(value, expected):
            wrong.append(f"has `{prefix}{name}` of type {type(value).__name__}, not {expected.__name__}")
    return missing, wrong


def require(obj: Any, protocol: type, *, owner: str, role: str, fix: str) -> None:
    """Raise a ``TypeError`` unless ``obj`` (``role``, e.g. "the datamodule") satisfies ``protocol``.

    The message names the callback (``owner``), the protocol, the class and every problem, then ``fix``.
    """
    problems = contract_problems(obj, protocol) if obj is not None else []
    if obj is None or problems:
        subject = "there is none" if obj is None else f"{type(obj).__name__} {' and '.join(problems)}"
        raise TypeError(f"{owner} needs {role} to satisfy lit_parl.callbacks.{protocol.__name__}, but {subject}. {fix}")
