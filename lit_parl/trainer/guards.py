"""The trainer's last line of defence: samples that were not drawn from θ_k, and values that are not finite.

Both checks run inside ``GRPOModule.training_step``, on every micro-batch, before anything reaches the
optimizer:

- ``worst_group_mismatch`` and ``off_policy_problem`` compare the rollout engine's log-probs with θ_k's
  on the same tokens, group by group. The version labels say which weights a worker *claims* it held;
  the log-probs show which it *used*. A pool that kept old weights (a sync that silently failed) labels
  its groups correctly and still produces log-probs of another policy: the run stops at the optimizer
  step of the first such micro-batch, before that step.
- ``NonFiniteGuard`` looks for NaN or infinity in the advantages, the log-probs, the loss and, at the
  optimizer step, the gradient. Its policy skips that optimizer step (counted, with the prompts named) or
  stops the run.

Both decide at the optimizer step, after the step's one reduction across ranks: a rank that raised on its
own would leave the others waiting in a collective.

Example::

    >>> import torch
    >>> rollout = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]]); old = torch.tensor([[-1.0, -2.5], [-1.0, -1.0]])
    >>> mask = torch.ones(2, 2)
    >>> [round(float(x), 3) for x in logprob_mismatch(rollout, old, mask)]
    [0.5, 0.107, 4.0]
    >>> worst_group_mismatch(rollout, old, mask, prompt_ids=[7, 9])  # prompt 7's group alone: not diluted
    (0.25, 7)
"""

from __future__ import annotations

import torch

NONFINITE_POLICIES = ("skip", "raise")


def logprob_mismatch(
    rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(Σ|Δ|, Σ KL_k3(θ_k || rollout), tokens)`` over ``mask``, with Δ = rollout - θ_k log-prob per token."""
    mask = mask.to(old_logp.dtype)
    delta = (rollout_logp.to(old_logp.dtype) - old_logp) * mask
    return delta.abs().sum(), ((torch.exp(-delta) + delta - 1) * mask).sum(), mask.sum()


def worst_group_mismatch(
    rollout_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, prompt_ids: list[int]
) -> tuple[float, int]:
    """The largest mean |Δ log-prob| per token over the micro-batch's groups, and that group's prompt id.

    Per group, not per micro-batch: a group comes from one worker, so one stale worker among several is
    not averaged away by the others' groups.
    """
    mask = mask.to(old_logp.dtype)
    per_sample = ((rollout_logp.to(old_logp.dtype) - old_logp).abs() * mask).sum(-1)
    ids, slot = torch.unique(torch.tensor(prompt_ids, device=per_sample.device), return_inverse=True)
    sums = torch.zeros(len(ids), dtype=per_sample.dtype, device=per_sample.device).index_add_(0, slot, per_sample)
    tokens = torch.zeros_like(sums).index_add_(0, slot, mask.sum(-1))
    means = sums / tokens.clamp(min=1)
    worst = int(means.argmax())
    return float(means[worst]), int(ids[worst])


def off_policy_problem(worst_mean: float, prompt_id: int, tolerance: float | None, version: int) -> str | None:
    """What is wrong when a group's mean |Δ log-prob| per token exceeds ``tolerance`` (None: not checked)."""
    if tolerance is None or not worst_mean > tolerance:  # NaN is NonFiniteGuard's to report
        return None
    return (
        f"the rollout engine's log-probs of prompt {prompt_id} differ from θ_k's by {worst_mean:.3g} per token "
        f"(tolerance {tolerance:.3g}): the pool did not sample with the weights of policy version {version} "
        "although it reported that version (a weight sync that was not applied), or the engine's numerics differ "
        "this much from the trainer's (then raise datamodule.logprob_tolerance; null: no check)"
    )


class NonFiniteGuard:
    """Keeps NaN and infinity out of the optimizer: watches one optimizer step's micro-batches and gradient.

    Args:
        policy: ``skip``: that optimizer step is not taken (its gradient is dropped; counted in
            ``skipped_steps`` and warned about, naming the prompts); ``raise``: the run stops with a
            ``FloatingPointError`` naming them.
        max_consecutive_skips: with ``skip``, the run stops once this many optimizer steps in a row were
            skipped: a source of NaN that does not go away would otherwise train nothing, with warnings only.

    Example::

        >>> guard = NonFiniteGuard("skip")
        >>> guard.inspect({"loss": torch.tensor(float("nan"))}, prompt_ids=[3, 3, 4])
        False
        >>> guard.step_is_finite(grad_norm=torch.tensor(1.0)), guard.skipped_steps
        (False, 1)
    """

    def __init__(self, policy: str = "skip", max_consecutive_skips: int = 10) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={policy!r}; choose one of {NONFINITE_POLICIES}")
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.last_problem = ""
        self._problems: list[str] = []
        self._step_prompts: set[int] = set()

    def inspect(self, values: dict[str, torch.Tensor], prompt_ids: list[int]) -> bool:
        """Record a micro-batch's tensors; ``False`` when one is not finite. Decided at ``step_is_finite``."""
        self._step_prompts.update(prompt_ids)
        bad = [name for name, value in values.items() if not bool(torch.isfinite(value).all())]
        if not bad:
            return True
        self._problems.append(f"non-finite {', '.join(bad)} on prompts {sorted(set(prompt_ids))[:8]}")
        return False

    def step_is_finite(self, grad_norm: torch.Tensor, flagged_elsewhere: bool = False) -> bool:
        """Decide this optimizer step: ``False`` to skip it. ``flagged_elsewhere``: another rank found a problem."""
        if not bool(torch.isfinite(grad_norm)):
            self._problems.append(
                f"non-finite gradient (norm {float(grad_norm)}) "
                f"in the step over prompts {sorted(self._step_prompts)[:8]}"
            )
        elif flagged_elsewhere and not self._problems:
            self._problems.append("a non-finite value on another rank")
        ok = not self._problems
        if ok:
            self.consecutive_skips = 0
        else:
            if self.policy == "raise":
                self._fail()
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.last_problem = "; ".join(self._problems)
            if self.consecutive_skips >= self.max_consecutive_skips:
                self._fail(f"{self.consecutive_skips} optimizer steps in a row were skipped, the last for")
        self._problems, self._step_prompts = [], set()
        return ok

    @property
    def pending(self) -> bool:
        """A micro-batch of the current optimizer step was not finite."""
        return bool(self._problems)

    def _fail(self, prefix: str = "") -> None:
        reason = "" if prefix else " (module.on_nonfinite=raise)"
        raise FloatingPointError(
            f"{prefix}{' ' if prefix else ''}{'; '.join(self._problems)}: the optimizer step was refused{reason}. "
            "A reward that returns NaN or infinity, a diverging policy (lower the learning rate) "
            "or an engine reporting -inf log-probs are the usual causes; "
            "on_nonfinite=skip drops such steps and counts them instead."
        )

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state.get("consecutive_skips", 0)
