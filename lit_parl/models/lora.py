"""LoRA adapters on the policy, with ``peft`` (``pip install 'lit-parl[lora]'``): what is trained, θ_k and θ_0.

``add_lora`` injects LoRA layers into the policy in place (``peft.inject_adapter_in_model``): the model keeps its
class, its forward and its decoder, so the log-prob kernels, the strategies and the exports see the same model,
and only the adapter tensors require gradients (the optimizer holds only those). Two more views come from the
same weights, so no second copy of the base is ever held:

- θ_0, the reference (β > 0), is the policy with its adapters switched off (``adapters_off``);
- θ_k, the old policy (several optimizer steps per iteration), is a second adapter, ``theta_k``, a copy of the
  trained adapter taken at the iteration's start (the strategy adapter's ``copy_adapter``) and switched on for its
  forward (``adapter_active``).

What the rollout engines load is the merged policy, base + (α / r) B A, tensor by tensor
(``lit_parl.callbacks.full_tensors`` merges each LoRA layer's weight as it reads it), or, with a pool set up for
it (SGLang's ``pool.sync.lora=adapter``, vLLM's ``pool.lora=adapter``), the base once and then the adapter alone.

Example::

    >>> from lit_parl.models import tiny_qwen2
    >>> policy, _ = tiny_qwen2()
    >>> policy = add_lora(policy, LoRASettings(rank=4, alpha=8))
    >>> trained = [name for name, p in policy.named_parameters() if p.requires_grad]
    >>> all("lora_" in name and ".default." in name for name in trained), len(trained) > 0
    (True, True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lit_parl.callbacks.full_tensors import is_adapter_tensor, lora_layers
from lit_parl.extras import require

TRAINED = "default"  # the adapter the optimizer trains (peft's default name)
SNAPSHOT = "theta_k"  # the copy of it taken at each iteration's start


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA adapters trained in place of the full weights (``peft.LoraConfig``'s fields of the same meaning).

    Args:
        rank: r, the inner dimension of each adapter's two matrices.
        alpha: the scale's numerator: each adapter adds (alpha / rank) B A to its layer's weight.
        dropout: dropout on each adapter's input, in training mode only. Above 0, the policy's training forward is
            not the old policy's, so the ratio starts away from 1: keep 0 for GRPO's ratio to mean what it says.
        target_modules: the linear layers that get an adapter: ``all-linear`` (every linear layer but the output
            head), or a list of module names (e.g. ``[q_proj, v_proj]``).
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRASettings(rank={self.rank}): the adapters' rank must be at least 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRASettings(dropout={self.dropout}): a probability in [0, 1)")
        if not isinstance(self.target_modules, str):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def peft_config(self):
        peft = require("peft", "lora", "LoRA (lora=r16, module.lora)")
        targets = self.target_modules if isinstance(self.target_modules, str) else list(self.target_modules)
        return peft.LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=targets, bias="none"
        )


def add_lora(policy: torch.nn.Module, settings: LoRASettings, with_snapshot: bool = False) -> torch.nn.Module:
    """Inject ``settings``' adapters into ``policy`` (in place) and freeze everything else; ``with_snapshot``: add
    the θ_k adapter too (frozen; the strategy adapter's ``copy_adapter`` fills it). Returns ``policy``."""
    config = settings.peft_config()  # first: it says which extra to install when peft is missing
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, policy, adapter_name=TRAINED)
    if with_snapshot:
        with warnings.catch_warnings():  # a second adapter is the point here
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute in the model")
            inject_adapter_in_model(config, policy, adapter_name=SNAPSHOT)
    for name, parameter in policy.named_parameters():
        parameter.requires_grad_(is_adapter_tensor(name, TRAINED))
    for name, layer in lora_layers(policy).items():
        if TRAINED not in getattr(layer, "lora_A", {}):  # peft's embedding and convolution layers name theirs otherwise
            raise ValueError(
                f"LoRA on {name} ({type(layer).__name__}): lit_parl merges and syncs LoRA on linear layers only; "
                "leave it out of module.lora.target_modules"
            )
        if not (hasattr(layer, "_disable_adapters") and hasattr(layer, "_active_adapter")):
            raise ImportError(
                f"this peft ({type(layer).__module__}) keeps a LoRA layer's switches elsewhere than lit_parl reads "
                "them (_disable_adapters, _active_adapter): install a peft from 0.17 to 0.21"
            )
    _activate(policy, TRAINED)
    return policy


def adapter_parameters(model: torch.nn.Module, adapter: str = TRAINED) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of ``adapter``'s tensors (its A and B of every layer), in ``named_parameters`` order."""
    for name, parameter in model.named_parameters():
        if is_adapter_tensor(name, adapter):
            yield name, parameter


@contextlib.contextmanager
def adapter_active(model: torch.nn.Module, adapter: str):
    """Run the forward with ``adapter`` in place of the trained one (trainability left as it was)."""
    _activate(model, adapter)
    try:
        yield
    finally:
        _activate(model, TRAINED)


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module):
    """Run the forward of the base model alone: θ_0 (the adapters' layers pass their input to the base layer)."""
    # the flag peft's forward reads, set directly: its enable_adapters also flips the adapters' requires_grad,
    # which a sharding strategy (FSDP1's flat parameters) must not see change between forwards
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def _activate(model: torch.nn.Module, adapter: str) -> None:
    # the attribute peft's set_adapter sets, set directly: set_adapter also flips requires_grad to the active
    # adapter, and the trained adapter must keep its gradients (θ_k stay frozen) whichever is active, without a
    # flip a sharding strategy (FSDP1's flat parameters) would see between forwards
    for layer in lora_layers(model).values():
        layer._active_adapter = [adapter]
