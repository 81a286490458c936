"""The trainer's last line of defence: samples that were not drawn from θ_k, and values that are not finite.

Both checks run inside ``GRPOModule.training_step``, on every micro-batch, before anything reaches the
optimizer:

- ``check_on_policy`` compares the rollout engine's log-probs with θ_k's on the same tokens. The
  version labels say which weights a worker *claims* it held; the log-probs show which it *used*. A pool
  that kept old weights (a sync that silently failed) labels its groups correctly and still produces
  log-probs of another policy: this check stops the run on the first such micro-batch.
- ``NonFiniteGuard`` looks for NaN or infinity in the advantages, the log-probs, the loss and, at the
  optimizer step, the gradient. Its policy skips that optimizer step (counted, with the prompts named) or
  stops the run.

Example::

    >>> import torch
    >>> rollout = torch.tensor([[-1.0, -2.0]]); old = torch.tensor([[-1.0, -2.5]]); mask = torch.ones(1, 2)
    >>> [round(float(x), 3) for x in logprob_mismatch(rollout, old, mask)]
    [0.5, 0.107, 2.0]
"""

from __future__ import annotations

import torch

from lit_parl.data.gate import OffPolicyError

NONFINITE_POLICIES = ("skip", "raise")


def logprob_mismatch(rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Σ|Δ|, Σ KL_k3(θ_k || rollout), tokens)`` over ``mask``, with Δ = rollout - θ_k log-prob per token."""
    mask = mask.to(old_logp.dtype)
    delta = (rollout_logp.to(old_logp.dtype) - old_logp) * mask
    return delta.abs().sum(), ((torch.exp(-delta) + delta - 1) * mask).sum(), mask.sum()


def check_on_policy(abs_sum: torch.Tensor, tokens: torch.Tensor, tolerance: float | None, version: int, prompt_ids: list[int]) -> None:
    """Raise ``OffPolicyError`` when the mean |Δ log-prob| per token exceeds ``tolerance`` (None: no check)."""
    if tolerance is None:
        return
    mean = float(abs_sum) / max(float(tokens), 1.0)
    if mean > tolerance:  # NaN is caught by NonFiniteGuard, which names the prompts the same way
        raise OffPolicyError(
            f"the rollout engine's log-probs differ from θ_k's by {mean:.3g} per token (tolerance {tolerance:.3g}) on "
            f"prompts {sorted(set(prompt_ids))[:8]}: the pool did not sample with the weights of policy version {version} "
            "although it reported that version (a weight sync that was not applied). If the engine's numerics really "
            "differ this much (e.g. bfloat16 on a large vocabulary), raise datamodule.logprob_tolerance (null: no check)."
        )


class NonFiniteGuard:
    """Keeps NaN and infinity out of the optimizer: watches one optimizer step's micro-batches and gradient.

    Args:
        policy: ``skip``: that optimizer step is not taken (its gradient is dropped; counted in
            ``skipped_steps`` and warned about, naming the prompts); ``raise``: the run stops with a
            ``FloatingPointError`` naming them.

    Example::

        >>> guard = NonFiniteGuard("skip")
        >>> guard.inspect({"loss": torch.tensor(float("nan"))}, prompt_ids=[3, 3, 4])
        False
        >>> guard.step_is_finite(grad_norm=torch.tensor(1.0)), guard.skipped_steps
        (False, 1)
    """

    def __init__(self, policy: str = "skip") -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={policy!r}; choose one of {NONFINITE_POLICIES}")
        self.policy = policy
        self.skipped_steps = 0
        self.last_problem = ""
        self._problems: list[str] = []
        self._step_prompts: set[int] = set()

    def inspect(self, values: dict[str, torch.Tensor], prompt_ids: list[int]) -> bool:
        """Record a micro-batch's tensors; ``False`` when one is not finite (its backward should be skipped)."""
        self._step_prompts.update(prompt_ids)
        bad = [name for name, value in values.items() if not bool(torch.isfinite(value).all())]
        if not bad:
            return True
        self._problems.append(f"non-finite {', '.join(bad)} on prompts {sorted(set(prompt_ids))[:8]}")
        if self.policy == "raise":
            self._fail()
        return False

    def step_is_finite(self, grad_norm: torch.Tensor, flagged_elsewhere: bool = False) -> bool:
        """Decide this optimizer step: ``False`` to skip it. ``flagged_elsewhere``: another rank found a problem."""
        if not bool(torch.isfinite(grad_norm)):
            self._problems.append(f"non-finite gradient (norm {float(grad_norm)}) in the step over prompts {sorted(self._step_prompts)[:8]}")
        elif flagged_elsewhere and not self._problems:
            self._problems.append("a non-finite value on another rank")
        ok = not self._problems
        if not ok:
            if self.policy == "raise":
                self._fail()
            self.skipped_steps += 1
            self.last_problem = "; ".join(self._problems)
        self._problems, self._step_prompts = [], set()
        return ok

    @property
    def pending(self) -> bool:
        """A micro-batch of the current optimizer step was not finite."""
        return bool(self._problems)

    def _fail(self) -> None:
        raise FloatingPointError(
            f"{'; '.join(self._problems)}: the optimizer step was refused (module.on_nonfinite=raise). A reward that "
            "returns NaN or infinity, a diverging policy (lower the learning rate) or an engine reporting -inf log-probs "
            "are the usual causes; on_nonfinite=skip drops such steps and counts them instead."
        )

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state["skipped_steps"]
