"""The optional packages (pyproject.toml's extras): every optional import goes through ``require`` or
``require_installed``, so a missing one is refused in one line that names the extra to install.

Example::

    >>> require("json", "none", "this example").__name__
    'json'
    >>> require("no_such_module", "lora", "LoRA")
    Traceback (most recent call last):
    ...
    lit_parl.extras.MissingExtra: LoRA needs no_such_module, which is not installed: pip install 'lit-parl[lora]'
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class MissingExtra(ImportError):
    """An optional package that a chosen setting needs is not installed; the message names the extra."""


def _missing(module: str, extra: str, what: str, hint: str) -> MissingExtra:
    return MissingExtra(
        f"{what} needs {module}, which is not installed: pip install 'lit-parl[{extra}]'" + (f" {hint}" if hint else "")
    )


def require(module: str, extra: str, what: str, hint: str = "") -> ModuleType:
    """``module`` imported; if it is missing, a ``MissingExtra`` saying that ``what`` needs the extra ``extra``
    (``hint``: what else the user may do, e.g. ``"(or use logger=csv)"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        if error.name is not None and module != error.name and not module.startswith(error.name + "."):
            raise  # the package is there, but one of its own imports fails: its message says which
        raise _missing(module, extra, what, hint) from None  # the traceback of a failed import says nothing more


def require_installed(module: str, extra: str, what: str, hint: str = "") -> None:
    """Refuse as ``require`` does, without importing ``module``: for a package that another process imports
    (a rollout engine's worker, a server) or that is costly to import before it is used."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing; a module set to None in sys.modules
        found = False
    if not found:
        raise _missing(module, extra, what, hint)
