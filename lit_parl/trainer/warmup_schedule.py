"""WarmupSchedule: linear warmup, then a constant or cosine learning rate, per optimizer step.

Example::

    >>> import torch
    >>> optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> scheduler = WarmupSchedule(warmup_steps=2, decay="cosine")(optimizer, total_steps=6)
    >>> rates = []
    >>> for _ in range(6):
    ...     rates.append(round(optimizer.param_groups[0]["lr"], 3)); optimizer.step(); scheduler.step()
    >>> rates
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    >>> WarmupSchedule()(optimizer) is None  # constant without warmup: no scheduler to step
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DECAYS = ("constant", "cosine")


@dataclass(frozen=True)
class WarmupSchedule:
    """A factory ``(optimizer, total_steps) -> LambdaLR`` for ``GRPOModule(lr_schedule=...)``.

    Args:
        warmup_steps: optimizer steps of linear warmup from ``lr / warmup_steps`` to ``lr``.
        decay: ``constant`` after the warmup, or ``cosine`` down to ``min_lr_ratio`` x lr at ``total_steps``.
        min_lr_ratio: the cosine's floor, as a fraction of the optimizer's learning rate.
        total_steps: the cosine's length in optimizer steps; ``None``: the fit's, which the module
            computes as ``max_epochs`` x optimizer steps per iteration.
    """

    warmup_steps: int = 0
    decay: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"WarmupSchedule(decay={self.decay!r}); choose one of {DECAYS}")
        if self.warmup_steps < 0:
            raise ValueError(f"WarmupSchedule(warmup_steps={self.warmup_steps}) must be >= 0")

    def __call__(
        self, optimizer: torch.optim.Optimizer, total_steps: int | None = None
    ) -> torch.optim.lr_scheduler.LambdaLR | None:
        """The scheduler; ``None`` when the rate never changes (constant, no warmup): nothing to step."""
        if self.decay == "constant" and self.warmup_steps == 0:
            return None
        total = self.total_steps or total_steps
        if self.decay == "cosine" and not total:
            raise ValueError(
                "WarmupSchedule(decay='cosine') needs a length: set total_steps, or give the Trainer max_epochs so the "
                "module can count the fit's optimizer steps"
            )
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.factor(step, total))

    def factor(self, step: int, total: int | None) -> float:
        """The learning-rate multiplier before optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def with_schedule(optimizer, lr_schedule, epochs: int | None, optimizer_steps: int):
    """What ``configure_optimizers`` returns: ``optimizer`` alone, or with the schedule ``lr_schedule(optimizer,
    total_steps)`` builds (``total_steps``: ``epochs`` x ``optimizer_steps`` per iteration, ``None`` when unbounded),
    stepped after every optimizer step by the module itself (manual optimisation: Lightning's interval settings do
    not apply)."""
    total_steps = epochs * optimizer_steps if epochs and epochs > 0 else None
    scheduler = lr_schedule(optimizer, total_steps) if lr_schedule is not None else None
    if scheduler is None:  # a constant learning rate: nothing to step
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
