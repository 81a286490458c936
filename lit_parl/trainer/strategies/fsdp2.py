"""FSDP2Adapter: the update under Lightning's ``ModelParallelStrategy`` (``fully_shard`` over the data-parallel mesh).

lit_parl does not call the model's ``forward``: it runs the decoder, then its own chunked log-prob kernel
over the LM head's weight (``lit_parl.kernels.forward``). FSDP2 gathers a unit's parameters around a
module's ``forward``, so each decoder layer is a unit of its own (gathered in the decoder's forward), and
the rest (embeddings, final norm, LM head, tied or not) belongs to a root unit around ``ShardedLogprobs``,
a module whose forward is that whole computation: the head's weight is whole while the kernel reads it,
and its gradient is reduce-scattered (averaged over ranks) with the others after backward. Every parameter
is then a DTensor: θ_k is copied shard by shard, and the gradient's norm is taken over the shards.

Example (one process, a mesh of one: the layout of a W-rank run, without the other ranks)::

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    >>> from lit_parl.models import tiny_qwen2
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
from lit_parl.trainer.strategies.strategy_adapter import StrategyAdapter, decoder_layers


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

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    return fully_shard(ShardedLogprobs(model), mesh=mesh, reshard_after_forward=True if frozen else None)


class FSDP2Adapter(StrategyAdapter):
    """Each model sharded over the data-parallel mesh, computed through its root unit (``ShardedLogprobs``)."""

    def __init__(self, strategy=None) -> None:
        super().__init__(strategy)
        self.roots: dict[int, ShardedLogprobs] = {}  # id(model) -> the module that computes its log-probs

    def configure_model(self, module) -> None:
        mesh = module.device_mesh
        if mesh is None or self.roots:
            return  # a second fit: laid out already
        if "tensor_parallel" in mesh.mesh_dim_names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                "lit_parl shards with FSDP2 only: "
                "give ModelParallelStrategy(tensor_parallel_size=1, data_parallel_size=<devices>)"
            )
        mesh = mesh["data_parallel"] if "data_parallel" in mesh.mesh_dim_names else mesh
        for model in (module.policy, module.old, module.reference):
            if model is not None:
                self.roots[id(model)] = shard_for_logprobs(model, mesh, frozen=model is not module.policy)

    def logprobs(self, model, tokens, temperature, chunk_size, with_entropy):
        root = self.roots.get(id(model))
        if root is None:  # not laid out (outside the fit's models)
            return super().logprobs(model, tokens, temperature, chunk_size, with_entropy)
        return root(tokens, temperature, chunk_size, with_entropy)

    def clip_gradients(self, model, max_norm):
        norm = super().clip_gradients(model, max_norm)  # over the DTensor shards: a DTensor, the same on every rank
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
