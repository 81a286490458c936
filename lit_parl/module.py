"""GRPOModule: the tri-model (policy, old, reference) and the GRPO update, one micro-batch per step.

Optimisation is manual because optimizer steps fall on data boundaries (the end of a mini-batch of the
iteration), not on a fixed count of ``training_step`` calls, and because the gradient is divided by the
mini-batch's normaliser only once the whole mini-batch has arrived (DESIGN.md invariant 4).

Tri-model: ``policy`` is trained; ``old`` is the exact snapshot of the policy taken at the start of the
iteration (θ_k), kept only when an iteration has several optimizer steps (with one step the old
log-probs equal the policy's, so ``logp.detach()`` stands in); ``reference`` is θ_0, kept only when β > 0.

Example::

    >>> from lit_parl.model import tiny_qwen2
    >>> from lit_parl.objectives import GRPOObjective
    >>> policy, tokenizer = tiny_qwen2()
    >>> module = GRPOModule(policy, GRPOObjective(beta=0.04), tokenizer=tokenizer)
    >>> module.reference is not None, module.old is None
    (True, True)
"""

from __future__ import annotations

import copy
import time

import torch
from lightning.pytorch import LightningModule
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.kernels.attention import resolve_backend
from lit_parl.kernels.forward import check_supported, completion_logprobs
from lit_parl.objectives import GRPOObjective
from lit_parl.trajectory import MicroBatch


def _frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    clone = copy.deepcopy(model).eval()
    clone.requires_grad_(False)
    return clone


class GRPOModule(LightningModule):
    def __init__(
        self,
        policy: PreTrainedModel,
        objective: GRPOObjective,
        tokenizer: PreTrainedTokenizerBase | None = None,
        lr: float = 5e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        max_grad_norm: float | None = 1.0,
        mini_batches: int = 1,
        temperature: float = 1.0,
        attention_backend: str = "auto",
        logprob_chunk_size: int = 1024,
    ) -> None:
        super().__init__()
        if mini_batches < 1:
            raise ValueError(f"algorithm.mini_batches must be >= 1, got {mini_batches}")
        check_supported(policy)
        self.automatic_optimization = False
        self.policy = policy
        self.objective = objective
        self.tokenizer = tokenizer
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.max_grad_norm = max_grad_norm
        self.mini_batches = mini_batches
        self.temperature = temperature
        self.attention_backend = attention_backend  # resolved for the device at fit start
        self.logprob_chunk_size = logprob_chunk_size
        self._backend: str | None = None
        self.reference = _frozen_copy(policy) if objective.needs_reference else None
        self.old = _frozen_copy(policy) if mini_batches > 1 else None
        self._normaliser = 0.0
        self._loss_sum = 0.0
        self.train_intervals: list[tuple[float, float]] = []  # (start, end) monotonic, this iteration

    # -- Lightning hooks -------------------------------------------------------------------------------
    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)

    def on_fit_start(self) -> None:
        self._backend = resolve_backend(self.attention_backend, self.device)

    def on_train_epoch_start(self) -> None:
        if self.old is not None:  # θ_k exactly: the weights the pool generates this iteration with
            self.old.load_state_dict(self.policy.state_dict())
        self._normaliser, self._loss_sum = 0.0, 0.0
        self.train_intervals = []

    def group_advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Advantages of one finished group (called by the datamodule as groups arrive)."""
        return self.objective.advantages(rewards)

    def completion_logprobs(self, model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
        """Log-probs ``[n, T]`` of the batch's completions under ``model`` at the sampling temperature."""
        if batch.tokens.attention is not None:
            batch.tokens.attention.backend = self._backend or resolve_backend(self.attention_backend, self.device)
        return completion_logprobs(model, batch.tokens, self.temperature, self.logprob_chunk_size)

    def training_step(self, batch: MicroBatch, batch_idx: int) -> torch.Tensor:
        start = time.monotonic()
        logp = self.completion_logprobs(self.policy, batch)
        with torch.no_grad():
            old_logp = self.completion_logprobs(self.old, batch) if self.old is not None else logp.detach()
            ref_logp = self.completion_logprobs(self.reference, batch) if self.reference is not None else None
        terms = self.objective(logp, old_logp, ref_logp, batch.advantages, batch.completion_mask)
        self.manual_backward(terms.loss_sum)
        self._normaliser += float(terms.normaliser)
        self._loss_sum += float(terms.loss_sum.detach())

        mask = batch.completion_mask
        size = batch.size
        self.log("reward", batch.rewards.mean(), on_step=False, on_epoch=True, prog_bar=True, batch_size=size)
        self.log("rollout/logprob_abs_diff", ((old_logp - batch.rollout_logprobs).abs() * mask).sum() / mask.sum().clamp(min=1),
                 on_step=False, on_epoch=True, batch_size=size)
        self.log("clip_fraction", terms.stats["clipped_tokens"] / terms.stats["tokens"].clamp(min=1), on_step=False, on_epoch=True, batch_size=size)
        if "kl_sum" in terms.stats:
            self.log("kl", terms.stats["kl_sum"] / terms.stats["tokens"].clamp(min=1), on_step=False, on_epoch=True, batch_size=size)

        samples_per_step = batch.iteration_samples // self.mini_batches
        if (batch.sample_offset + size) % samples_per_step == 0:
            self._optimizer_step()
        self.train_intervals.append((start, time.monotonic()))
        return terms.loss_sum.detach()

    # -- the update ------------------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        optimizer = self.optimizers()
        # DDP averages gradients over ranks; the normaliser spans every rank's samples
        world = self.trainer.world_size
        total = float(self.trainer.strategy.reduce(torch.tensor(self._normaliser, device=self.device), reduce_op="sum"))
        loss_sum = float(self.trainer.strategy.reduce(torch.tensor(self._loss_sum, device=self.device), reduce_op="sum"))
        if total > 0:
            scale = world / total
            for parameter in self.policy.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(scale)
        parameters = [p for p in self.policy.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(parameters, self.max_grad_norm if self.max_grad_norm else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.log("loss", loss_sum / max(total, 1e-12), on_step=False, on_epoch=True, batch_size=1)
        self.log("grad_norm", grad_norm, on_step=False, on_epoch=True, batch_size=1)
        self._normaliser, self._loss_sum = 0.0, 0.0
