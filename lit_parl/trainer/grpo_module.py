"""GRPOModule: the tri-model (policy, old, reference) and the GRPO update, one micro-batch per step.

Optimisation is manual because optimizer steps fall on data boundaries (the end of a mini-batch of the
iteration), not on a fixed count of ``training_step`` calls, and because the gradient is divided by the
mini-batch's normaliser only once the whole mini-batch has arrived (docs/design.md, invariant 4).

Tri-model: ``policy`` is trained; ``old`` is the exact snapshot of the policy taken at the start of the
iteration (θ_k), kept only when an iteration has several optimizer steps (mini-batches or passes; with
one step the old log-probs equal the policy's, so ``logp.detach()`` stands in); ``reference`` is θ_0,
kept only when β > 0. One call per micro-batch computes all three on the same packed layout. With LoRA
(``lora``) neither copy exists: θ_0 is the policy with its adapters off, θ_k an adapter (``trainer.tri_model``).

Per-iteration metrics (``lit_parl.trainer.iteration_metrics``) are logged at the end of each epoch.

Example::

    >>> from lit_parl.data.iteration_shape import IterationShape
    >>> from lit_parl.models import tiny_qwen2
    >>> from lit_parl.trainer.grpo_objective import GRPOObjective
    >>> policy, tokenizer = tiny_qwen2()
    >>> shape = IterationShape(prompts=8, group_size=4, micro_batch_size=8)
    >>> module = GRPOModule(policy, GRPOObjective(beta=0.04), shape, tokenizer=tokenizer)
    >>> module.reference is not None, module.old is None
    (True, True)
"""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable, Iterable

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.callbacks.full_tensors import is_sharded
from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.micro_batch import MicroBatch
from lit_parl.kernels.backends import compute_dtype as attention_dtype
from lit_parl.kernels.backends import resolve_backend
from lit_parl.kernels.forward import check_supported
from lit_parl.models.limits import check_memory
from lit_parl.models.lora import LoRASettings
from lit_parl.settings import as_settings
from lit_parl.trainer import tri_model
from lit_parl.trainer.grpo_objective import GRPOObjective
from lit_parl.trainer.guards import NonFiniteGuard
from lit_parl.trainer.iteration_metrics import IterationMetrics
from lit_parl.trainer.iteration_progress import IterationProgress
from lit_parl.trainer.lean_checkpoint import fingerprint, leave_out, put_back
from lit_parl.trainer.precision import check_precision, compute_dtype, enable_checkpointing
from lit_parl.trainer.step_tally import StepTally
from lit_parl.trainer.strategies import StrategyAdapter, adapter_for
from lit_parl.trainer.warmup_schedule import with_schedule


class GRPOModule(LightningModule):
    """The policy, its θ_k snapshot and reference, and the GRPO-family update, one micro-batch per step.

    Args:
        policy: a transformers causal LM (Llama, Qwen2, Qwen3, Mistral families); the model trained.
        objective: the loss and its options (``GRPOObjective``).
        shape: the iteration's shape, the same object the datamodule has; with more than one optimizer
            step per iteration the module keeps an exact θ_k snapshot as the old policy.
        tokenizer: saved beside the policy by ``HFExport``; not used for training.
        optimizer: ``params -> Optimizer`` (e.g. ``functools.partial(torch.optim.AdamW, lr=5e-4,
            weight_decay=0.0)``, the default).
        lr_schedule: ``(optimizer, total_steps) -> LRScheduler | None`` stepped after every optimizer step
            (``lit_parl.trainer.warmup_schedule.WarmupSchedule``); ``None`` (or a schedule returning None): a constant
            learning rate.
        max_grad_norm: clip the gradient's global norm to this (``None``: no clipping).
        temperature: the sampling temperature: log-probs are computed from logits / T, as sampled.
        attention_backend: shared-prompt attention backend: ``auto`` picks the best one for the device and the
            compute dtype (``compute_dtype``), resolved at fit start; flash and npu compute in float16/bfloat16
            only, so ``auto`` never picks them for float32, and naming one for float32 is an error.
        logprob_chunk_size: label tokens per LM-head chunk (memory: four to five chunk x vocabulary floats).
        on_nonfinite: what a NaN or infinite advantage, log-prob, loss or gradient does to its optimizer
            step: ``skip`` it (counted as ``nonfinite/skipped_steps``, with a warning naming the prompts) or
            ``raise`` (``lit_parl.trainer.guards.NonFiniteGuard``).
        memory_budget_gib: refuse, at construction, a micro-batch whose estimated activation and logits
            memory exceeds this (``lit_parl.models.limits.check_memory``); ``None``: no budget.
        max_sample_tokens: prompt plus completion tokens of the longest sample, for that estimate
            (``None``: the model's context, an upper bound).
        gradient_checkpointing: recompute each of the policy's decoder layers in the backward instead of keeping
            its activations (transformers' activation checkpointing, non-reentrant): activation memory of one
            layer instead of all of them, for one more forward of the decoder. The gradient is the same. θ_k
            and the reference run without gradients and are never checkpointed. It acts while the policy is in
            training mode (Lightning's fit puts it there).
        lora: train LoRA adapters instead of the full weights (``lit_parl.models.lora.LoRASettings`` or its fields;
            needs ``peft``): the optimizer holds the adapters only, θ_0 is the policy with them off, θ_k a copy
            of them, and the pool loads the merged weights. ``None``: full weights. One device or DDP.

    Precision: on a GPU train with ``Trainer(precision="bf16-mixed")`` (``trainer=gpu``) and a float32 policy:
    the weights (and θ_k, the reference) stay float32 and the forward computes in bfloat16 under autocast.
    bfloat16 weights would round away every update smaller than about 2^-8 of a weight, so a policy loaded in
    half precision (or ``precision="bf16-true"``) is warned about at fit start; float16 is refused (no loss scaler).
    """

    def __init__(
        self,
        policy: PreTrainedModel,
        objective: GRPOObjective,
        shape: IterationShape,
        tokenizer: PreTrainedTokenizerBase | None = None,
        optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        lr_schedule: Callable | None = None,
        max_grad_norm: float | None = 1.0,
        temperature: float = 1.0,
        attention_backend: str = "auto",
        logprob_chunk_size: int = 1024,
        on_nonfinite: str = "skip",
        memory_budget_gib: float | None = None,
        max_sample_tokens: int | None = None,
        gradient_checkpointing: bool = False,
        lora: LoRASettings | dict | None = None,
    ) -> None:
        super().__init__()
        check_supported(policy)
        if not temperature > 0:
            raise ValueError(
                f"GRPOModule(temperature={temperature}): training log-probs are taken at logits / T, T > 0 "
                "(greedy is for evaluation)"
            )
        check_memory(policy.config, shape.micro_batch_size, max_sample_tokens, logprob_chunk_size, memory_budget_gib)
        objective.check_shape(shape.micro_batch_size, shape.group_size)
        self.automatic_optimization = False
        # validation_step logs a held-out evaluation when the datamodule has one (it then has a val_dataloader);
        # without one Lightning skips validation, as intended, and says so on every fit
        warnings.filterwarnings("ignore", message=r"You defined a `validation_step` but have no `val_dataloader`")
        self.policy = policy
        self.objective = objective
        self.shape = shape
        self.tokenizer = tokenizer
        self.optimizer_factory = optimizer or functools.partial(torch.optim.AdamW, lr=5e-4, weight_decay=0.0)
        self.lr_schedule = lr_schedule
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.attention_backend = attention_backend  # resolved for the device at fit start
        self.logprob_chunk_size = logprob_chunk_size
        self._backend: str | None = None
        self.guard = NonFiniteGuard(on_nonfinite)
        self.tally = StepTally()  # this optimizer step's micro-batches, agreed across ranks at the step
        self.lora = as_settings(LoRASettings, lora) if lora is not None else None
        # θ_0 and θ_k as frozen copies where needed; LoRA: adapters injected into the policy, no copy
        self.reference, self.old = tri_model.frozen_views(policy, objective, shape, self.lora)
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:  # the policy only, after the copies: θ_k and the reference keep no activations
            enable_checkpointing(policy)
        # checkpoints leave out what the module rebuilds: θ_0 (from the initial model, checked against this: the
        # reference, or with LoRA the policy's frozen base) and, between iterations, θ_k (the policy at its start)
        theta_0 = self.policy if self.lora is not None else self.reference
        self._reference_fingerprint = fingerprint(theta_0) if theta_0 is not None else None
        self.progress = IterationProgress(shape.optimizer_steps)  # where a checkpoint falls in the iteration
        self.train_intervals: list[tuple[float, float]] = []  # (start, end) monotonic, this iteration
        self.metrics = IterationMetrics()  # logged at each iteration's end
        # what the update does under the trainer's strategy (set for it in setup); kept out of the module tree
        self.__dict__["strategy_adapter"] = StrategyAdapter()

    # -- Lightning hooks -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        check_precision(self.trainer, self.policy)  # before the strategy wraps the module
        self.__dict__["strategy_adapter"] = adapter_for(self.trainer.strategy, self.strategy_adapter)
        self.strategy_adapter.prepare(self.max_grad_norm, self.shape.micro_batch_size)

    def compute_dtype(self, precision: str | None = None) -> torch.dtype:
        """The dtype the forward computes in under ``precision`` (default: the trainer's): bfloat16 under
        ``bf16-*`` (autocast over float32 weights, or converted weights), else the policy's weights' dtype. The
        attention backend is chosen for it (``auto`` never picks a half-only kernel for float32)."""
        if precision is None and self._trainer is not None:
            precision = str(self._trainer.precision)
        return compute_dtype(precision, self.policy)

    def configure_model(self) -> None:
        """Lay out the policy, θ_k and the reference alike for the strategy: FSDP2 shards over the data-parallel
        mesh, FSDP1 units, DeepSpeed ZeRO-3 partitions (``lit_parl.trainer.strategies``)."""
        self.strategy_adapter.configure_model(self)

    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.policy.parameters() if p.requires_grad])  # LoRA: adapters
        epochs = self.trainer.max_epochs if self.trainer is not None else None
        return with_schedule(optimizer, self.lr_schedule, epochs, self.shape.optimizer_steps)

    def holding_theta_k(self):
        """A context in which ``policy`` computes θ_k (LoRA keeps it as an adapter); ``None``: θ_k is ``old``."""
        return tri_model.theta_k_in_policy(self)

    def on_fit_start(self) -> None:
        self._backend = resolve_backend(self.attention_backend, self.device, self.compute_dtype())
        self.strategy_adapter.on_fit_start(self)

    def on_train_epoch_start(self) -> None:
        self.progress.start_iteration()
        tri_model.take_snapshot(self)  # θ_k exactly: the weights the pool generates this iteration with
        self.train_intervals = []

    def on_train_epoch_end(self) -> None:
        self.metrics.log_to(self)
        self.log("nonfinite/skipped_steps", float(self.guard.skipped_steps))

    def validation_step(self, metrics: dict[str, float], batch_idx: int) -> None:
        """Logs what the held-out evaluation measured (``lit_parl.data.evaluator``: the datamodule generates
        and scores it through the pool, with the weights of the iteration just trained)."""
        for name, value in metrics.items():
            shown = name in ("val/greedy_accuracy", "val/pass@1") or name.startswith("val/mean@")
            self.log(name, value, prog_bar=shown, batch_size=1)

    # -- the algorithm ---------------------------------------------------------------------------------
    def completion_logprobs(self, model: PreTrainedModel, batch: MicroBatch, with_entropy: bool = False):
        """Log-probs ``[n, T]`` of the batch's completions under ``model`` at the sampling temperature."""
        if batch.tokens.attention is not None:
            # resolved at fit start; outside a fit, for what autocast or the weights compute in now
            dtype = attention_dtype(next(model.parameters()))
            batch.tokens.attention.backend = self._backend or resolve_backend(
                self.attention_backend, self.device, dtype
            )
        chunk = self.logprob_chunk_size
        return self.strategy_adapter.logprobs(model, batch.tokens, self.temperature, chunk, with_entropy)

    def training_step(self, batch: MicroBatch, batch_idx: int) -> torch.Tensor:
        start = time.monotonic()
        objective = self.objective
        logp, entropy = self.completion_logprobs(self.policy, batch, with_entropy=True)
        old_logp, ref_logp = tri_model.frozen_logprobs(self, batch, logp)
        advantages = batch.advantages
        if objective.kl_in_reward and ref_logp is not None:
            advantages = objective.kl_in_reward_advantages(batch, old_logp, ref_logp)
        terms = objective(logp, old_logp, ref_logp, advantages, batch.completion_mask, batch.rollout_logprobs, entropy)
        values = {"advantages": advantages, "log-probs": logp, "rollout log-probs": batch.rollout_logprobs}
        finite = self.guard.inspect({**values, "loss": terms.loss_sum}, batch.prompt_ids)
        self.tally.check_on_policy(batch, old_logp)
        # Backward even now: under DDP every rank must join each backward's gradient reduction. Both checks
        # are decided at the optimizer step, on every rank at once, before any weight moves.
        self.strategy_adapter.ends_step(batch.ends_step)
        self.manual_backward(terms.loss_sum)
        self.progress.micro_batch()
        self.tally.add(float(terms.normaliser), float(terms.loss_sum.detach()) if finite else None)
        if batch.pass_index == 0:  # each reward's values, whatever the loss: every rank then logs every reward's name
            self.metrics.add_rewards(batch)
        if finite:
            self.metrics.update(batch, terms, old_logp)
        if batch.ends_step:  # the datamodule marks the end of each mini-batch
            self._optimizer_step()
        self.train_intervals.append((start, time.monotonic()))
        return terms.loss_sum.detach()

    # -- the update ------------------------------------------------------------------------------------
    def _optimizer_step(self) -> None:
        optimizer = self.optimizers()
        self.progress.optimizer_step()
        step = self.tally.agree(self.trainer.strategy, self.device, nonfinite_here=self.guard.pending)
        # gradients are averaged over ranks; the normaliser spans them all
        scale = self.trainer.world_size / step.normaliser if step.normaliser > 0 else 1.0
        flagged_elsewhere = step.nonfinite_ranks > int(self.guard.pending)
        is_finite = functools.partial(self.guard.step_is_finite, flagged_elsewhere=flagged_elsewhere)
        grad_norm = self.strategy_adapter.step(
            optimizer, self.policy, scale, self.max_grad_norm, is_finite, step.nonfinite_ranks > 0
        )
        if grad_norm is None:
            return self._skip_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        scheduler = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()
        self.metrics["grad_norm"].update(grad_norm)
        self.log("loss", step.loss_sum / max(step.normaliser, 1e-12), on_step=False, on_epoch=True, batch_size=1)

    def _skip_step(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        skipped = self.guard.skipped_steps
        rank_zero_warn(
            f"optimizer step skipped (module.on_nonfinite=skip; {skipped} so far): {self.guard.last_problem}"
        )

    # -- checkpoints -----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["lit_parl_nonfinite"] = self.guard.state_dict()
        self.progress.save(checkpoint)  # a checkpoint between micro-batches of a step resumes from that step's start
        # inside an iteration θ_k is kept: a resume pushes it to the pool and trains the rest of the iteration against
        # it. Under a sharding strategy nothing is left out: its loader fills every key before this module sees it.
        inside, sharded = self.progress.inside, is_sharded(self.policy)
        leave_out(checkpoint, self._reference_fingerprint, inside, keep_all=sharded, lora=self.lora is not None)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        if "lit_parl_nonfinite" in checkpoint:  # checkpoints written before the guard existed have none
            self.guard.load_state_dict(checkpoint["lit_parl_nonfinite"])
        self.progress.load(checkpoint)
        put_back(checkpoint, self.reference, self.old is not None, self.policy if self.lora is not None else None)

    def on_train_start(self) -> None:
        # restored between iterations: θ_k is the policy (Lightning skips the epoch's start when the checkpoint came
        # after its last batch, and a sharded checkpoint holds the previous iteration's θ_k)
        if self.progress.retake_snapshot:
            tri_model.take_snapshot(self)
        self.progress.retake_snapshot = False
