"""Adapter-only weight sync to SGLang servers: each version's LoRA adapter, loaded from tensors beside the base.

A server serves adapters when started with ``--enable-lora`` and room for them (``lora_launch_args``: launched
servers get them; start attached ones with the same). After the base (one ordinary weight sync per fit), each
push (``AdapterLoader.load``) does, on every live server:

1. ``/load_lora_adapter_from_tensors``: the adapter as ``adapter_name(k)``, its tensors pickled by value (CPU
   tensors in a plain pickle, base64 in the JSON, so it reaches a server on another node; SGLang's unpickler
   admits tensors), one payload per tensor-parallel rank, with peft's config;
2. ``/unload_lora_adapter`` of the previous version's (SGLang refuses to load a name it holds, so each version
   has a name of its own);
3. ``/update_weight_version`` to k: loading an adapter leaves the reported version as it was, and each sample's
   ``meta_info.weight_version`` is what the trainer's on-policy check reads.

Then every server must report k. Each ``/generate`` of the iteration names the adapter in ``lora_path``.

Example::

    >>> lora_launch_args(16)[:3]
    ['--enable-lora', '--max-lora-rank', '16']
"""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import Iterable

import torch

from lit_parl.rollout.adapter_pool import adapter_name, check_adapter_rank
from lit_parl.rollout.rollout_pool import WeightBucket
from lit_parl.rollout.sglang.servers import Server
from lit_parl.rollout.sglang.weights import WeightUpdater

LOAD = "/load_lora_adapter_from_tensors"
UNLOAD = "/unload_lora_adapter"


def lora_launch_args(max_rank: int) -> list[str]:
    """The server flags that let it load adapters up to rank ``max_rank`` on any linear layer: two loaded at once
    (the new version's, loaded before the previous one is unloaded), one per batch (an iteration uses one)."""
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(max_rank),
        "--lora-target-modules",
        "all",
        "--max-loras-per-batch",
        "1",
        "--max-loaded-loras",
        "2",
    ]


# SGLang 0.5.23's LoRA layers allocate pinned host memory unconditionally (sglang/srt/lora/layers.py:141, and on
# every LoRA layer type, the adapter's weights at load in lora.py:533), and torch has no pinned allocator without an
# accelerator: a CPU server started with --enable-lora dies while building its LoRA layers, whatever --lora-backend
CPU_ADAPTERS_REFUSED = (
    "pool.sync.lora=adapter needs a GPU: SGLang's LoRA layers pin host memory (sglang/srt/lora/layers.py:141), which "
    "torch refuses on a machine without an accelerator, so a CPU server cannot load adapters; set pool.sync.lora=merged"
)


def check_adapters_servable(cpu: bool) -> None:
    """Refuse adapter sync on servers launched on SGLang's CPU platform, before any starts."""
    if cpu:
        raise ValueError(CPU_ADAPTERS_REFUSED)


def serialize_adapter(tensors: dict[str, torch.Tensor]) -> str:
    """``{name: tensor}`` as a base64 pickle that carries the values (no shared memory: any server can read it)."""
    plain = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    return base64.b64encode(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class AdapterLoader:
    """Loads each version's adapter on the servers, retires the previous one and sets the version they report.

    Args:
        weights: the pool's ``WeightUpdater`` (its HTTP client, tensor-parallel size and version check).
        max_rank: the servers' ``--max-lora-rank``; a larger adapter is refused before anything is sent.
    """

    def __init__(self, weights: WeightUpdater, max_rank: int) -> None:
        self.weights = weights
        self.max_rank = max_rank
        self.loaded: str | None = None  # the adapter the servers serve now

    def load(self, servers: list[Server], buckets: Iterable[WeightBucket], config: dict, version: int) -> str:
        """Load ``buckets`` (peft's names) with peft's ``config`` as version ``version``; return its name."""
        check_adapter_rank(config, self.max_rank, "pool.sync.max_lora_rank")
        tensors = {name: tensor for bucket in buckets for name, tensor in bucket}
        if not tensors:
            raise ValueError("sync_adapter got no tensors: nothing to load")
        name = adapter_name(version)
        payload = {
            "lora_name": name,
            "config_dict": config,
            "serialized_named_tensors": [serialize_adapter(tensors)] * self.weights.tp_size,
        }
        weights, previous = self.weights, self.loaded
        run, each = weights.client.run, weights.fanout.each

        async def load_on(server: Server) -> None:
            try:
                await weights._update(server, LOAD, payload)
            except RuntimeError as error:  # this version's name is held already (a push of it was retried)
                if "already loaded" not in str(error):
                    raise
                await weights._update(server, UNLOAD, {"lora_name": name})
                await weights._update(server, LOAD, payload)

        self.loaded = None
        run(each(servers, load_on))
        if previous is not None and previous != name:  # one a server no longer holds (it restarted) is gone anyway
            unloads = (weights._update(s, UNLOAD, {"lora_name": previous}) for s in servers)
            run(_quietly(unloads))
        stamp = {"new_version": str(version), "abort_all_requests": False}
        run(each(servers, lambda s: weights._update(s, "/update_weight_version", stamp)))
        weights.check_reported(servers, version)
        self.loaded = name
        return name


async def _quietly(calls) -> None:
    """Every call to its end, failed or not."""
    await asyncio.gather(*calls, return_exceptions=True)
