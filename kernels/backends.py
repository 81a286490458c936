"""Which shared-prompt attention backend runs where, and in which dtype (``lit_parl.kernels.attention`` runs them).

``resolve_backend`` turns a requested name (``auto`` or one of ``BACKENDS``) into one that can run forward and
backward on the device, computing in the given dtype, or refuses with an error that says why and what to change.

Example::

    >>> resolve_backend("auto", "cpu", torch.float32), available_backends("cpu")
    ('sdpa', ['sdpa', 'dense'])
"""

from __future__ import annotations

import importlib.util

import torch

from lit_parl.extras import require_installed

BACKENDS = ("sdpa", "flex", "flash", "npu", "dense")
HALF_PRECISION = (torch.float16, torch.bfloat16)
# backends whose kernels take float16/bfloat16 only: flash-attn refuses anything else ("FlashAttention only
# support fp16 and bf16 data type"); npu_fusion_attention is documented for FLOAT16/BFLOAT16 (float32 only in
# some later torch_npu releases, so it is not relied on)
HALF_ONLY = {"flash": "flash-attn's flash_attn_varlen_func", "npu": "torch_npu's npu_fusion_attention"}
# backends whose kernels are extras: (the device they run on, the package, the extra)
EXTRAS = {"flash": ("cuda", "flash_attn", "flash-attn"), "npu": ("npu", "torch_npu", "torch-npu")}


def _device_type(device: torch.device | str) -> str:
    # "npu" is a device type only once torch_npu is imported: read a name without torch.device
    return device.split(":")[0] if isinstance(device, str) else device.type


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run forward and backward on ``device``."""
    kind = _device_type(device)
    names = ["sdpa", "dense"]
    if kind == "cuda":
        names.append("flex")
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash")
    if kind == "npu" and importlib.util.find_spec("torch_npu") is not None:
        names.append("npu")
    return names


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in for ``tensor``: the autocast dtype inside an autocast region on its
    device (Lightning's ``bf16-mixed``: float32 weights, bfloat16 compute), else its own dtype."""
    kind = tensor.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else tensor.dtype


def check_dtype(backend: str, dtype: torch.dtype) -> None:
    """Refuse, naming the fix, a backend whose kernel cannot compute in ``dtype`` (flash and npu: float16 or
    bfloat16 only)."""
    if backend in HALF_ONLY and dtype not in HALF_PRECISION:
        raise ValueError(
            f"attention backend {backend!r} computes in float16/bfloat16 only "
            f"({HALF_ONLY[backend]} refuses {dtype}). Train in "
            "bfloat16 with float32 master weights: Trainer(precision='bf16-mixed') (lit-parl trainer=gpu, or "
            "trainer.precision=bf16-mixed), or load the model in bfloat16 (model.dtype=bfloat16); or keep float32 with "
            "module.attention_backend=flex (CUDA) or sdpa"
        )


def resolve_backend(requested: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """The backend to run on ``device`` computing in ``dtype`` (``compute_dtype``; ``None``: not known yet).

    ``auto`` picks flash (CUDA with flash-attn), flex (CUDA), npu (Ascend), else sdpa, leaving out flash and
    npu for a float32 ``dtype`` (their kernels take float16/bfloat16 only). An explicit name that cannot run on
    ``device``, or in ``dtype``, is an error that says why and what to change.

    Example::

        >>> resolve_backend("auto", "cpu", torch.float32)
        'sdpa'
    """
    available = available_backends(device)
    if requested == "auto":
        for name in ("flash", "flex", "npu", "sdpa"):
            if name in available and (dtype is None or dtype in HALF_PRECISION or name not in HALF_ONLY):
                return name
    if requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is unknown; choose auto or one of {BACKENDS}")
    if requested in EXTRAS and _device_type(device) == EXTRAS[requested][0]:  # the device, not the package
        require_installed(*EXTRAS[requested][1:], f"module.attention_backend={requested}")
    if requested not in available:
        needs = {
            "flex": "a CUDA device (flex_attention has no backward on CPU)",
            "flash": "a CUDA device and the flash-attn package (pip install 'lit-parl[flash-attn]')",
            "npu": "an Ascend NPU and torch_npu (pip install 'lit-parl[torch-npu]')",
        }[requested]
        raise ValueError(
            f"attention backend {requested!r} cannot run on {_device_type(device)}: it needs {needs}. "
            f"Available here: {available}"
        )
    if dtype is not None:
        check_dtype(requested, dtype)
    return requested
