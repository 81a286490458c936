"""A stand-in ``torchvision`` module, so that SGLang's server code imports on a machine without a GPU.

SGLang imports torchvision eagerly (its multimodal processors), and the torchvision wheels on PyPI are
CUDA builds that do not load beside the CPU build of torch. Nothing the contract tests call uses
torchvision: every attribute of the fake modules is an inert placeholder. ``install`` must run before
the first ``import sglang``; it does nothing where a real torchvision is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

FAKED = ("torchvision",)


class _Placeholder:
    """Any attribute, call or base class of the fake modules."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> _Placeholder:
        return self

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __mro_entries__(self, bases) -> tuple[type, ...]:
        return (object,)


class _FakeModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in FAKED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _FakeModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+lit_parl_cpu_shim"
        return module

    def exec_module(self, module) -> None:
        pass


def install() -> None:
    """Fake ``torchvision`` from now on in this process, unless a real one is installed."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    if importlib.util.find_spec("torchvision") is not None:
        return
    sys.meta_path.insert(0, _Finder())
