"""The GRPO family: one clipped-ratio policy-gradient objective whose options give GRPO, Dr. GRPO, DAPO,
GSPO and RLOO (the presets are `conf/algorithm/*.yaml`; docs/algorithms.md has the formulas).

The objective returns an un-normalised loss sum and its normaliser separately. The module adds both up
over the micro-batches of a mini-batch and divides the gradient once, at the optimizer step. Whatever
the aggregation mode, the update therefore does not depend on how the mini-batch was split or in which
order its groups arrived (docs/design.md, invariant 4).

Example::

    >>> objective = GRPOObjective(clip_eps=0.2, beta=0.0)
    >>> objective.advantages(torch.tensor([1.0, 0.0])).tolist()
    [0.7071..., -0.7071...]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
ADVANTAGES = ("group", "rloo")
RATIO_LEVELS = ("token", "sequence")


@dataclass
class LossTerms:
    loss_sum: torch.Tensor  # scalar, not yet divided by the normaliser
    normaliser: torch.Tensor  # scalar: tokens (token-mean), samples (seq-mean-*), samples x max_length (-norm)
    stats: dict[str, torch.Tensor]  # detached sums over the micro-batch's tokens or samples, for logging


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs (Schulman's k1/k2/k3)."""
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"kl_estimator={estimator!r}; choose one of {KL_ESTIMATORS}")


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_length: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(un-normalised sum, normaliser) of ``per_token`` ``[B, T]`` over ``mask`` for aggregation ``mode``."""
    masked = torch.where(mask > 0, per_token, torch.zeros_like(per_token))  # an inf off the mask must not become NaN
    tokens = mask.sum(-1)
    samples = torch.tensor(float(per_token.shape[0]), device=per_token.device)
    if mode == "token-mean":  # Σ_tokens / (tokens in the mini-batch)
        return masked.sum(), tokens.sum().detach()
    if mode == "seq-mean-token-sum":  # Σ_i Σ_t / (samples)
        return masked.sum(), samples
    if mode == "seq-mean-token-mean":  # Σ_i (Σ_t / |o_i|) / (samples)
        return (masked.sum(-1) / tokens.clamp(min=1)).sum(), samples
    if mode == "seq-mean-token-sum-norm":  # Σ_i Σ_t / (samples · max_length): Dr. GRPO's constant normaliser
        return masked.sum(), samples * max_length
    raise ValueError(f"loss_aggregation={mode!r}; choose one of {LOSS_AGGREGATIONS}")


class GRPOObjective:
    """Clipped-ratio policy gradient on group-relative advantages.

    Args:
        clip_eps, clip_eps_high: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]
            (``clip_eps_high`` defaults to ``clip_eps``; DAPO's clip-higher sets it larger).
        beta, kl_estimator, kl_in_reward: β·KL(policy || reference), estimated per token by k1/k2/k3,
            either added to the per-token loss or subtracted from the reward as β·Σ_t KL_t before
            the advantages are computed. β = 0 skips the reference forward.
        loss_aggregation: one of ``LOSS_AGGREGATIONS``; ``max_length`` is the constant of
            ``seq-mean-token-sum-norm`` (Dr. GRPO: the completion length limit).
        advantage: ``group`` (r - mean of the group, divided by its std if ``scale_rewards``) or ``rloo``
            (r minus the mean of the *other* samples of the group).
        ratio_level: ``token`` (PPO/GRPO) or ``sequence`` (GSPO: one length-normalised ratio per sample,
            exp(mean_t(log π - log π_old)), clipped per sample).
        entropy_coef: subtracts coef·entropy per token (an exploration bonus); 0 skips computing it.
        tis_cap: truncated importance sampling against the rollout engine's log-probs: each token's
            policy-gradient term (not the KL or entropy terms) is weighted by min(π_old / π_rollout, tis_cap).
            None (default) is off: the method is on-policy, and π_rollout differs from π_old only by the
            engine's numerics.
        dynamic_sampling: DAPO: groups whose rewards are all equal are dropped, and more prompts are
            drawn to keep the iteration's group count (done by the datamodule).
        overlong_buffer, overlong_penalty: DAPO's soft overlong punishment. With length limit L and buffer
            B, a completion of length l > L - B gets a penalty of overlong_penalty·(L - B - l)/B added to
            its reward. A completion cut at the limit gets -overlong_penalty.
    """

    def __init__(
        self,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        beta: float = 0.0,
        kl_estimator: str = "k3",
        kl_in_reward: bool = False,
        loss_aggregation: str = "seq-mean-token-mean",
        max_length: int | None = None,
        advantage: str = "group",
        scale_rewards: bool = True,
        ratio_level: str = "token",
        entropy_coef: float = 0.0,
        tis_cap: float | None = None,
        dynamic_sampling: bool = False,
        overlong_buffer: int | None = None,
        overlong_penalty: float = 1.0,
        eps: float = 1e-6,
    ) -> None:
        clip_eps_high = clip_eps if clip_eps_high is None else clip_eps_high
        checks = [
            (
                loss_aggregation in LOSS_AGGREGATIONS,
                f"loss_aggregation={loss_aggregation!r}; choose one of {LOSS_AGGREGATIONS}",
            ),
            (kl_estimator in KL_ESTIMATORS, f"kl_estimator={kl_estimator!r}; choose one of {KL_ESTIMATORS}"),
            (advantage in ADVANTAGES, f"advantage={advantage!r}; choose one of {ADVANTAGES}"),
            (ratio_level in RATIO_LEVELS, f"ratio_level={ratio_level!r}; choose one of {RATIO_LEVELS}"),
            (
                clip_eps > 0 and clip_eps_high > 0,
                f"need clip_eps > 0 and clip_eps_high > 0, got {clip_eps}, {clip_eps_high}",
            ),
            (
                beta >= 0 and entropy_coef >= 0,
                f"need beta >= 0 and entropy_coef >= 0, got beta={beta}, entropy_coef={entropy_coef}",
            ),
            (
                loss_aggregation != "seq-mean-token-sum-norm" or (max_length or 0) > 0,
                "loss_aggregation=seq-mean-token-sum-norm needs max_length (the completion length limit)",
            ),
            (tis_cap is None or tis_cap >= 1, f"tis_cap must be >= 1 (or null: off), got {tis_cap}"),
            (
                overlong_buffer is None or overlong_buffer > 0,
                f"overlong_buffer must be > 0 (or null: off), got {overlong_buffer}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"GRPOObjective: {message}")
        self.clip_eps, self.clip_eps_high = clip_eps, clip_eps_high
        self.beta, self.kl_estimator, self.kl_in_reward = beta, kl_estimator, kl_in_reward
        self.loss_aggregation, self.max_length = loss_aggregation, max_length
        self.advantage, self.scale_rewards, self.ratio_level = advantage, scale_rewards, ratio_level
        self.entropy_coef, self.tis_cap = entropy_coef, tis_cap
        self.dynamic_sampling = dynamic_sampling
        self.overlong_buffer, self.overlong_penalty = overlong_buffer, overlong_penalty
        self.eps = eps

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    # -- rewards and advantages ----------------------------------------------------------------------------
    def shape_rewards(
        self, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor, length_limit: int
    ) -> torch.Tensor:
        """DAPO's overlong reward shaping (identity when ``overlong_buffer`` is None)."""
        if self.overlong_buffer is None:
            return rewards
        expected = length_limit - self.overlong_buffer
        penalty = ((expected - lengths).clamp(max=0) / self.overlong_buffer * self.overlong_penalty).to(rewards.dtype)
        penalty = torch.where(truncated, torch.full_like(penalty, -self.overlong_penalty), penalty)
        return rewards + penalty

    def check_shape(self, micro_batch_size: int, group_size: int) -> None:
        """Refuse a micro-batch size this objective cannot train on (KL in the reward needs whole groups)."""
        if self.kl_in_reward and micro_batch_size % group_size:
            raise ValueError(
                f"GRPOObjective(kl_in_reward=True) needs whole groups per micro-batch: "
                f"make IterationShape(micro_batch_size={micro_batch_size}) a multiple of group_size={group_size}"
            )

    def kl_in_reward_advantages(self, batch, old_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
        """Advantages from the micro-batch's (shaped) rewards minus β·Σ_t KL_t(θ_k || reference), group by group."""
        sequence_kl = (kl_estimate(old_logp, ref_logp, self.kl_estimator) * batch.completion_mask).sum(-1)
        rewards = batch.shaped_rewards.to(sequence_kl.device) - self.beta * sequence_kl
        advantages = torch.empty_like(rewards)
        ids = torch.tensor(batch.prompt_ids, device=rewards.device)
        for prompt_id in ids.unique():
            members = ids == prompt_id
            if int(members.sum()) != batch.group_size:
                raise ValueError(
                    "kl_in_reward needs whole groups in each micro-batch: "
                    "make IterationShape.micro_batch_size a multiple of group_size"
                )
            advantages[members] = self.advantages(rewards[members])
        return advantages

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages of one group's samples; all-equal rewards give exactly zero."""
        listed = rewards.tolist()  # one op, not three: this runs per group, between training steps
        if all(value == listed[0] for value in listed):  # exact zeros: the float32 mean's rounding must not leak in
            return torch.zeros_like(rewards)
        values = rewards.double()
        G = values.shape[0]
        if self.advantage == "rloo":  # r_i - mean_{j != i} r_j = G/(G-1) · (r_i - mean)
            return ((values - values.mean()) * G / (G - 1)).to(rewards.dtype)
        centred = values - values.mean()
        if self.scale_rewards:
            centred = centred / (values.std() + self.eps)
        return centred.to(rewards.dtype)

    # -- the loss --------------------------------------------------------------------------------------
    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        ref_logp: torch.Tensor | None,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        rollout_logp: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> LossTerms:
        """Per-token tensors are ``[B, T]``; ``advantages`` is ``[B]``; ``mask`` marks completion tokens.

        ``old_logp`` is θ_k's (equal to ``logp.detach()`` with one optimizer step per iteration);
        ``rollout_logp`` the sampler's, used only for truncated importance sampling.
        """
        mask = mask.to(logp.dtype)
        tokens = mask.sum(-1)
        adv = advantages[:, None].to(logp.dtype)
        log_ratio = logp - old_logp
        if self.ratio_level == "sequence":  # GSPO: one ratio per sample, from the mean token log-ratio
            log_ratio = ((log_ratio * mask).sum(-1, keepdim=True) / tokens.clamp(min=1)[:, None]).expand_as(logp)
        ratio = torch.exp(log_ratio)
        unclipped = ratio * adv
        clipped = ratio.clamp(1 - self.clip_eps, 1 + self.clip_eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        stats = {
            "tokens": tokens.sum().detach(),
            "samples": torch.tensor(float(logp.shape[0]), device=logp.device),
            # tokens whose gradient the clip removed (the clipped term is the smaller one)
            "clipped_tokens": ((clipped < unclipped).to(mask.dtype) * mask).sum().detach(),
            # k3 estimate of KL(old || new), the usual "approx_kl"
            "approx_kl_sum": ((torch.exp(-log_ratio) + log_ratio - 1).detach() * mask).sum(),
        }
        if self.tis_cap is not None:
            if rollout_logp is None:
                raise ValueError("tis_cap needs the rollout engine's log-probs")
            weight = torch.exp(old_logp - rollout_logp).clamp(max=self.tis_cap).detach()
            per_token = per_token * weight
            stats["tis_weight_sum"] = (weight * mask).sum()
        if self.beta > 0 and ref_logp is None:
            raise ValueError("beta > 0 needs the reference model's log-probs (ref_logp)")
        if ref_logp is not None:
            kl = kl_estimate(logp, ref_logp, self.kl_estimator)
            stats["kl_sum"] = (kl.detach() * mask).sum()
            if self.beta > 0 and not self.kl_in_reward:
                per_token = per_token + self.beta * kl
        if entropy is not None:
            stats["entropy_sum"] = (entropy.detach() * mask).sum()
            if self.entropy_coef > 0:
                per_token = per_token - self.entropy_coef * entropy
        loss_sum, normaliser = aggregate(per_token, mask, self.loss_aggregation, self.max_length)
        return LossTerms(loss_sum, normaliser, stats)
