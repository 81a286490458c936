"""StepTally: what an optimizer step's micro-batches add up to, agreed by every rank before the step is taken.

The gradient is divided by the mini-batch's normaliser (its completion tokens, or samples) only once the
whole mini-batch has arrived, and under data parallelism that normaliser spans every rank's samples. The
same one reduction carries the loss and how many ranks saw a non-finite value or samples not drawn from
θ_k, so every rank takes the same decision: a rank raising alone would leave the others in a collective.

Example::

    >>> from lightning.pytorch.strategies import SingleDeviceStrategy
    >>> tally = StepTally()
    >>> tally.add(normaliser=6.0, loss_sum=3.0)
    >>> tally.add(normaliser=2.0, loss_sum=None)  # a micro-batch with a non-finite value adds no loss
    >>> tally.agree(SingleDeviceStrategy("cpu"), torch.device("cpu"), nonfinite_here=True)
    AgreedStep(normaliser=8.0, loss_sum=3.0, nonfinite_ranks=1)
    >>> tally.normaliser  # the next step starts from zero
    0.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lightning.pytorch.strategies import Strategy

from lit_parl.data.micro_batch import MicroBatch
from lit_parl.errors import OffPolicyError
from lit_parl.trainer.guards import off_policy_problem, worst_group_mismatch


@dataclass(frozen=True)
class AgreedStep:
    """The step's totals over every rank: the loss normaliser, the loss, the ranks that saw a non-finite value."""

    normaliser: float
    loss_sum: float
    nonfinite_ranks: int


class StepTally:
    """Sums an optimizer step's micro-batches on this rank, checks that its samples came from θ_k, and reduces
    both over the ranks at the step (``agree``)."""

    def __init__(self) -> None:
        self.normaliser = 0.0
        self.loss_sum = 0.0
        self.off_policy: str | None = None  # what the on-policy check found in this step's micro-batches

    def add(self, normaliser: float, loss_sum: float | None) -> None:
        """Count a micro-batch: its normaliser always, its loss when it was finite (``None``: not)."""
        self.normaliser += normaliser
        if loss_sum is not None:
            self.loss_sum += loss_sum

    def check_on_policy(self, batch: MicroBatch, old_logp: torch.Tensor) -> None:
        """Compare the engine's log-probs with θ_k's, group by group (``lit_parl.trainer.guards``): the samples,
        not their version labels, show which weights were used. Once per step is enough to stop it."""
        if batch.pass_index == 0 and self.off_policy is None:
            worst, prompt_id = worst_group_mismatch(
                batch.rollout_logprobs, old_logp, batch.completion_mask, batch.prompt_ids
            )
            self.off_policy = off_policy_problem(worst, prompt_id, batch.logprob_tolerance, batch.version)

    def agree(self, strategy: Strategy, device: torch.device, nonfinite_here: bool) -> AgreedStep:
        """One reduction over the ranks; raises ``OffPolicyError`` on every rank when any rank's samples were off
        policy. The tally starts again from zero."""
        flags = [float(nonfinite_here), float(self.off_policy is not None)]
        local = torch.tensor([self.normaliser, self.loss_sum, *flags], device=device)
        normaliser, loss_sum, nonfinite, off_policy = strategy.reduce(local, reduce_op="sum").tolist()
        self.normaliser, self.loss_sum = 0.0, 0.0
        if off_policy > 0:
            raise OffPolicyError(
                self.off_policy
                or "another rank's rollout log-probs differ from θ_k's beyond datamodule.logprob_tolerance"
            )
        return AgreedStep(normaliser, loss_sum, round(nonfinite))
