"""The SGLang pool's settings, one small frozen dataclass per concern.

``SGLangRolloutPool`` takes each as the object or as a dict of its fields (what Hydra gives for a node without
``_target_``, and what JSON gives); ``None`` is the defaults. ``conf/pool/sglang.yaml`` mirrors them node by node.

>>> from dataclasses import replace
>>> sync = SyncSettings(method="distributed", master_address="10.0.0.1")
>>> sync.master_port, replace(sync, method="disk").method
(29650, 'disk')
>>> ServerSettings(urls=["http://infer1:30000/"]).urls
('http://infer1:30000',)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lit_parl.rollout.adapter_pool import check_adapter_mode

LAUNCH_DEVICES = ("auto", "cuda", "cpu")  # lit_parl.rollout.sglang.commands.launches_on_cpu
SERVER_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # sglang.launch_server --dtype
SYNC_METHODS = ("tensor", "distributed", "disk")  # lit_parl.rollout.sglang.weights


def _frozen(value):
    """Lists (Hydra's ``ListConfig`` too), nested ones included, as tuples: the settings are frozen and hashable."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(_frozen(item) for item in value)
    return value


@dataclass(frozen=True)
class ServerSettings:
    """Which SGLang servers generate: running ones to attach to, or ones the pool launches (``LaunchSettings``).

    Args:
        urls: running servers to attach to, ``http://host:port`` each; the pool never stops them. ``None``:
            launch ``LaunchSettings.num_servers`` servers.
        tp_size: tensor-parallel GPUs per server, of attached servers too: a ``tensor`` sync sends each rank a
            payload of its own, and a ``distributed`` one gives each rank a place in the weight-update group.
        deterministic_inference: each sample carries its own ``sampling_seed``, which SGLang honours only on a
            server started with ``--enable-deterministic-inference`` (slower kernels): launched servers get the
            flag, and an attached server without it is named in a warning, since its samples then do not follow
            their seeds (a retried sample, or an iteration regenerated after a resume, differs). ``False``: no
            flag, no warning.
        attach_timeout_s: how long an attached server may take to answer ``/health`` when the pool starts.
        membership_file: a file of servers, ``URL [capacity]`` per line, read before each iteration's weight push:
            when it exists, the attached servers become those it lists (``lit_parl.rollout.sglang.membership``).
            ``None``: the servers change only by ``SGLangRolloutPool.add_server``/``remove_server`` or failures.
    """

    urls: tuple[str, ...] | None = None
    tp_size: int = 1
    deterministic_inference: bool = True
    attach_timeout_s: float = 10.0
    membership_file: str | None = None

    def __post_init__(self) -> None:
        if self.urls is not None:
            if isinstance(self.urls, str) or not self.urls:
                raise ValueError(
                    f"ServerSettings(urls={self.urls!r}): give a list of server URLs, or None to launch servers"
                )
            object.__setattr__(self, "urls", tuple(url.rstrip("/") for url in self.urls))


@dataclass(frozen=True)
class LaunchSettings:
    """How the pool launches its servers (and the router), when ``ServerSettings.urls`` is unset.

    Args:
        num_servers: servers to launch; server ``i`` listens on ``port + i``.
        model_path: what they load (a local directory or hub name); ``None``: the ``PoolSpec``'s model
            directory. The first sync brings the trainer's weights either way.
        host: where launched servers and the router listen, and where the pool reaches them.
        port: the first server's port.
        gpu_ids: each server's GPUs, set as its ``CUDA_VISIBLE_DEVICES``: a list per server, or a flat list handed
            out ``ServerSettings.tp_size`` at a time, exactly ``num_servers * tp_size`` ids; an integer is a GPU as
            the trainer numbers them (``lit_parl.rollout.gpu_placement``, as the vLLM pool reads them). ``None``:
            SGLang's default placement. A ``tensor`` sync needs the trainer's GPU visible to the server.
        device: where launched servers run: ``cuda``, ``cpu`` (SGLang's CPU platform, through
            ``lit_parl.rollout.sglang.cpu_server`` with ``commands.CPU_ARGS``: float32, PyTorch attention) or
            ``auto``: the CPU where torch sees no GPU.
        dtype: on a GPU, the servers' ``--dtype``: ``bfloat16``, the trainer's compute precision under ``bf16-mixed``.
            SGLang's own default, ``auto``, serves a float32 checkpoint (the trainer saves one) in float16.
            ``None``: no flag.
        mem_fraction_static: SGLang's ``--mem-fraction-static`` (lower it when the trainer shares the GPU).
        args: more ``sglang.launch_server`` arguments, e.g. ``["--attention-backend", "fa3"]``.
        command: what runs a server, before its arguments; ``None``: ``python -m sglang.launch_server`` with
            this Python (on the CPU, ``python .../cpu_server.py``; the tests use a stand-in).
        start_timeout_s: how long a launched server, or the router, may take to answer ``/health``.
    """

    num_servers: int = 1
    model_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    gpu_ids: tuple | None = None
    device: str = "auto"
    dtype: str | None = "bfloat16"
    mem_fraction_static: float | None = None
    args: tuple[str, ...] = ()
    command: tuple[str, ...] | None = None
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"LaunchSettings(num_servers={self.num_servers}): at least one server is needed")
        if self.device not in LAUNCH_DEVICES:
            raise ValueError(f"LaunchSettings(device={self.device!r}): choose one of {LAUNCH_DEVICES}")
        if self.dtype is not None and self.dtype not in SERVER_DTYPES:
            raise ValueError(f"LaunchSettings(dtype={self.dtype!r}): SGLang serves one of {SERVER_DTYPES}")
        object.__setattr__(self, "gpu_ids", _frozen(self.gpu_ids))
        object.__setattr__(self, "args", _frozen(self.args))
        object.__setattr__(self, "command", _frozen(self.command) if self.command else None)


@dataclass(frozen=True)
class RouterSettings:
    """``sglang_router`` in front of the servers, launched by the pool on ``LaunchSettings.host``.

    Generation goes through the router, which balances it; weight updates still go to every server, so that
    each one's version is confirmed.

    Args:
        enabled: launch the router (in front of launched and attached servers alike).
        port: where it listens.
        args: more ``sglang_router.launch_router`` arguments, e.g. ``["--policy", "round_robin"]``.
    """

    enabled: bool = False
    port: int = 30100
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", _frozen(self.args))


@dataclass(frozen=True)
class SyncSettings:
    """How the trainer's weights reach the servers each iteration (``lit_parl.rollout.sglang.weights``).

    Args:
        method: ``tensor`` (CUDA IPC handles: the servers on the trainer's node), ``distributed`` (an NCCL
            broadcast: servers on other GPUs or nodes) or ``disk`` (safetensors files in ``dir``).
        dir: ``disk``: a directory every server can read; ``None``: the pool's work directory.
        master_address: ``distributed``: the trainer's address as the servers reach it, where the weight-update
            group meets (the trainer is its rank 0).
        master_port: ``distributed``: the port of that rendezvous, on the trainer's node.
        backend: ``distributed``: the group's ``torch.distributed`` backend.
        group_name: ``distributed``: the group's name on the servers.
        lora: how a policy trained with LoRA adapters reaches the servers: ``merged`` (base + (α / r) B A, as full
            weights, by ``method``) or ``adapter`` (the base once per fit by ``method``, then each iteration's
            adapter alone, loaded by SGLang's LoRA support: ``lit_parl.rollout.sglang.adapters``).
        max_lora_rank: ``adapter``: the largest adapter rank the servers make room for (launched servers get
            ``--enable-lora --max-lora-rank``; attached ones must have been started so).
    """

    method: str = "tensor"
    dir: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 29650
    backend: str = "nccl"
    group_name: str = "lit_parl_weight_update"
    lora: str = "merged"
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.method not in SYNC_METHODS:
            raise ValueError(f"SyncSettings(method={self.method!r}): choose one of {SYNC_METHODS}")
        check_adapter_mode(self.lora, "SyncSettings")
        if self.max_lora_rank < 1:
            raise ValueError(f"SyncSettings(max_lora_rank={self.max_lora_rank}): an adapter's rank is at least 1")


@dataclass(frozen=True)
class RequestSettings:
    """How the pool's HTTP requests are sent, and how often a failed one is sent again.

    Args:
        timeout_s: the timeout of one HTTP request (a ``/generate`` or a weight update).
        max_retries: how often a failed ``/generate`` (refused or reset connection, timeout, HTTP 5xx, an aborted
            sample) is sent again, to another live server.
        max_groups_in_flight: groups generating at once (each sends its G samples together).
    """

    timeout_s: float = 600.0
    max_retries: int = 3
    max_groups_in_flight: int = 1024

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"RequestSettings(max_retries={self.max_retries}): must be >= 0")
