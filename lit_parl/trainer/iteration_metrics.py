"""IterationMetrics: what one iteration of the update measured, logged at its end.

Rollout side, once per iteration (pass 0): reward mean and std, accuracy, completion length (mean, max),
truncation rate, the share of zero-variance groups, and the rollout engine's log-prob mismatch with θ_k
on the same tokens. Trainer side, every micro-batch: clip fraction, KL to the reference, entropy,
approximate KL between θ_k and the updated policy; every optimizer step: the gradient norm. These are
torchmetrics aggregates, reduced over ranks when computed. Each reward's values (``reward/<name>``) and
failed calls (``reward/<name>/failures``) are plain sums, since their names come from the data and a step
must not wait on the device for them.

Example::

    >>> metrics = IterationMetrics()
    >>> metrics["grad_norm"].update(2.0)
    >>> float(metrics["grad_norm"].compute())
    2.0
"""

from __future__ import annotations

import re
import warnings

import torch
from torchmetrics import MaxMetric, MeanMetric

from lit_parl.trainer.guards import logprob_mismatch

_MEANS = (
    "reward",
    "reward_sq",
    "accuracy",
    "length",
    "truncated",
    "zero_variance",
    "mismatch_abs",
    "mismatch_kl",
    "clip_fraction",
    "kl_ref",
    "entropy",
    "approx_kl",
    "grad_norm",
)
# the logged name of each aggregate whose name is not already the logged one
_LOGGED_AS = {
    "length": "length/mean",
    "length_max": "length/max",
    "truncated": "truncation_rate",
    "zero_variance": "zero_variance_share",
    "mismatch_abs": "mismatch/logprob_abs_diff",
    "mismatch_kl": "mismatch/kl",
}

# Under several ranks Lightning advises sync_dist=True, once per name, for every tensor logged per epoch without it
# (21 lines per DDP run). lit_parl's epoch values need no such all-reduce: this module's aggregates are reduced
# over the ranks by torchmetrics' compute(), the skipped-step count is the same on every rank (the ranks agree on
# each skip), and the loss, throughput, busy times and overlap (the callbacks' EpochEndLogs) are rank 0's own
# measurements, each rank's being alike. The advice is dropped for these names only; a user's value still gets it.
OWN_EPOCH_LOGS = (
    *(_LOGGED_AS.get(name, name) for name in _MEANS if name != "reward_sq"),
    _LOGGED_AS["length_max"],
    "reward_std",
    "loss",
    "nonfinite/skipped_steps",
    "completions_per_s",
    "tokens_per_s",
    "gen_busy_s",
    "train_busy_s",
    "dropped_groups",
    "overlap_efficiency",
)
_NAMES = "|".join(map(re.escape, OWN_EPOCH_LOGS))
warnings.filterwarnings(
    "ignore", message=rf"It is recommended to use `self\.log\('({_NAMES})', \.\.\., sync_dist=True\)`"
)


class IterationMetrics(torch.nn.Module):
    """The per-iteration metrics of ``GRPOModule``: ``update`` per micro-batch, ``log_to`` at the iteration's end.

    ``metrics[name]`` is one aggregate (e.g. ``"clip_fraction"``, a ``MeanMetric``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.aggregates = torch.nn.ModuleDict({name: MeanMetric() for name in _MEANS})
        self.aggregates["length_max"] = MaxMetric()
        self._reward_sums: dict[str, list[float]] = {}
        self._reward_failures: dict[str, int] = {}

    def __getitem__(self, name: str):
        return self.aggregates[name]

    def update(self, batch, terms, old_logp: torch.Tensor) -> None:
        """One micro-batch's loss statistics (``terms.stats``) and, on its first pass, its rollout statistics."""
        m, stats = self.aggregates, terms.stats
        tokens = stats["tokens"].clamp(min=1)
        m["clip_fraction"].update(stats["clipped_tokens"] / tokens, weight=tokens)
        m["approx_kl"].update(stats["approx_kl_sum"] / tokens, weight=tokens)
        m["entropy"].update(stats["entropy_sum"] / tokens, weight=tokens)
        if "kl_sum" in stats:
            m["kl_ref"].update(stats["kl_sum"] / tokens, weight=tokens)
        if batch.pass_index == 0:  # rollout statistics once per iteration, not once per pass
            mask = batch.completion_mask
            lengths = mask.sum(-1).float()
            m["reward"].update(batch.rewards)
            m["reward_sq"].update(batch.rewards**2)
            m["accuracy"].update(batch.correct.float())
            m["length"].update(lengths)
            m["length_max"].update(lengths)
            m["truncated"].update(batch.truncated.float())
            m["zero_variance"].update(batch.zero_variance.float())
            # the rollout engine's log-probs against θ_k's, on the same tokens
            abs_sum, kl_sum, _ = logprob_mismatch(batch.rollout_logprobs, old_logp, mask)
            m["mismatch_abs"].update(abs_sum / tokens, weight=tokens)
            m["mismatch_kl"].update(kl_sum / tokens, weight=tokens)

    def add_rewards(self, batch) -> None:
        """Each reward's sums and failed calls in ``batch`` (whatever its loss: every rank logs every reward's name)."""
        for name, (total, count) in batch.reward_components.items():
            sums = self._reward_sums.setdefault(name, [0.0, 0])
            sums[0] += total
            sums[1] += count
        for name, failures in batch.reward_failures.items():
            self._reward_failures[name] = self._reward_failures.get(name, 0) + failures

    def log_to(self, module) -> None:
        """Log the iteration's values through ``module.log`` (a LightningModule) and start the next iteration's.

        ``compute()`` is a collective under several ranks, so every rank first learns which aggregates any
        rank updated, and all compute those.
        """
        updated = [metric.update_called for metric in self.aggregates.values()]
        trainer = module._trainer
        if trainer is not None and trainer.world_size > 1:
            flags = torch.tensor(updated, dtype=torch.float32, device=module.device)
            updated = trainer.strategy.reduce(flags, reduce_op="sum").gt(0).tolist()
        values = {name: metric.compute() for (name, metric), due in zip(self.aggregates.items(), updated) if due}
        if "reward" in values:
            values["reward_std"] = (values.pop("reward_sq") - values["reward"] ** 2).clamp(min=0).sqrt()
        for name, value in values.items():
            module.log(_LOGGED_AS.get(name, name), value, prog_bar=name == "reward")
        self._log_rewards(module, trainer)
        self._reward_sums, self._reward_failures = {}, {}
        for metric in self.aggregates.values():
            metric.reset()

    def _log_rewards(self, module, trainer) -> None:
        """``reward/<name>``, each reward's mean over the samples it scored on every rank, and
        ``reward/<name>/failures``, its failed calls summed over ranks. A reward that failed on every sample still
        logs its failures (its mean, of no sample, is not logged): a reward whose every call fails must be seen.
        Every rank logs the same names, the union of what any rank saw."""
        names = set(self._reward_sums) | set(self._reward_failures)
        several = trainer is not None and trainer.world_size > 1
        if several:
            seen: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(seen, sorted(names))
            names = set().union(*seen)
        if not names:
            return
        names = sorted(names)
        rows = [[*self._reward_sums.get(n, (0.0, 0)), self._reward_failures.get(n, 0)] for n in names]
        totals = torch.tensor(rows, dtype=torch.float32, device=module.device)
        if several:
            totals = trainer.strategy.reduce(totals, reduce_op="sum")
        for name, (total, count, failures) in zip(names, totals.tolist()):
            # already reduced: the same value on every rank, so sync_dist's mean leaves it as it is
            if count:
                module.log(f"reward/{name}", total / count, sync_dist=True)
            module.log(f"reward/{name}/failures", failures, sync_dist=True)
