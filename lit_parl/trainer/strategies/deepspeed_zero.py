"""DeepSpeedAdapter: the update under Lightning's ``DeepSpeedStrategy``, ZeRO stage 2 or 3.

ZeRO-2 keeps parameters whole and partitions the gradient in the engine's buffers (``p.grad`` stays ``None``);
ZeRO-3 also partitions every parameter (``ds_tensor``). The engine takes the step's gradient sum at the
backward it is told ends the step (``set_gradient_accumulation_boundary``, from each micro-batch's
``ends_step``: a step spans as many backwards as its mini-batch has micro-batches), and scales, clips and
steps it itself (``deepspeed_step``).

ZeRO-3 gathers a module's own parameters around its forward; the LM head's weight is read after the decoder's
forward, outside the head's own: ``gather_head_with_model`` makes it a parameter the model's forward gathers,
and the kernel runs as the model's forward (``forward_through``).
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import PreTrainedModel

from lit_parl.kernels.forward import completion_logprobs
from lit_parl.trainer.strategies.strategy_adapter import StrategyAdapter, adapter_pairs, forward_through


def is_zero3(parameter: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitions ``parameter`` (each rank keeps a piece of it in ``ds_tensor``)."""
    return hasattr(parameter, "ds_id")


def partition_for_zero3(model: PreTrainedModel, config: dict) -> None:
    """Partition ``model``'s parameters for DeepSpeed ZeRO-3 in place, where they are (a model built before the
    fit, outside ``deepspeed.zero.Init``): DeepSpeed would otherwise move it whole to the device first."""
    import deepspeed

    deepspeed.zero.Init(module=model, config_dict_or_path=config)


def gather_head_with_model(model: PreTrainedModel) -> None:
    """Under ZeRO-3, after DeepSpeed has partitioned ``model``: have its forward (and backward) gather the LM
    head's parameters, which the log-prob kernel reads directly (``deepspeed.zero.register_external_parameter``)."""
    import deepspeed

    for parameter in model.get_output_embeddings().parameters(recurse=False):
        deepspeed.zero.register_external_parameter(model, parameter)


def deepspeed_step(engine, optimizer, scale: float) -> torch.Tensor:
    """One optimizer step on ``scale`` x the accumulated gradient, clipped as DeepSpeed's config says
    (``gradient_clipping``). Returns the global norm of the scaled gradient before clipping: infinite or NaN
    where DeepSpeed found it non-finite and skipped the step itself.

    DeepSpeed divides the gradient by its loss scale at the step, before clipping, whatever the stage: for
    this one step the loss scale is ``1 / scale`` (1 otherwise, as in float32 and bfloat16). A NaN ``scale``
    makes DeepSpeed skip the step, on every rank.
    """
    zero = engine.optimizer
    zero.override_loss_scale(1.0 / scale)
    try:
        optimizer.step()
    finally:
        zero.override_loss_scale(1.0)
    return torch.tensor(float(engine.get_global_grad_norm()))


class DeepSpeedAdapter(StrategyAdapter):
    """The engine completes, scales, clips and steps the gradient; under ZeRO-3 the models are partitioned."""

    def __init__(self, strategy=None) -> None:
        super().__init__(strategy)
        self.zero3 = False  # the models are partitioned (known once the engine is built)

    def prepare(self, max_grad_norm, micro_batch_size) -> None:
        config = self.strategy.config
        stage = (config.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (2, 3):
            raise ValueError(
                f"DeepSpeedStrategy with ZeRO stage {stage}: lit_parl runs under stages 2 and 3 "
                "(strategy=deepspeed_stage_2 or deepspeed_stage_3); without ZeRO use trainer=ddp"
            )
        clipping = max_grad_norm or 0.0
        if config.get("gradient_clipping", clipping) != clipping:
            raise ValueError(
                f"the DeepSpeed config clips gradients at {config['gradient_clipping']} but GRPOModule(max_grad_norm="
                f"{max_grad_norm}): the module's setting is the one to use; remove gradient_clipping from the config"
            )
        config["gradient_clipping"] = clipping  # DeepSpeed clips at its step, after the normaliser is applied
        if (config.get("bf16") or {}).get("check_grad_overflow", True) is False or config["zero_optimization"].get(
            "compute_grad_norm", True
        ) is False:
            raise ValueError(
                "the DeepSpeed config turns off bf16.check_grad_overflow or zero_optimization.compute_grad_norm: "
                "lit_parl relies on DeepSpeed's gradient norm to skip a non-finite step and to log it; "
                "remove those settings"
            )
        config.setdefault(
            "train_micro_batch_size_per_gpu", micro_batch_size
        )  # DeepSpeed's logs; Lightning would read a loader for it

    def configure_model(self, module) -> None:
        if not self.strategy.zero_stage_3:
            return
        for model in (module.policy, module.old, module.reference):
            if model is not None and not is_zero3(next(model.parameters())):  # a second fit finds them partitioned
                partition_for_zero3(model, self.strategy.config)

    def on_fit_start(self, module) -> None:
        if is_zero3(next(module.policy.parameters())) and not self.zero3:  # DeepSpeed has partitioned the models by now
            for model in (module.policy, module.old, module.reference):
                if model is not None:
                    gather_head_with_model(model)
            self.zero3 = True

    def logprobs(self, model, tokens, temperature, chunk_size, with_entropy):
        if not self.zero3:
            return super().logprobs(model, tokens, temperature, chunk_size, with_entropy)
        compute = functools.partial(completion_logprobs, model, tokens, temperature, chunk_size, with_entropy)
        return forward_through(model, compute)

    def copy_weights(self, source, target) -> None:
        """Under ZeRO-3 parameter by parameter, gathered: ZeRO-3 keeps small parameters whole after their first
        use (``stage3_param_persistence_threshold``), so their pieces alone must not be written."""
        if not is_zero3(next(source.parameters())):
            return super().copy_weights(source, target)
        import deepspeed
        import torch.distributed as dist

        with torch.no_grad():
            for (_, s), (_, t) in zip(source.named_parameters(), target.named_parameters(), strict=True):
                with (
                    deepspeed.zero.GatheredParameters([s], modifier_rank=None),
                    deepspeed.zero.GatheredParameters([t], modifier_rank=0),
                ):
                    if dist.get_rank() == 0:  # rank 0's copy is what every rank keeps its partition of
                        t.data.copy_(s.data)

    def copy_adapter(self, model, source, target) -> None:
        """Under ZeRO-3 pair by pair, gathered, as ``copy_weights``."""
        if not is_zero3(next(model.parameters())):
            return super().copy_adapter(model, source, target)
        import deepspeed
        import torch.distributed as dist

        with torch.no_grad():
            for (_, s), (_, t) in zip(*adapter_pairs(model.named_parameters(), source, target), strict=True):
                with (
                    deepspeed.zero.GatheredParameters([s], modifier_rank=None),
                    deepspeed.zero.GatheredParameters([t], modifier_rank=0),
                ):
                    if dist.get_rank() == 0:
                        t.data.copy_(s.data)

    def ends_step(self, ends_step: bool) -> None:
        # DeepSpeed completes the step's gradient sum at the boundary: the step's last backward
        self.strategy.deepspeed_engine.set_gradient_accumulation_boundary(ends_step)

    def step(self, optimizer, policy, scale, max_grad_norm, decide, flagged):
        """DeepSpeed scales and clips its partitioned gradient at its step, and skips a step that is not finite."""
        engine = self.strategy.deepspeed_engine
        # decided (recorded, or raised) here; skipped by DeepSpeed's own step, which also clears its buffers
        if flagged:
            decide(torch.zeros(()))
            deepspeed_step(engine, optimizer, math.nan)
            return None
        norm = deepspeed_step(engine, optimizer, scale)
        return norm if decide(norm) else None
