"""How a causal LM is sharded for lit_parl's forward under FSDP2, FSDP1 and DeepSpeed ZeRO-3.

lit_parl does not call the model's ``forward``: it runs the decoder, then its own chunked log-prob kernel
over the LM head's weight (``lit_parl.kernels.forward``). FSDP2 gathers a unit's parameters around a
module's ``forward``, so each decoder layer is a unit of its own (gathered in the decoder's forward), and
the rest (embeddings, final norm, LM head, tied or not) belongs to a root unit around ``ShardedLogprobs``,
a module whose forward is that whole computation: the head's weight is whole while the kernel reads it,
and its gradient is reduce-scattered (averaged over ranks) with the others after backward.

DeepSpeed ZeRO-3 gathers a module's own parameters around its forward; the LM head's weight is read
after the decoder's forward, outside the head's own: ``gather_head_with_model`` makes it a parameter the
model's forward gathers, and the kernel runs as the model's forward (``forward_through``).

FSDP1 (Lightning's ``FSDPStrategy``) lays the units out alike: ``wrap_for_fsdp1`` wraps each decoder layer
and then the model itself (the root unit, which keeps the model's names in state dicts), and
``forward_through`` runs the log-prob computation as that root's forward, so FSDP1 gathers what it reads.
The LightningModule stays unwrapped, so a backward never runs inside a unit's forward.

Example (one process, a mesh of one: the layout of a W-rank run, without the other ranks)::

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> from lit_parl.model import tiny_qwen2
    >>> policy, _ = tiny_qwen2()
    >>> sharded = shard_for_logprobs(policy, init_device_mesh("cpu", (1,)))
    >>> type(policy.get_input_embeddings().weight).__name__
    'DTensor'
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from lit_parl.kernels.forward import completion_logprobs


class ShardedLogprobs(torch.nn.Module):
    """The root FSDP2 unit of one model: its forward is ``completion_logprobs`` of that model."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, temperature: float, chunk_size: int, with_entropy: bool):
        return completion_logprobs(self.model, tokens, temperature, chunk_size, with_entropy)


def _layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` to shard one by one (Llama, Qwen2/3, Mistral families)")
    return layers


def shard_for_logprobs(model: PreTrainedModel, mesh, frozen: bool = False) -> ShardedLogprobs:
    """Shard ``model`` in place over ``mesh`` (its parameters become DTensors) and return the module to call.

    ``frozen``: a model only run without gradients (θ_k, the reference): its root unit is sharded again right
    after each forward (FSDP2 keeps a root whole until backward, which never comes for these).
    """
    from torch.distributed.fsdp import fully_shard

    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(ShardedLogprobs(model), mesh=mesh, reshard_after_forward=True if frozen else None)



def wrap_for_fsdp1(model: PreTrainedModel, sharding_strategy=None, frozen: bool = False) -> torch.nn.Module:
    """Wrap ``model`` with FSDP1: each decoder layer a unit, the model the root unit. Call it inside Lightning's
    ``configure_model`` under ``FSDPStrategy``, whose wrapping context supplies the strategy's settings.

    ``frozen``: a model only run without gradients (θ_k, the reference). Where the strategy's
    ``sharding_strategy`` keeps a unit's parameters gathered from its forward to its backward
    (``SHARD_GRAD_OP``), such a model would stay whole on every rank, having no backward: its units are
    sharded again after each forward instead.
    """
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, wrap

    resharded = {ShardingStrategy.SHARD_GRAD_OP: ShardingStrategy.FULL_SHARD,
                 ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.HYBRID_SHARD}
    overrides = {"sharding_strategy": resharded[sharding_strategy]} if frozen and sharding_strategy in resharded else {}
    return wrap(model, auto_wrap_policy=ModuleWrapPolicy({type(layer) for layer in _layers(model)}), **overrides)


def forward_through(module: torch.nn.Module, compute):
    """``compute()`` run as the forward of ``module`` (an FSDP1 unit, or a model under ZeRO-3), so that the
    strategy's hooks around that forward gather the parameters it reads, and again for its backward.

    The (wrapped) module's ``forward`` is swapped for ``compute`` for that one call (no arguments pass
    through the hooks, which would move and cast them).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    inner = module.module if isinstance(module, FullyShardedDataParallel) else module
    had_own = "forward" in inner.__dict__
    original = inner.forward
    inner.forward = lambda: compute()
    try:
        return module()
    finally:
        if had_own:
            inner.forward = original
        else:
            del inner.forward


def gather_head_with_model(model: PreTrainedModel) -> None:
    """Under ZeRO-3, after DeepSpeed has partitioned ``model``: have its forward (and backward) gather the LM
    head's parameters, which the log-prob kernel reads directly (``deepspeed.zero.register_external_parameter``)."""
    import deepspeed

    for parameter in model.get_output_embeddings().parameters(recurse=False):
        deepspeed.zero.register_external_parameter(model, parameter)


def partition_for_zero3(model: PreTrainedModel, config: dict) -> None:
    """Partition ``model``'s parameters for DeepSpeed ZeRO-3 in place, where they are (a model built before the
    fit, outside ``deepspeed.zero.Init``): DeepSpeed would otherwise move it whole to the device first."""
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config)
