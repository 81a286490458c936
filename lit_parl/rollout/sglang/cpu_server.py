"""SGLang's server on the CPU: ``python path/to/cpu_server.py <sglang.launch_server arguments>``.

What the SGLang pool launches on a machine without a GPU (``commands.CPU_ARGS`` gives the flags). It runs
by path, not with ``-m``: then nothing of lit_parl is imported before the mends below (``lit_parl.rollout``
imports transformers, which imports torchvision). A plain
``python -m sglang.launch_server`` fails there in two ways that this module mends at import, before SGLang is
imported, each only where the installed packages need it:

- ``import torchvision`` fails beside a CPU torch (``cpu_torchvision.make_importable``);
- SGLang's CPU platform imports ``sgl_kernel``, which has no CPU build (``cpu_kernels.install``).

It also sets ``SGLANG_USE_CPU_ENGINE=1``, without which SGLang does not take the CPU platform
(``sglang/srt/utils/common.py``, ``is_cpu``). SGLang's scheduler and detokenizer are spawned processes, which
import the main module of their parent again (as ``__mp_main__``): the mends, made at import, reach them too.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    """This package's module ``name``, imported from its file alone (not through ``lit_parl.rollout``)."""
    spec = importlib.util.spec_from_file_location(f"lit_parl_cpu_server_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.library and dataclasses look their module up
    spec.loader.exec_module(module)
    return module


if __package__:  # imported as lit_parl.rollout.sglang.cpu_server (the pool, to build the command)
    from lit_parl.rollout.sglang import cpu_kernels, cpu_torchvision
else:  # run by path: the server itself, or a process SGLang spawned from it
    if sys.path and Path(sys.path[0]).resolve() == HERE:
        sys.path.pop(0)  # this package's modules (client, settings, ...) must not shadow top-level ones
    cpu_kernels, cpu_torchvision = _sibling("cpu_kernels"), _sibling("cpu_torchvision")

if not __package__:
    os.environ[CPU_ENGINE_ENV] = "1"  # read by SGLang's is_cpu() in this process and in the spawned ones
    cpu_torchvision.make_importable()
    cpu_kernels.install()


def missing_sglang(python: str = sys.executable) -> str | None:
    """Why SGLang's server cannot run with this Python, with the fix; ``None`` if it can."""
    if importlib.util.find_spec("sglang") is None:
        return (
            f"sglang is not installed for {python}: build the pinned CPU environment with "
            "`make .venv-sglang/.installed` and run with .venv-sglang/bin/python, or attach to running servers "
            "with pool.servers.urls"
        )
    return None


def main() -> None:
    problem = missing_sglang()
    if problem is not None:
        sys.exit(f"lit_parl.rollout.sglang.cpu_server: {problem}")
    # run sglang.launch_server as the program, this module staying __main__ for the processes SGLang spawns
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
