"""Every ``>>>`` example in the package's docstrings runs, as part of the suite."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import lit_parl
import lit_parl.callbacks
import lit_parl.kernels

# callbacks/ and kernels/ live outside lit_parl/ in the source tree: walk each package's own path
PACKAGES = (lit_parl, lit_parl.callbacks, lit_parl.kernels)


def _modules() -> list[str]:
    names = [
        package.__name__ for package in PACKAGES[1:] if any(t.examples for t in doctest.DocTestFinder().find(package))
    ]
    for info in (i for package in PACKAGES for i in pkgutil.walk_packages(package.__path__, package.__name__ + ".")):
        # the entry point runs on import; configs hold no code; vLLM is an extra
        if info.name == "lit_parl.__main__" or info.name.startswith(("lit_parl.conf", "lit_parl.rollout.vllm_pool")):
            continue
        if info.name in names:
            continue
        if any(test.examples for test in doctest.DocTestFinder().find(importlib.import_module(info.name))):
            names.append(info.name)
    return names


MODULES = _modules()


def test_the_examples_are_found():
    for name in (
        "lit_parl.data.iteration_shape",
        "lit_parl.rollout.rollout_pool",
        "lit_parl.callbacks.weight_sync",
        "lit_parl.trainer.grpo_module",
    ):
        assert name in MODULES, name


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, f"{name}: {result}"
