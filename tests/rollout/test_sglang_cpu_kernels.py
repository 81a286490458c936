"""The stand-in ``sgl_kernel`` that lets SGLang's CPU platform import (``lit_parl.rollout.sglang.cpu_kernels``): each
name SGLang imports is there, and calling one raises, naming it (a real server's generation and weight updates
call none of them: ``tests/sglang_contract/test_real_server.py`` runs with this stand-in)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import importlib.util, sys
from lit_parl.rollout.sglang import cpu_kernels
assert importlib.util.find_spec("sgl_kernel") is None, "a real sgl_kernel is installed here"
assert cpu_kernels.install()
from sgl_kernel import assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
from sgl_kernel.mamba import causal_conv1d_fn_cpu
try:
    assign_req_to_token_pool_cpu(1, 2)
except RuntimeError as error:
    print(error)
"""


def test_the_stand_in_sgl_kernel_has_the_names_sglang_imports_and_each_raises_naming_itself():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("sgl_kernel.assign_req_to_token_pool_cpu was called"), done.stdout
    assert "needs the real kernel package" in done.stdout, done.stdout
