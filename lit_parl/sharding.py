"""FSDP2 sharding of a causal LM for lit_parl's forward (Lightning's ``ModelParallelStrategy``).

lit_parl does not call the model's ``forward``: it runs the decoder, then its own chunked log-prob kernel
over the LM head's weight (``lit_parl.kernels.forward``). FSDP2 gathers a unit's parameters around a
module's ``forward``, so each decoder layer is a unit of its own (gathered in the decoder's forward), and
the rest (embeddings, final norm, LM head, tied or not) belongs to a root unit around ``ShardedLogprobs``,
a module whose forward is that whole computation: the head's weight is whole while the kernel reads it,
and its gradient is reduce-scattered (averaged over ranks) with the others after backward.

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


def shard_for_logprobs(model: PreTrainedModel, mesh, frozen: bool = False) -> ShardedLogprobs:
    """Shard ``model`` in place over ``mesh`` (its parameters become DTensors) and return the module to call.

    ``frozen``: a model only run without gradients (θ_k, the reference): its root unit is sharded again right
    after each forward (FSDP2 keeps a root whole until backward, which never comes for these).
    """
    from torch.distributed.fsdp import fully_shard

    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder `layers` to shard one by one (Llama, Qwen2/3, Mistral families)")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(ShardedLogprobs(model), mesh=mesh, reshard_after_forward=True if frozen else None)


def check_strategy(strategy) -> None:
    """Refuse the Lightning strategies lit_parl's update has not been made to work under, naming the ones it has."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "Trainer(strategy='fsdp') (FSDP1) is not supported: it flattens parameters into shards that lit_parl's weight "
            "sync, gradient clipping and frozen θ_k/reference copies do not read. lit_parl shards with FSDP2: trainer=fsdp2 "
            "(lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1))"
        )
    if isinstance(strategy, DeepSpeedStrategy):
        raise ValueError(
            "Trainer(strategy='deepspeed') is not supported: lit_parl divides each mini-batch's gradient by a normaliser "
            "known only once all its streamed micro-batches are in, and ZeRO keeps gradients in partitioned buffers the "
            "module cannot scale. Use trainer=fsdp2 (sharded) or trainer=ddp."
        )
