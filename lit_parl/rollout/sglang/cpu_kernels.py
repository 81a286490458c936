"""A stand-in ``sgl_kernel`` for SGLang's CPU platform, where the package is missing.

SGLang's CPU platform (``SGLANG_USE_CPU_ENGINE=1``) imports names from ``sgl_kernel`` at module level whatever the
model, but no CPU build of that package is published (its wheels carry CUDA kernels only). For what the SGLang pool
runs (a dense model, no speculative decoding) none of them is called: ``assign_req_to_token_pool_cpu``
(``sglang/srt/mem_cache/allocation.py``) is called only by speculative decoding (``alloc_for_spec_decode``); a real
CPU server's generation and weight updates ran with each of these names made to raise. Seeded sampling would call
``torch.ops.sgl_kernel.murmur_hash32_cpu``, but only under ``--enable-deterministic-inference``, which SGLang refuses
with the CPU's ``torch_native`` attention (``sglang/srt/arg_groups/overrides.py``).

``install`` makes ``import sgl_kernel`` give a module whose every name raises a ``RuntimeError`` naming itself when
called, only where no ``sgl_kernel`` is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

# imported at module level by SGLang 0.5.23 on the CPU platform, never called for a dense model without
# speculative decoding (each raises if it is)
UNCALLED = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "build_tree_kernel_efficient_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
)
UNCALLED_MAMBA = ("chunk_gated_delta_rule_cpu", "causal_conv1d_fn_cpu", "causal_conv1d_update_cpu")


def _uncalled(name: str):
    def fail(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but no CPU build of sgl_kernel is installed, and the stand-in ({__name__}) "
            "implements none of its functions: this model or feature (speculative decoding, mamba layers) needs the "
            "real kernel package"
        )

    fail.__name__ = name
    return fail


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    if name == "sgl_kernel":
        for uncalled in UNCALLED:
            setattr(module, uncalled, _uncalled(uncalled))
    elif name == "sgl_kernel.mamba":
        for uncalled in UNCALLED_MAMBA:
            setattr(module, f"{uncalled}", _uncalled(f"mamba.{uncalled}"))
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``sgl_kernel`` (and ``sgl_kernel.mamba``) as this module's stand-ins; any other submodule is missing."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ("sgl_kernel", "sgl_kernel.mamba"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module) -> None:
        pass


def install() -> bool:
    """Make ``import sgl_kernel`` give these functions, unless a real ``sgl_kernel`` is installed; whether it did."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return True
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    sys.meta_path.insert(0, _Finder())
    return True
