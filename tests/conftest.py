"""Shared helpers: a fast tiny configuration, a fit runner, SGD keywords for exact weight comparisons, a
recorder of trained micro-batches, a pool without worker processes, and a pool wrapper for fault injection."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator

import lightning
import pytest
import torch
from lightning.pytorch import Callback
from transformers import AutoConfig, AutoModelForCausalLM

from lit_parl import GRPOModule, GRPOObjective, IterationShape, RolloutDataModule, tiny_qwen2
from lit_parl.callbacks import WeightSync
from lit_parl.rollout import HFRolloutPool, PoolSpec, RolloutPool
from lit_parl.rewards import Reward
from lit_parl.tasks import CopyTask
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0)


def make_components(
    mode: str = "async",
    pool: RolloutPool | None = None,
    prompts: int = 8,
    group_size: int = 4,
    micro_batch_size: int = 8,
    task=None,
    rewards=None,
    objective: GRPOObjective | None = None,
    trainer_threads: int | None = 1,
    seed: int = 0,
    mini_batches: int = 1,
    passes: int = 1,
    lr: float | None = None,
    datamodule_kwargs: dict | None = None,
    **module_kwargs,
) -> tuple[GRPOModule, RolloutDataModule]:
    policy, tokenizer = tiny_qwen2(seed=seed)
    shape = IterationShape(prompts, group_size, micro_batch_size, mini_batches, passes)
    objective = objective or GRPOObjective()
    if lr is not None:
        module_kwargs["optimizer"] = functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    module = GRPOModule(policy, objective, shape, tokenizer=tokenizer, temperature=SAMPLING.temperature, **module_kwargs)
    task = task or CopyTask(seed=seed)
    datamodule = RolloutDataModule(
        task,
        rewards or [Reward(task.reward, name="positional")],
        pool or HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1),
        tokenizer,
        shape,
        objective,
        initial_model=policy,
        **{"mode": mode, "sampling": SAMPLING, "seed": seed, "trainer_threads": trainer_threads, "gate_timeout_s": 60, **(datamodule_kwargs or {})},
    )
    return module, datamodule


def fit(module, datamodule, iterations: int, callbacks=(), weight_sync: WeightSync | None = None, **trainer_kwargs) -> lightning.Trainer:
    """A CPU fit of ``iterations`` epochs with ``weight_sync`` (default: a plain ``WeightSync()``) first."""
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=iterations,
        callbacks=[weight_sync or WeightSync(), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, datamodule=datamodule)
    return trainer


def policy_state(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def sgd(lr: float, momentum: float = 0.0) -> dict:
    """``make_components`` keywords for plain SGD without clipping: the update is exactly -lr x gradient, so a
    wrong gradient scale shows in the weights (AdamW's normalised step and norm clipping would hide it).
    ``momentum`` keeps that linearity and gives the optimizer a state that a resume must restore."""
    return {"optimizer": functools.partial(torch.optim.SGD, lr=lr, momentum=momentum), "max_grad_norm": None}


class BatchRecorder(Callback):
    """Records every micro-batch the trainer starts training, with its epoch (= the iteration)."""

    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch))

    def samples(self) -> list[tuple[int, int, int]]:
        """``(iteration, prompt_id, sample_index)`` of every trained sample, in training order (first pass only)."""
        return [
            (epoch, prompt_id, sample)
            for epoch, batch in self.batches
            if batch.pass_index == 0
            for prompt_id, sample in zip(batch.prompt_ids, batch.sample_indices)
        ]


class InProcessPool(RolloutPool):
    """A pool without worker processes: samples in the trainer's process from the synced weights.

    For tests of the data path, where the backend does not matter and a spawned worker's start-up (seconds)
    would dominate the fit. Each sample draws from its own seed, at the sampling temperature, and reports
    the full softmax's log-probs, as every backend does; top-k/top-p filtering is not implemented.
    """

    backend = "in-process"

    def _start(self, spec: PoolSpec) -> None:
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model_dir), attn_implementation="sdpa").eval()
        self.eos_id = spec.eos_id
        self.held: int | None = None

    def _sync_weights(self, buckets, version: int) -> None:
        parameters, loaded = dict(self.model.named_parameters()), set()
        with torch.no_grad():
            for bucket in buckets:
                for name, tensor in bucket:
                    parameters[name].copy_(tensor)  # copied: the buckets are not ours to keep
                    loaded.add(name)
        if loaded != set(parameters):
            raise ValueError(f"version {version} left parameters unloaded: {sorted(set(parameters) - loaded)[:5]}")
        self.held = version

    @torch.no_grad()
    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        if sampling.top_k or sampling.top_p < 1 or sampling.stop:
            raise NotImplementedError("InProcessPool samples from the full softmax only (top_k=0, top_p=1, no stop strings)")
        temperature = sampling.temperature or 1.0  # greedy: the argmax, log-probs of the plain softmax
        stops = (self.eos_id, *sampling.stop_token_ids)
        for request in requests:  # the group's samples side by side; each row draws from its own seed
            generators = [torch.Generator().manual_seed(seed) for seed in request.seeds]
            tokens = torch.tensor([request.prompt_tokens] * request.group_size)
            steps = []
            for _ in range(sampling.max_new_tokens):
                logp = (self.model(input_ids=tokens).logits[:, -1].float() / temperature).log_softmax(-1)
                if sampling.greedy:
                    drawn = logp.argmax(-1)
                else:
                    drawn = torch.cat([torch.multinomial(row.exp(), 1, generator=g) for row, g in zip(logp, generators)])
                steps.append((drawn.tolist(), logp.gather(-1, drawn[:, None])[:, 0].tolist()))
                tokens = torch.cat([tokens, drawn[:, None]], dim=1)
            completions, logprobs, reasons = [], [], []
            for k in range(request.group_size):
                drawn = [step[0][k] for step in steps]
                end = next((t + 1 for t, token in enumerate(drawn) if token in stops), len(drawn))
                completions.append(drawn[:end])
                logprobs.append([step[1][k] for step in steps[:end]])
                reasons.append("stop" if drawn[end - 1] in stops else "length")
            yield GroupCompletions(request.prompt_id, self.held, list(range(request.group_size)), completions, logprobs, reasons)

    def _worker_counts(self) -> tuple[int, int]:
        return (1, 1)

    def _close(self) -> None:
        self.model = None

    def logprob_tolerance(self) -> float:
        return 1e-5  # float32 on the trainer's own weights: measured ~1e-8 per token, so the on-policy check is tight


class WrappedPool(RolloutPool):
    """Delegates to a real pool; subclasses override ``transform`` to reorder, delay or corrupt groups."""

    backend = "wrapped"

    def __init__(self, inner: RolloutPool) -> None:
        super().__init__()
        self.inner = inner
        self.returned: list[GroupCompletions] = []

    def _start(self, spec) -> None:
        self.inner.start(spec)

    def _sync_weights(self, buckets, version: int) -> None:
        self.inner.sync_weights(buckets, version)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        for group in self.transform(self.inner.generate(requests, sampling)):
            self.returned.append(copy.deepcopy(group))
            yield group

    def transform(self, groups: Iterator[GroupCompletions]) -> Iterator[GroupCompletions]:
        yield from groups

    def _worker_counts(self) -> tuple[int, int]:
        health = self.inner.health()
        return health.workers, health.alive

    def _close(self) -> None:
        self.inner.close()

    def reserved_cpus(self, colocated: bool) -> int:
        return self.inner.reserved_cpus(colocated)

    def logprob_tolerance(self):
        return self.inner.logprob_tolerance()

    def _busy_intervals(self):
        return self.inner.busy_intervals()


class KeepsFirstWeights(WrappedPool):
    """Pushes the first sync's weights at every sync, under each new version: the labels are all correct, the
    weights stale (a sync that was not applied)."""

    first = None

    def _sync_weights(self, buckets, version):
        buckets = [[(name, tensor.detach().clone()) for name, tensor in bucket] for bucket in buckets]
        if self.first is None:
            self.first = buckets
        self.inner.sync_weights(self.first, version)


@pytest.fixture
def hf_pool():
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)
    yield pool
    pool.close()
