"""Torch implementations of the ``sgl_kernel`` functions SGLang's CPU platform calls, for where the package is missing.

SGLang's CPU platform (``SGLANG_USE_CPU_ENGINE=1``) imports ``sgl_kernel`` whatever the model, but no CPU build of
that package is published (its wheels carry CUDA kernels only). A dense model in float32 calls one of its
functions, ``assign_req_to_token_pool_cpu`` (``sglang/srt/mem_cache/allocation.py``, on every request): it writes
each request's KV-cache slots into its row of the request-to-token table, implemented here in plain torch after
the Triton kernel SGLang runs on a GPU (``assign_req_to_token_pool``). Seeded sampling would call
``torch.ops.sgl_kernel.murmur_hash32_cpu``, but only under ``--enable-deterministic-inference``, which SGLang
refuses with the CPU's ``torch_native`` attention (``sglang/srt/arg_groups/overrides.py``).

Other names are imported at module level for KV moves, speculative decoding and mamba layers; calling one of
those raises a ``RuntimeError`` naming it. ``install`` makes ``import sgl_kernel`` give this module's functions,
only where no ``sgl_kernel`` is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import torch

# imported at module level by SGLang 0.5.23 on the CPU platform, never called for a dense model without
# speculative decoding (each raises if it is)
UNCALLED = (
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


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row ``req_pool_indices[i]`` of ``req_to_token``, columns ``start_offset[i]:end_offset[i]``, takes the next
    ``end - start`` entries of ``out_cache_loc`` (request i's slots follow those of requests 0..i-1)."""
    offset = 0
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    for row, start, end in zip(rows, starts, ends, strict=True):
        if end > pool_len:
            raise RuntimeError(f"assign_req_to_token_pool_cpu: column {end} is past the pool's {pool_len}")
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start].to(req_to_token.dtype)
        offset += end - start


def _uncalled(name: str):
    def fail(*args, **kwargs):
        raise RuntimeError(
            f"sgl_kernel.{name} was called, but no CPU build of sgl_kernel is installed and lit_parl implements only "
            f"what a dense model's generation calls ({__name__}): this model or feature needs the real kernel package"
        )

    fail.__name__ = name
    return fail


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__path__ = []
    if name == "sgl_kernel":
        module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu
        for uncalled in UNCALLED:
            setattr(module, uncalled, _uncalled(uncalled))
    elif name == "sgl_kernel.mamba":
        for uncalled in UNCALLED_MAMBA:
            setattr(module, f"{uncalled}", _uncalled(f"mamba.{uncalled}"))
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``sgl_kernel`` (and ``sgl_kernel.mamba``) as this module's functions; any other submodule is missing."""

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
