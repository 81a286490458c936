"""The trainer's precision and activation memory: the dtype the forward computes in, the warning for weights
held in half precision, and gradient checkpointing of the policy.

On a GPU, train with ``Trainer(precision="bf16-mixed")`` (``trainer=gpu``) and a float32 policy: the weights
(and θ_k, the reference and the optimizer state) stay float32, the forward computes in bfloat16 under autocast.
Weights held in bfloat16 would round away every update smaller than about 2^-8 of a weight.
"""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import rank_zero_warn
from transformers import PreTrainedModel

from lit_parl.kernels.attention import checkpoint_context_fn


def compute_dtype(precision: str | None, policy: PreTrainedModel) -> torch.dtype:
    """What the forward computes in under Lightning's ``precision``: bfloat16 under ``bf16-*`` (autocast over
    float32 weights, or converted weights), else the policy's weights' dtype."""
    if precision is not None and precision.startswith("bf16"):
        return torch.bfloat16
    return next(policy.parameters()).dtype


def check_precision(trainer, policy: PreTrainedModel) -> None:
    """Refuse float16 (no loss scaler runs); warn about half-precision weights: the optimizer updates the weights in
    their own dtype, and in bfloat16 an update smaller than about 2^-8 of a weight rounds to nothing. DeepSpeed
    keeps float32 master weights of its own, whatever the module's dtype."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    precision = str(trainer.precision)
    if precision.startswith("16"):
        raise ValueError(
            f"Trainer(precision={trainer.precision!r}) is not supported: float16 needs a loss scaler, which the "
            "manual optimizer step (gradient normalised per mini-batch, non-finite steps skipped) does not run. "
            "Use precision='bf16-mixed' or '32-true'."
        )
    if isinstance(trainer.strategy, DeepSpeedStrategy):
        return
    dtype = next(policy.parameters()).dtype
    if precision == "bf16-true":
        held = f"Trainer(precision={precision!r}) converts them"
    elif dtype in (torch.bfloat16, torch.float16):
        held = f"the policy was loaded in {dtype}"
    else:
        return
    rank_zero_warn(
        f"the policy's weights are trained in half precision ({held}): updates smaller than about 2^-8 of a weight "
        "are lost. Keep float32 weights (model.dtype=float32) "
        "and compute in bfloat16 with precision='bf16-mixed' (trainer=gpu)."
    )


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Checkpoint each decoder layer of ``model`` (non-reentrant ``torch.utils.checkpoint``), through transformers'
    own switch: the layer's forward, with every keyword it is given (``shared_prompt`` and the rotary embeddings
    included), is recomputed in the backward, under the attention implementation of its forward
    (``checkpoint_context_fn``), inside any FSDP unit or hook around the layer."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"GRPOModule(gradient_checkpointing=True): {type(model).__name__} does not support gradient checkpointing"
        )
    # non-reentrant: it takes the layers' keyword arguments and a context for the backward's recomputation, which
    # must run the attention the forward ran (use_shared_prompt_attention is over by then)
    kwargs = {"use_reentrant": False, "context_fn": checkpoint_context_fn(model)}
    # transformers >= 5 (gradient_checkpointing_enable is its deprecated alias)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
