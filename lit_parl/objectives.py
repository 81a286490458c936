"""GRPO objective: group-normalised advantages, clipped-ratio policy loss, k3 KL to the reference.

The objective returns an un-normalised loss sum and its normaliser separately. The module adds both up
over the micro-batches of a mini-batch and divides the gradient once, at the optimizer step, so the
update does not depend on how the mini-batch was split or in which order its groups arrived.

Example::

    >>> objective = GRPOObjective(clip_eps=0.2, beta=0.0)
    >>> objective.advantages(torch.tensor([1.0, 0.0])).tolist()
    [0.7071..., -0.7071...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


@dataclass
class LossTerms:
    loss_sum: torch.Tensor  # scalar, not yet divided by the normaliser
    normaliser: torch.Tensor  # scalar: samples (seq-mean-*) or tokens (token-mean)
    stats: dict[str, torch.Tensor]  # detached sums over tokens, for logging


class GRPOObjective:
    def __init__(
        self,
        clip_eps: float = 0.2,
        beta: float = 0.0,
        loss_aggregation: str = "seq-mean-token-mean",
        scale_rewards: bool = True,
        eps: float = 1e-6,
    ) -> None:
        if loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"algorithm.objective.loss_aggregation={loss_aggregation!r}; choose one of {LOSS_AGGREGATIONS}")
        if clip_eps <= 0 or beta < 0:
            raise ValueError(f"need clip_eps > 0 and beta >= 0, got clip_eps={clip_eps}, beta={beta}")
        self.clip_eps = clip_eps
        self.beta = beta
        self.loss_aggregation = loss_aggregation
        self.scale_rewards = scale_rewards
        self.eps = eps

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """(r - mean) / (std + eps) within one group; all-equal rewards give exactly zero."""
        if torch.all(rewards == rewards[0]):  # exact zeros: the float32 mean's rounding must not leak in
            return torch.zeros_like(rewards)
        values = rewards.double()
        centred = values - values.mean()
        if self.scale_rewards:
            centred = centred / (values.std() + self.eps)
        return centred.to(rewards.dtype)

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
    ) -> LossTerms:
        """Per-token tensors are ``[B, T]``; ``advantages`` is ``[B]``; ``mask`` marks completion tokens."""
        mask = mask.to(logp.dtype)
        ratio = torch.exp(logp - old_logp)
        adv = advantages[:, None]
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps) * adv
        per_token = -torch.minimum(unclipped, clipped)
        stats = {"clipped_tokens": ((unclipped != clipped).to(mask.dtype) * mask).sum().detach()}
        if self.beta > 0:
            if ref_logp is None:
                raise ValueError("beta > 0 needs reference log-probs")
            log_ratio_ref = ref_logp - logp
            kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3 estimator of KL(policy || reference)
            per_token = per_token + self.beta * kl
            stats["kl_sum"] = (kl * mask).sum().detach()
        tokens = mask.sum(-1)
        stats["tokens"] = tokens.sum().detach()
        if self.loss_aggregation == "token-mean":
            return LossTerms((per_token * mask).sum(), tokens.sum().detach(), stats)
        per_sequence = (per_token * mask).sum(-1) / tokens.clamp(min=1)
        return LossTerms(per_sequence.sum(), torch.tensor(float(logp.shape[0]), device=logp.device), stats)
