"""RolloutDataModule: one Lightning epoch = one RL iteration, streamed from a rollout pool.

``train_dataloader()`` yields the current iteration's micro-batches as the pool's groups finish
(``mode="async"``), or only after the whole iteration has been generated (``mode="sync"``, the
colocated baseline). The datamodule wires the data path's parts (``PromptSchedule``, ``VersionGate``,
``IterationLauncher``, ``IterationStart``, ``GroupScorer``, ``GroupAcceptor``, ``IterationBatcher``, ``Evaluator``,
``RankShare``, ``ResumePoint``: one job each, docs/design.md) and owns the pool's lifecycle (started in
``setup``, closed in ``teardown`` or when the fit fails).

In use: the README's "Components without the CLI" script (run as a script by ``tests/system/test_readme.py``).
"""

from __future__ import annotations

import time
import warnings
from collections import deque

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.accelerators import CPUAccelerator
from torch.utils.data import DataLoader
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.data.argument_checks import check_arguments
from lit_parl.data.core_share import CoreShare, cores_to_lend, worth_lending
from lit_parl.data.evaluator import EvalSettings, Evaluator
from lit_parl.data.group_acceptor import Advantages
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.initial_model_dir import InitialModelDir
from lit_parl.data.iteration_launcher import IterationLauncher
from lit_parl.data.iteration_shape import IterationShape
from lit_parl.data.iteration_start import IterationStart
from lit_parl.data.iteration_stats import IterationStats
from lit_parl.data.iteration_streams import EvalStream, IterationStream
from lit_parl.data.micro_batch import MicroBatch, Packing
from lit_parl.data.pool_start import start_pool
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.data.rank_share import RankShare, SlotExchange
from lit_parl.data.resume_point import ResumePoint
from lit_parl.data.version_gate import VersionGate
from lit_parl.episodes.episode_runner import EpisodeRunner
from lit_parl.episodes.episode_settings import EpisodeSettings
from lit_parl.models.limits import context_length
from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.prompts.prompt_row import PromptSource
from lit_parl.rewards.scoring_policy import ScoringPolicy
from lit_parl.rollout.records import SamplingParams
from lit_parl.rollout.rollout_pool import PoolSpec, RolloutPool
from lit_parl.settings import as_settings

HISTORY_KEPT = 64  # iterations whose IterationStats stay in `history` (callbacks read the last one)


class RolloutDataModule(LightningDataModule):
    """Streams each iteration's micro-batches from ``pool``, strictly on-policy.

    Args:
        data: the training prompts, a ``lit_parl.prompts.prompt_row.PromptSource`` (a dataset file, or a task).
        rewards: the reward functions (``lit_parl.rewards.Reward`` or plain functions: docs/data-and-rewards.md).
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
        lend_cores: once the pool has generated an iteration, its workers' cores train the iteration's tail
            (``CoreShare``; with the prefetch thread unless ``prefetch=False``); ``None``: on where it pays,
            async on the CPU with a policy of ``LEND_FROM_PARAMETERS`` or more (``worth_lending``).
        score_workers: threads of their own that score groups (for slow rewards, e.g. verifiers); 0 scores
            each group where the batcher runs: in the prefetch thread when it is on, else between steps (the
            first micro-batch's groups in the thread that starts the iteration); ``None``: what the rewards ask
            for (``Reward.concurrent_groups``: a reward model's or a judge's, else 0).
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
        episodes: multi-turn episodes (``lit_parl.episodes.EpisodeSettings`` or its fields): each sample plays
            its environment turn by turn (docs/episodes.md); ``None``: one completion per sample.
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
        lend_cores: bool | None = None,
        score_workers: int | None = None,
        logprob_tolerance: float | str | None = "auto",
        prompt_format: PromptFormat | dict | None = None,
        scoring: ScoringPolicy | dict | None = None,
        evaluation: EvalSettings | dict | None = None,
        eval_data: PromptSource | None = None,
        correct_reward: float = 1.0,
        episodes: EpisodeSettings | dict | None = None,
    ) -> None:
        super().__init__()
        self.sampling = as_settings(SamplingParams, sampling)
        episode_settings = as_settings(EpisodeSettings, episodes) if episodes is not None else None
        given = isinstance(initial_model, PreTrainedModel)
        config = initial_model.config if given else AutoConfig.from_pretrained(initial_model)
        # limits known now fail now, before any engine starts
        check_arguments(mode, pool, self.sampling, logprob_tolerance, config, shape, episode_settings)
        self.data, self.pool, self.tokenizer, self.shape, self.mode = data, pool, tokenizer, shape, mode
        self.objective = objective
        self.packing = as_settings(Packing, packing)
        self.prompt_format = as_settings(PromptFormat, prompt_format)
        self.correct_reward = correct_reward
        self.max_sampling_rounds, self.prefetch, self.trainer_threads = max_sampling_rounds, prefetch, trainer_threads
        self.lend_cores, self.cores = lend_cores, None  # the CoreShare is built in setup, once threads are known
        self.logprob_tolerance = logprob_tolerance
        # the longest completion: one sample's, or an episode's (the model's turns and the environment's tokens)
        self.completion_limit = (
            episode_settings.max_episode_tokens if episode_settings else self.sampling.max_new_tokens
        )
        token_limit = self.prompt_format.token_limit(context_length(config), self.completion_limit)
        self.schedule = PromptSchedule(data, tokenizer, shape.group_size, seed, self.prompt_format, token_limit)
        self.gate = VersionGate(gate_timeout_s)
        policy = as_settings(ScoringPolicy, scoring)
        self.scorer = GroupScorer(rewards, tokenizer, score_workers, policy)
        self.episodes = (
            EpisodeRunner(episode_settings, tokenizer, policy, self.prompt_format) if episode_settings else None
        )
        self.evaluation = as_settings(EvalSettings, evaluation)
        if eval_data is None and self.evaluation.enabled:
            eval_data = getattr(data, "evaluation", lambda: None)()
        self.evaluator = Evaluator.for_run(
            self.evaluation,
            eval_data,
            lambda rows: PromptSchedule(rows, tokenizer, 1, f"{seed}/eval", self.prompt_format, token_limit),
            self.scorer,
            correct_reward,
            shape.prompts * shape.group_size,
            self.episodes,
        )
        if self.evaluator is not None:
            self.val_dataloader = self._eval_dataloader  # Lightning runs its validation loop only when this exists
        self.share = RankShare(shape)  # this rank's part of each iteration; set for the strategy's ranks in setup
        self.slots = SlotExchange()  # dynamic sampling's open slots of every rank (set up under W ranks)
        self.iterations_done = 0
        self.resume = ResumePoint()  # where a checkpoint left the current iteration
        # Lightning warns that a mid-epoch resume is unreliable: this one is exact (the stream skips what was trained)
        warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before the epoch")
        self.history: deque[IterationStats] = deque(maxlen=HISTORY_KEPT)  # the last few: a long run holds the same
        self.prefetching = bool(prefetch)
        self.launcher = IterationLauncher(self)  # builds and starts one iteration from the parts above
        self.start = IterationStart(self.gate, self.launcher)  # the opened iteration, before its stream
        self._model_dir = InitialModelDir(initial_model, tokenizer)  # what the pool's engines start from

    # -- Lightning hooks -------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if stage != "fit":
            return
        on_cpu = self.trainer is None or isinstance(self.trainer.accelerator, CPUAccelerator)
        self.prefetching = (not on_cpu) if self.prefetch is None else self.prefetch
        if self.trainer is not None and self.trainer.world_size > 1:
            self._setup_ranks(self.trainer.world_size, self.trainer.global_rank)
        colocated = self.mode == "sync"
        if self.trainer_threads is not None:
            torch.set_num_threads(self.trainer_threads)
        elif on_cpu and not colocated:  # the pool's workers run beside the trainer on the same cores
            torch.set_num_threads(max(1, torch.get_num_threads() - self.pool.reserved_cpus(colocated)))
        lent = 0 if colocated else cores_to_lend(self.pool.reserved_cpus(colocated), torch.get_num_threads())
        module = getattr(self.trainer, "lightning_module", None)
        policy = getattr(module, "policy", module)  # the model trained; the module may hold frozen copies too
        if lent and (worth_lending(policy, on_cpu) if self.lend_cores is None else self.lend_cores):
            self.cores = CoreShare(torch.get_num_threads(), lent)
            # the thread receives each group as it arrives, so the pool's last one is seen when it comes
            self.prefetching = True if self.prefetch is None else self.prefetch
        if self.schedule.dropped_rows and self.trainer is not None:  # counted once: the data is prepared once
            for logger in self.trainer.loggers:
                logger.log_metrics({"data/dropped_prompts": float(len(self.schedule.dropped_rows))}, step=0)
        if not self.pool.health().started:
            eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
            start_pool(self.pool, PoolSpec(self._model_dir.path(), eos, pad, colocated), self.trainer, self.share)

    def _setup_ranks(self, world: int, rank: int) -> None:
        """Each rank trains its ``RankShare`` of every iteration, from a pool of its own or one shared by every
        rank (docs/design.md, "Ranks")."""
        self.share = RankShare(self.shape, world, rank)
        if getattr(self.objective, "dynamic_sampling", False):
            self.slots = SlotExchange(world)
            self.prefetching = True  # the exchange runs in the prefetch thread, apart from the gradient's

    def teardown(self, stage: str) -> None:
        self._release()

    def on_exception(self, exception: BaseException) -> None:
        self._release()  # a failed or interrupted fit skips teardown: the workers must not outlive it

    def transfer_batch_to_device(self, batch, device: torch.device, dataloader_idx: int):
        if not isinstance(batch, MicroBatch):
            return super().transfer_batch_to_device(batch, device, dataloader_idx)
        walk = super().transfer_batch_to_device  # Lightning's walk over the batch's tensors
        return batch.to_device(device, lambda tensors: walk(tensors, device, dataloader_idx))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(IterationStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def _eval_dataloader(self) -> DataLoader:
        return DataLoader(EvalStream(self), batch_size=None, num_workers=0, collate_fn=lambda batch: batch)

    def state_dict(self) -> dict:
        done = self.iterations_done
        resume = ResumePoint.saved(self.trainer, self.share, done)
        state = {**self.schedule.state_dict(), **self.gate.state_dict(), "iterations_done": done, **resume}
        return {**state, "rewards": self.scorer.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.schedule.load_state_dict(state_dict)
        self.gate.load_state_dict(state_dict)
        self.iterations_done = state_dict["iterations_done"]
        self.scorer.load_state_dict(state_dict.get("rewards", {}))  # absent in checkpoints of older versions
        self.resume.load(state_dict, self.share)

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
        self.start.open(version, confirmed=self.pool.version)

    # -- one iteration ---------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """The held-out metrics when the iteration just trained is due (Lightning validates after each epoch)."""
        trainer = self.trainer
        if self.evaluator is None or trainer is None or trainer.sanity_checking or not self.history:
            return {}  # before the first iteration the pool holds no policy yet
        version = self.history[-1].version
        return self.evaluator.after_iteration(trainer, self.iterations_done, version, self.pool, self.sampling)

    def finish_iteration(self, stats: IterationStats) -> None:
        """Book the iteration (its last micro-batch is about to leave): its stats, the schedule's cursor, the gate."""
        stats.completed_at = time.monotonic()
        self.history.append(stats)
        self.schedule.advance(stats.prompts_drawn)
        self.iterations_done += 1
        self.gate.close()

    def _release(self) -> None:
        if self.cores is not None:
            self.cores.release()
        self.pool.close()  # first: a started iteration's thread waiting on the pool ends with it
        self.start.discard()  # opened at the end of an epoch after which the fit stopped: it never runs
        self.scorer.close()
        self._model_dir.remove()
