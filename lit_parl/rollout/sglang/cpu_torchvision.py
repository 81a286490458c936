"""``import torchvision`` made to succeed beside a CPU torch, for SGLang's server, which imports it at start.

SGLang imports torchvision eagerly (``sglang/srt/configs/__init__.py`` reaches
``sglang/srt/multimodal/internvl_utils.py``), though a text model never calls it. Two environments break that
import, and ``make_importable`` mends each where it finds it:

- torchvision installed, but a build whose compiled ops do not load beside this torch (PyPI's torchvision is a
  CUDA build): its ``_meta_registrations`` then fails registering fakes for ``torchvision::nms`` and ``qnms``,
  operators that only its library defines. Defining those two schemas first lets the import succeed; the
  operators have no kernel, so calling one raises torch's "no kernel" error.
- torchvision not installed (``make test-sglang``'s environment, where a CUDA build would break transformers'
  imports in the trainer too): a placeholder package whose attributes are inert, so SGLang's module-level uses
  pass; transformers sees no torchvision (it asks the package metadata) and never uses it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import torch

# what torchvision's _meta_registrations registers fakes for unconditionally (the others only if its ops loaded)
UNCONDITIONAL_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY = None


def _ops_load(package_dir: Path) -> bool:
    """Whether torchvision's compiled ops load beside this torch (as its ``extension`` module loads them)."""
    for library in package_dir.glob("_C*.so"):
        try:
            torch.ops.load_library(str(library))
        except OSError:
            return False
        return hasattr(torch.ops.torchvision, "nms")
    return False


def _define_schemas() -> None:
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("torchvision", "DEF")
        for schema in UNCONDITIONAL_OPS:
            _LIBRARY.define(schema)


class _Placeholder:
    """Any attribute, call or base class of the placeholder package."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs) -> _Placeholder:
        return self

    def __getattr__(self, name: str) -> _Placeholder:
        return _Placeholder()

    def __mro_entries__(self, bases) -> tuple[type, ...]:
        return (object,)


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+lit_parl_placeholder"
        return module

    def exec_module(self, module) -> None:
        pass


def make_importable() -> str:
    """Make ``import torchvision`` succeed in this process (before it is first imported); what it found:
    ``"loads"`` (nothing done), ``"schemas"`` (ops that do not load: their schemas defined) or ``"placeholder"``."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return "placeholder"
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        sys.meta_path.insert(0, _Finder())
        return "placeholder"
    if _LIBRARY is not None or not _ops_load(Path(spec.origin).parent):
        _define_schemas()
        return "schemas"
    return "loads"
