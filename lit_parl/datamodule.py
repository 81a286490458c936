"""RolloutDataModule: one Lightning epoch = one RL iteration, streamed from a rollout pool.

``train_dataloader()`` yields the current iteration's micro-batches as the pool's groups finish
(``mode="async"``), or only after the whole iteration has been generated (``mode="sync"``, the
colocated baseline). The datamodule wires the data path's parts and owns the pool's lifecycle (started
in ``setup``, closed in ``teardown`` or when the fit fails); each part has one job:

- ``PromptSchedule``: which prompts (rows of ``data``, rendered by ``prompt_format``), their tokens and seeds;
  the cursor a resume needs;
- ``VersionGate``: the version that may generate now, opened by ``WeightSync`` through ``open_iteration``;
- ``GroupScorer``: rewards (inline, or on threads of its own); ``GroupAcceptor``: checks and advantages;
- ``IterationBatcher``: micro-batches, each marked where an optimizer step falls;
- ``Evaluator``: held-out prompts through the pool after chosen iterations (Lightning's validation loop);
- ``RankShare``: under W ranks, which slots of each iteration this rank trains (from its own pool);
- ``ResumePoint``: where a checkpoint left the current iteration, which a restored fit finishes first.

In use: the README's "Components without the CLI" script (run as a script by ``tests/test_readme.py``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from collections import deque
from typing import NamedTuple

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CPUAccelerator
from torch.utils.data import DataLoader, IterableDataset
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.chat import PromptFormat
from lit_parl.data.acceptor import Advantages, GroupAcceptor
from lit_parl.data.batcher import IterationBatcher
from lit_parl.data.evaluation import EvalSettings, Evaluator
from lit_parl.data.gate import OffPolicyError, VersionGate
from lit_parl.data.model_dir import InitialModelDir
from lit_parl.data.prefetch import HeadStart
from lit_parl.data.ranks import RankShare
from lit_parl.data.resume import ResumePoint
from lit_parl.data.schedule import PromptSchedule
from lit_parl.data.scoring import GroupScorer
from lit_parl.data.shape import IterationShape
from lit_parl.data.stats import IterationStats
from lit_parl.limits import check_context, context_length
from lit_parl.prompts import PromptSource
from lit_parl.rewards.policy import ScoringPolicy
from lit_parl.rollout.base import BF16_LOGPROB_TOLERANCE, PoolSpec, RolloutPool
from lit_parl.trajectory import MicroBatch, Packing, SamplingParams

MODES = ("async", "sync")
HISTORY_KEPT = 64  # iterations whose IterationStats stay in `history` (callbacks read the last one)


def _as(kind, value):
    """A settings object from itself, a dict of its fields (Hydra, JSON) or None (the defaults)."""
    return value if isinstance(value, kind) else kind(**(value or {}))


class _Started(NamedTuple):
    """An iteration started when its gate opened: its version, its stats so far, its micro-batches."""

    version: int
    stats: IterationStats
    batches: HeadStart


class _IterationStream(IterableDataset):
    """The micro-batches of the datamodule's current iteration. Sized, so Lightning does not prefetch."""

    def __init__(self, datamodule: "RolloutDataModule") -> None:
        self.datamodule = datamodule

    def __len__(self) -> int:
        return self.datamodule.share.local.micro_batches

    def __iter__(self):
        return self.datamodule._stream_iteration()


class _EvalStream(IterableDataset):
    """One evaluation's metrics when the iteration just trained is due for one; nothing otherwise."""

    def __init__(self, datamodule: "RolloutDataModule") -> None:
        self.datamodule = datamodule

    def __iter__(self):
        metrics = self.datamodule._evaluate()
        if metrics:
            yield metrics


class RolloutDataModule(LightningDataModule):
    """Streams each iteration's micro-batches from ``pool``, strictly on-policy.

    Args:
        data: the training prompts, a ``lit_parl.prompts.PromptSource`` (a dataset file, or a task).
        rewards: the reward functions (``lit_parl.rewards.Reward`` or plain functions: the README's "Rewards").
        pool: a ``lit_parl.rollout.RolloutPool``; started in ``setup`` if not started, closed at the end.
        tokenizer: encodes prompts and answers; its end and padding tokens are the pool's.
        shape: the iteration's shape (the module gets the same object).
        objective: reward shaping and advantages for each arriving group, and ``dynamic_sampling``.
        initial_model: the policy, or the path of a saved Hugging Face directory of it: what the pool's
            engines are built from (a model is saved to a temporary directory at start).
        sampling: sampling parameters (``SamplingParams`` or a dict of its fields).
        packing: the micro-batch layout (``Packing`` or a dict of its fields).
        mode: ``async`` (train while the pool generates) or ``sync`` (generate all, then train).
        seed: the run's seed (per-sample seeds derive from it).
        gate_timeout_s: how long an iteration waits for its weights before failing.
        max_sampling_rounds: dynamic sampling's rounds of refill prompts.
        prefetch: receive and collate micro-batches in a thread; ``None``: on with an accelerator.
        trainer_threads: torch threads of the trainer's process; ``None``: the cores the pool leaves.
        score_workers: threads of their own that score groups (for slow rewards, e.g. verifiers); 0 scores
            each group where the batcher runs: in the prefetch thread when it is on, else between steps (the
            first micro-batch's groups in the thread that starts the iteration).
        prompt_format: raw text or the chat template, and the prompt length policy (``PromptFormat`` or its fields).
        scoring: each reward call's timeout and error policy (``ScoringPolicy`` or its fields).
        evaluation: when and how much to evaluate on held-out prompts (``EvalSettings`` or its fields; they
            come from ``eval_data``, else from ``data.evaluation()``).
        eval_data: the held-out prompts (``None``: ``data.evaluation()``).
        correct_reward: a sample counts as correct (accuracy, mean@k, pass@k) when its total reward reaches this.
        logprob_tolerance: the runtime on-policy check: the largest mean |rollout - θ_k| log-prob per token a
            group may show before the run stops (the pool did not use the weights it reported);
            ``"auto"``: the pool's own (``RolloutPool.logprob_tolerance``), at least the bfloat16 bound when
            the trainer runs in lower precision or on an accelerator; ``None``: no check.
    """

    def __init__(
        self,
        data: PromptSource,
        rewards,
        pool: RolloutPool,
        tokenizer: PreTrainedTokenizerBase,
        shape: IterationShape,
        objective: Advantages,
        initial_model: PreTrainedModel | str,
        sampling: SamplingParams | dict | None = None,
        packing: Packing | dict | None = None,
        mode: str = "async",
        seed: int = 0,
        gate_timeout_s: float = 300.0,
        max_sampling_rounds: int = 8,
        prefetch: bool | None = None,
        trainer_threads: int | None = None,
        score_workers: int = 0,
        logprob_tolerance: float | str | None = "auto",
        prompt_format: PromptFormat | dict | None = None,
        scoring: ScoringPolicy | dict | None = None,
        evaluation: EvalSettings | dict | None = None,
        eval_data: PromptSource | None = None,
        correct_reward: float = 1.0,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"RolloutDataModule(mode={mode!r}); choose one of {MODES}")
        if not isinstance(pool, RolloutPool):
            raise TypeError(f"RolloutDataModule(pool={type(pool).__name__}): a pool subclasses lit_parl.rollout.RolloutPool")
        self.data, self.pool, self.tokenizer, self.shape, self.mode = data, pool, tokenizer, shape, mode
        self.objective = objective
        self.sampling = _as(SamplingParams, sampling)
        if self.sampling.greedy:
            raise ValueError("sampling.temperature=0 (greedy) cannot train: GRPO needs a distribution to sample and differentiate; greedy is for evaluation")
        self.packing = _as(Packing, packing)
        self.prompt_format = _as(PromptFormat, prompt_format)
        self.correct_reward = correct_reward
        self.max_sampling_rounds, self.prefetch, self.trainer_threads = max_sampling_rounds, prefetch, trainer_threads
        if not (logprob_tolerance is None or logprob_tolerance == "auto" or (isinstance(logprob_tolerance, (int, float)) and logprob_tolerance > 0)):
            raise ValueError(f"RolloutDataModule(logprob_tolerance={logprob_tolerance!r}): give a number > 0, 'auto' (the pool's) or None (no check)")
        self.logprob_tolerance = logprob_tolerance
        config = initial_model.config if isinstance(initial_model, PreTrainedModel) else AutoConfig.from_pretrained(initial_model)
        check_context(config, self.sampling.max_new_tokens)  # limits known now fail now, before any engine starts
        token_limit = self.prompt_format.token_limit(context_length(config), self.sampling.max_new_tokens)
        self.schedule = PromptSchedule(data, tokenizer, shape.group_size, seed, self.prompt_format, token_limit)
        self.gate = VersionGate(gate_timeout_s)
        self.scorer = GroupScorer(rewards, tokenizer, score_workers, _as(ScoringPolicy, scoring))
        self.evaluation = _as(EvalSettings, evaluation)
        self.evaluator: Evaluator | None = None
        if self.evaluation.enabled:
            held_out = eval_data if eval_data is not None else getattr(data, "evaluation", lambda: None)()
            if held_out is None:
                raise ValueError(
                    f"evaluation.every_n_iterations={self.evaluation.every_n_iterations} but there are no held-out prompts: "
                    "give eval_data, or a data source with an eval split (e.g. DatasetPrompts(eval_split=... or eval_rows=...))"
                )
            eval_schedule = PromptSchedule(held_out, tokenizer, 1, f"{seed}/eval", self.prompt_format, token_limit)
            self.evaluator = Evaluator(self.evaluation, eval_schedule, self.scorer, correct_reward, shape.prompts * shape.group_size)
            self.val_dataloader = self._eval_dataloader  # Lightning runs its validation loop only when this exists
        self.share = RankShare(shape)  # this rank's part of each iteration; set for the strategy's ranks in setup
        self._data_group = None  # a process group of the data path's own, under W ranks with dynamic sampling
        self.iterations_done = 0
        self.resume = ResumePoint()  # where a checkpoint left the current iteration
        # Lightning warns that a mid-epoch resume of a dataloader without state_dict is unreliable; this one resumes
        # exactly (the stream leaves out what the checkpoint trained and checks Lightning's position against it)
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch ended")
        self._check_resume = False  # the first iteration after a restore checks Lightning's position against it
        self.history: deque[IterationStats] = deque(maxlen=HISTORY_KEPT)  # the last few: a long run holds the same
        self._use_prefetch = bool(prefetch)
        self._started: _Started | None = None  # the opened iteration, before its stream takes it
        self._starting = threading.Lock()
        self._model_dir = InitialModelDir(initial_model, tokenizer)  # what the pool's engines start from
        pool.check_capacity(shape, self.sampling)

    # -- Lightning hooks -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        on_cpu = self.trainer is None or isinstance(self.trainer.accelerator, CPUAccelerator)
        self._use_prefetch = (not on_cpu) if self.prefetch is None else self.prefetch
        if self.trainer is not None and self.trainer.world_size > 1:
            self._setup_ranks(self.trainer.world_size, self.trainer.global_rank)
        colocated = self.mode == "sync"
        if self.trainer_threads is not None:
            torch.set_num_threads(self.trainer_threads)
        elif on_cpu and not colocated:  # the pool's workers run beside the trainer on the same cores
            torch.set_num_threads(max(1, torch.get_num_threads() - self.pool.reserved_cpus(colocated)))
        if self.schedule.dropped_rows and self.trainer is not None:  # counted once: the data is prepared once
            for logger in self.trainer.loggers:
                logger.log_metrics({"data/dropped_prompts": float(len(self.schedule.dropped_rows))}, step=0)
        if not self.pool.health().started:
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            self.pool.start(PoolSpec(self._model_dir.path(), eos, pad, colocated))

    def _setup_ranks(self, world: int, rank: int) -> None:
        """Each rank trains its ``RankShare`` of every iteration, from a pool of its own (docs/design.md, "Ranks")."""
        self.share = RankShare(self.shape, world, rank)
        if self.pool.shared_across_ranks:
            # refused: every rank would push its own weights to the same servers; one rank pushing while the
            # others wait for the confirmed version is issue 15's work
            raise ValueError(
                f"{type(self.pool).__name__} is one pool for all ranks, which a run of {world} ranks cannot share: "
                "use an embedded pool (pool=hf or pool=vllm: each rank starts its own) or train on one device"
            )
        if getattr(self.objective, "dynamic_sampling", False):
            # refill rounds are numbered over every rank's open slots: the ranks exchange them on a group of the
            # data path's own, from the prefetch thread, so a rank that waits for the others' round never
            # blocks its training step's gradient reduction (which the others may be waiting on)
            self._data_group = torch.distributed.new_group(backend="gloo")
            self._use_prefetch = True

    def _open_slots_everywhere(self, mine: list[int]) -> list[int]:
        if self._data_group is None:
            return sorted(mine)
        gathered: list[list[int] | None] = [None] * self.share.world
        torch.distributed.all_gather_object(gathered, mine, group=self._data_group)
        return sorted(slot for slots in gathered for slot in slots)

    def teardown(self, stage: str) -> None:
        self._release()

    def on_exception(self, exception: BaseException) -> None:
        self._release()  # a failed or interrupted fit skips teardown: the workers must not outlive it

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        # Micro-batches are built on the CPU; when training there, skip Lightning's generic walk over the
        # nested layout (measured at ~5 ms per step on the default job, about a fifth of a step).
        if isinstance(batch, MicroBatch) and batch.advantages.device == device:
            return batch
        if isinstance(batch, MicroBatch):  # the trajectories are for logs, on the CPU: keep them out of the walk
            moved = super().transfer_batch_to_device(dataclasses.replace(batch, trajectories=[]), device, dataloader_idx)
            moved.trajectories = batch.trajectories
            return moved
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_IterationStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def _eval_dataloader(self) -> DataLoader:
        return DataLoader(_EvalStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def state_dict(self) -> dict:
        return {**self.schedule.state_dict(), **self.gate.state_dict(), "iterations_done": self.iterations_done,
                **ResumePoint.saved(self.trainer, self.share, self.iterations_done)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.schedule.load_state_dict(state_dict)
        self.gate.load_state_dict(state_dict)
        self.iterations_done = state_dict["iterations_done"]
        self.resume.load(state_dict, self.share)
        self._check_resume = True

    @property
    def restored(self) -> bool:
        """Loaded from a checkpoint: the first iteration's weights are pushed when the fit starts."""
        return self.resume.restored

    @property
    def resume_version(self) -> int | None:
        """The version of the iteration a checkpoint was written inside of, which the restored fit finishes from θ_k
        (the module's ``old``); ``None`` when it was written between iterations."""
        return self.resume.version

    # -- the version gate ------------------------------------------------------------------------------
    def open_iteration(self, version: int) -> None:
        """Called once the pool confirmed ``version``: the iteration of ``version`` starts now, in a thread, up
        to its first micro-batch (its requests go out at once), whether or not its epoch has begun yet."""
        with self._starting:  # a stream already waiting at the gate takes this start, not one of its own
            self.gate.open(version, confirmed=self.pool.version)
            self._discard_started()  # an earlier opening whose iteration never ran (none in a fit that runs on)
            self._started = self._start_iteration(version)

    # -- one iteration ---------------------------------------------------------------------------------
    def batcher(self) -> IterationBatcher:
        correct = self.correct_reward
        acceptor = GroupAcceptor(self.objective, self.shape.group_size, self.sampling.max_new_tokens, lambda reward: reward >= correct)
        return IterationBatcher(
            self.share, self.schedule, self.pool, self.scorer, acceptor, self.sampling, self.packing, self.tokenizer.pad_token_id,
            materialize=self.mode == "sync", dynamic_sampling=bool(getattr(self.objective, "dynamic_sampling", False)),
            max_sampling_rounds=self.max_sampling_rounds,
            logprob_tolerance=self.resolved_logprob_tolerance(), open_slots_everywhere=self._open_slots_everywhere,
        )

    def resolved_logprob_tolerance(self) -> float | None:
        """The on-policy check's bound: the configured one, or the pool's, widened for a trainer in lower precision or on an accelerator."""
        if self.logprob_tolerance != "auto":
            return self.logprob_tolerance
        tolerance = self.pool.logprob_tolerance()
        if tolerance is None or self.trainer is None:
            return tolerance
        low_precision = str(self.trainer.precision) not in ("32-true", "32", "64-true", "64")
        # the float32 bounds were measured against a float32 trainer on the CPU; an accelerator's float32
        # kernels (TF32 matmuls, other reductions) were not: there the bf16 bound applies unless one is set
        accelerator = not isinstance(self.trainer.accelerator, CPUAccelerator)
        return max(tolerance, BF16_LOGPROB_TOLERANCE) if low_precision or accelerator else tolerance

    def _start_iteration(self, version: int) -> _Started:
        """The iteration of ``version``, started in a thread: to its first micro-batch, or to its end with prefetch."""
        if self.pool.version != version:
            raise OffPolicyError(f"the gate opened version {version} but the pool holds version {self.pool.version}")
        stats = IterationStats(version=version, requested_at=time.monotonic())
        batches = self.batcher().micro_batches(version, stats)
        return _Started(version, stats, HeadStart(batches, f"lit_parl-iteration-{version}", to_the_end=self._use_prefetch))

    def _discard_started(self) -> None:
        if self._started is not None:
            self._started.batches.close()
            self._started = None

    def _stream_iteration(self):
        """Waits for the gate, then hands out the iteration's micro-batches (started when the gate opened).

        Lightning knows the stream's length and never resumes it after the last micro-batch, so the
        iteration is booked just before that one leaves; by then the batcher is done with the pool.
        """
        version = self.gate.wait()
        with self._starting:
            started, self._started = self._started, None
        if started is None or started.version != version:  # the gate was opened past open_iteration
            if started is not None:
                started.batches.close()
            started = self._start_iteration(version)
        stats, batches = started.stats, started.batches
        total, count = self.share.local.micro_batches, 0
        # resumed inside an iteration: the pool generates it again from θ_k with the same seeds (the same
        # samples), and the micro-batches trained before the checkpoint are left out
        if self._check_resume and self.trainer is not None:
            self.resume.check_lightning(self.trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._check_resume = False
        skip = self.resume.take_skip()
        try:
            for batch in batches:
                count += 1
                if count == total:
                    self._finish_iteration(stats)
                if count <= skip:
                    continue
                yield batch
                if count == total:
                    return
        finally:
            batches.close()  # also stops the prefetch thread when the fit fails mid-iteration
        raise RuntimeError(f"iteration {self.iterations_done} produced {count} of its {total} micro-batches")

    def _evaluate(self) -> dict[str, float]:
        """The held-out metrics when the iteration just trained is due (Lightning validates after each epoch)."""
        trainer = self.trainer
        if self.evaluator is None or trainer is None or trainer.sanity_checking or not self.history:
            return {}  # before the first iteration the pool holds no policy yet
        iteration = trainer.current_epoch
        if self.iterations_done != iteration + 1:
            return {}  # Lightning validates mid-epoch when a fit is stopped (max_time): this iteration is unfinished
        last = trainer.max_epochs - 1 if trainer.max_epochs is not None and trainer.max_epochs > 0 else None
        if trainer.should_stop:  # stopped early (max_time, max_steps, a callback): this is the last iteration
            last = iteration
        if not self.evaluation.due(iteration, last):
            return {}
        version = self.history[-1].version
        if self.pool.version != version:  # the weights of the iteration just trained, synced at its start
            raise OffPolicyError(f"evaluation after iteration {iteration} expects the pool to hold version {version}, it holds {self.pool.version}")
        if self.share.world == 1:
            return self.evaluator.run(self.pool, version, self.sampling)
        # under W ranks rank 0 evaluates, through its own pool (it holds the same θ_k as every rank's), and every
        # rank logs its metrics: each rank then runs the same validation step, and its collectives, alike
        metrics = [self.evaluator.run(self.pool, version, self.sampling) if trainer.global_rank == 0 else None]
        torch.distributed.broadcast_object_list(metrics, src=0)
        return metrics[0]

    def _finish_iteration(self, stats: IterationStats) -> None:
        stats.completed_at = time.monotonic()
        self.history.append(stats)
        self.schedule.advance(stats.prompts_drawn)
        self.iterations_done += 1
        self.gate.close()

    def _release(self) -> None:
        self.pool.close()  # first: a started iteration's thread waiting on the pool ends with it
        if self._started is not None:  # opened at the end of an epoch after which the fit stopped: it never runs
            thread = self._started.batches
            self._discard_started()
            thread.join(timeout=10.0)  # it ends at its next exchange with the closed pool
            self.gate.withdraw()
        self.scorer.close()
        self._model_dir.remove()
