"""lit_parl: periodic-asynchronous, on-policy GRPO as PyTorch Lightning components."""

import os

# Idle OpenMP threads must sleep, not spin: the trainer and the rollout workers are separate processes on
# the same cores, and a process waiting on the other with spinning threads takes the cores it waits for
# (measured: sync mode at 14 instead of ~1,000 completions/s). A thread that sleeps at once between two operations
# of one step is woken for each next one, so they spin briefly first (libgomp's GOMP_SPINCOUNT, which wins over the
# passive policy): 1000, about 10 us. A longer spin (100000, about 1 ms) was faster by up to 1.2x on a quiet machine
# for big policies, but where another process takes a core a two-thread team spins for its descheduled partner:
# sync mode then ran 6-15x slower (docs/performance.md, "OpenMP's spin"). Read when torch loads, so set before torch
# is imported; the spawned workers inherit both. The user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "1000"
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging  # noqa: E402

# DeepSpeed, where installed, is imported with transformers (through accelerate) and announces on a machine
# without a GPU that it uses its CPU accelerator: a notice printed into every script and worker, for nothing
# the user can act on. Only that message is dropped.
logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())

import importlib  # noqa: E402

# Imported on first use, so that ``import lit_parl.callbacks`` (usable in any Lightning project) does not
# load the data path, the module and transformers' model classes.
_EXPORTS = {
    "DatasetPrompts": "lit_parl.prompts.dataset_prompts",
    "EvalSettings": "lit_parl.data.evaluator",
    "GRPOModule": "lit_parl.trainer.grpo_module",
    "GRPOObjective": "lit_parl.trainer.grpo_objective",
    "Group": "lit_parl.rollout.records",
    "GroupCompletions": "lit_parl.rollout.records",
    "GroupRequest": "lit_parl.rollout.records",
    "IterationShape": "lit_parl.data.iteration_shape",
    "MicroBatch": "lit_parl.data.micro_batch",
    "OffPolicyError": "lit_parl.errors",
    "Packing": "lit_parl.data.micro_batch",
    "PromptFormat": "lit_parl.prompts.prompt_format",
    "PromptRow": "lit_parl.prompts.prompt_row",
    "JudgeReward": "lit_parl.rewards.judge",
    "Reward": "lit_parl.rewards.reward",
    "RewardModel": "lit_parl.rewards.reward_model",
    "RolloutDataModule": "lit_parl.data.rollout_datamodule",
    "SamplingParams": "lit_parl.rollout.records",
    "ScoringPolicy": "lit_parl.rewards.scoring_policy",
    "Trajectory": "lit_parl.data.micro_batch",
    "WarmupSchedule": "lit_parl.trainer.warmup_schedule",
    "pretrained": "lit_parl.models.local_files",
    "tiny_qwen2": "lit_parl.models.tiny",
    "tiny_reward_model": "lit_parl.models.tiny",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lit_parl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
