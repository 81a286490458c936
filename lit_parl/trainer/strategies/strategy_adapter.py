"""StrategyAdapter: what the update does under one Lightning strategy; this base is one device or DDP.

``GRPOModule`` touches its models directly in five places, and each depends on how a rank holds them: before
the strategy wraps the module (``prepare``: refuse what cannot run, hand the strategy the module's settings),
when Lightning asks for the model layout (``configure_model``), in the log-prob forward (``logprobs``), in
the θ_k snapshot (``copy_weights``; LoRA: ``copy_adapter``), and at the optimizer step (``step``). One adapter per
strategy does all five (``lit_parl.trainer.strategies.adapter_for`` picks it):

- one device or DDP (this class): whole parameters on every rank; DDP averages the gradients in backward;
- FSDP2 (``ModelParallelStrategy``): a DTensor shard of every parameter (``FSDP2Adapter``);
- FSDP1 (``FSDPStrategy``, ``use_orig_params=True``): views into each unit's flat shard (``FSDP1Adapter``);
- DeepSpeed ZeRO-2 and ZeRO-3 (``DeepSpeedStrategy``): the engine's gradient buffers, and under ZeRO-3
  partitioned parameters (``DeepSpeedAdapter``).

Example::

    >>> import torch
    >>> adapter = StrategyAdapter()
    >>> source, target = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> adapter.copy_weights(source, target)
    >>> torch.equal(source.weight, target.weight)
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lit_parl.callbacks.full_tensors import is_adapter_tensor
from lit_parl.kernels.forward import completion_logprobs

# what the module gives ``step`` to decide whether the step is taken, from the gradient's global norm
StepDecision = Callable[[torch.Tensor], bool]


class StrategyAdapter:
    """One device or DDP: whole parameters, replicated; the base of every strategy's adapter.

    Args:
        strategy: the Lightning strategy (``None`` outside a fit).
    """

    def __init__(self, strategy=None) -> None:
        self.strategy = strategy

    def prepare(self, max_grad_norm: float | None, micro_batch_size: int) -> None:
        """Before the strategy wraps the module: refuse settings the update cannot run under, naming the one to
        use, and give the strategy what the module decides."""

    def configure_model(self, module) -> None:
        """Lay out ``module``'s policy, θ_k (``old``) and reference for the strategy (Lightning's
        ``configure_model``: it may run again for a second fit, which finds them laid out)."""

    def on_fit_start(self, module) -> None:
        """After the strategy has set up the models (and its engine)."""

    def logprobs(self, model: torch.nn.Module, tokens, temperature: float, chunk_size: int, with_entropy: bool):
        """``lit_parl.kernels.forward.completion_logprobs`` of ``model``, run where the strategy gathers what it
        reads."""
        return completion_logprobs(model, tokens, temperature, chunk_size, with_entropy)

    def copy_weights(self, source: torch.nn.Module, target: torch.nn.Module) -> None:
        """``target ← source``, parameter by parameter, each rank on what it holds (never a second whole model)."""
        with torch.no_grad():
            copy_local(list(source.named_parameters()), list(target.named_parameters()))

    def copy_adapter(self, model: torch.nn.Module, source: str, target: str) -> None:
        """LoRA adapter ``target`` ← adapter ``source`` in ``model`` (θ_k's snapshot of the trained one), each rank on
        what it holds."""
        with torch.no_grad():
            copy_local(*adapter_pairs(model.named_parameters(), source, target))

    def ends_step(self, ends_step: bool) -> None:
        """Before each micro-batch's backward: whether an optimizer step follows it."""

    def step(
        self,
        optimizer,
        policy: torch.nn.Module,
        scale: float,
        max_grad_norm: float | None,
        decide: StepDecision,
        flagged: bool,
    ) -> torch.Tensor | None:
        """Multiply the accumulated gradient by ``scale``, clip its global norm to ``max_grad_norm`` (``None``: no
        clipping) and take the optimizer step if ``decide(norm)`` allows it. ``flagged``: a rank saw a non-finite
        value (``decide`` says no then). Returns the norm before clipping, the same on every rank, or ``None``
        when the step is not taken (the caller then drops the gradient)."""
        for parameter in policy.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
        norm = self.clip_gradients(policy, max_grad_norm)
        if not decide(norm):
            return None
        optimizer.step()
        return norm

    def clip_gradients(self, model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
        """Clip the gradient's global norm (over the whole, replicated gradients) and return it."""
        limit = max_norm if max_norm else math.inf
        return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit)


def copy_local(source: list[tuple[str, torch.Tensor]], target: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each named tensor of ``source`` into ``target``'s, each on the piece this rank holds (a DTensor's local
    shard; FSDP1's views are pieces already)."""
    if [name for name, _ in source] != [name for name, _ in target]:
        raise RuntimeError("copy_weights: the two models have different parameters; θ_k must be a copy of the policy")
    for (name, s), (_, t) in zip(source, target):
        s = s.to_local() if hasattr(s, "to_local") else s
        t = t.to_local() if hasattr(t, "to_local") else t
        if s.shape != t.shape:
            raise RuntimeError(
                f"{name} is sharded differently in the two models on this rank ({tuple(s.shape)} and {tuple(t.shape)})"
            )
        t.copy_(s)


def adapter_pairs(named, source: str, target: str) -> tuple[list, list]:
    """``named`` parameters of LoRA adapter ``source`` and of ``target``, each under the name it has in the other
    (so ``copy_local`` pairs them)."""
    named = list(named)

    def of(adapter: str) -> list:
        return [(n.replace(f".{adapter}.", "."), p) for n, p in named if is_adapter_tensor(n, adapter)]

    return of(source), of(target)


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


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layers, each a unit of its own under FSDP1 and FSDP2."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder `layers` to shard one by one (Llama, Qwen2/3, Mistral families)"
        )
    return layers
