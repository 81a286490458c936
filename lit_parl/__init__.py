"""lit_parl: periodic-asynchronous, on-policy GRPO as PyTorch Lightning components."""

import os

# Idle OpenMP threads must sleep, not spin: the trainer and the rollout workers are separate processes on
# the same cores, and a process waiting on the other with spinning threads takes the cores it waits for
# (measured: sync mode at 14 instead of ~1,000 completions/s). Read when torch loads, so set it before
# torch is imported; the spawned workers inherit it. An explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import logging  # noqa: E402

# DeepSpeed, where installed, is imported with transformers (through accelerate) and announces on a machine
# without a GPU that it uses its CPU accelerator: a notice printed into every script and worker, for nothing
# the user can act on. Only that message is dropped.
logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())

import importlib

# Imported on first use, so that ``import lit_parl.callbacks`` (usable in any Lightning project) does not
# load the data path, the module and transformers' model classes.
_EXPORTS = {
    "DatasetPrompts": "lit_parl.prompt_files",
    "EvalSettings": "lit_parl.data.evaluation",
    "GRPOModule": "lit_parl.module",
    "GRPOObjective": "lit_parl.objectives",
    "Group": "lit_parl.trajectory",
    "GroupCompletions": "lit_parl.trajectory",
    "GroupRequest": "lit_parl.trajectory",
    "IterationShape": "lit_parl.data.shape",
    "MicroBatch": "lit_parl.trajectory",
    "OffPolicyError": "lit_parl.data.gate",
    "Packing": "lit_parl.trajectory",
    "PromptFormat": "lit_parl.chat",
    "PromptRow": "lit_parl.prompts",
    "Reward": "lit_parl.rewards.reward",
    "RolloutDataModule": "lit_parl.datamodule",
    "SamplingParams": "lit_parl.trajectory",
    "ScoringPolicy": "lit_parl.rewards.policy",
    "Trajectory": "lit_parl.trajectory",
    "WarmupSchedule": "lit_parl.lr_schedule",
    "pretrained": "lit_parl.model",
    "tiny_qwen2": "lit_parl.model",
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
