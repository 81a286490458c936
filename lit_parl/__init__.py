"""lit_parl: periodic-asynchronous, on-policy GRPO as PyTorch Lightning components."""

import os

# Idle OpenMP threads must sleep, not spin: the trainer and the rollout workers are separate processes on
# the same cores, and a process waiting on the other with spinning threads takes the cores it waits for
# (measured: sync mode at 14 instead of ~1,000 completions/s). Read when torch loads, so set it before
# torch is imported; the spawned workers inherit it. An explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from lit_parl.data import IterationShape, OffPolicyError
from lit_parl.datamodule import RolloutDataModule
from lit_parl.lr_schedule import WarmupSchedule
from lit_parl.model import pretrained, tiny_qwen2
from lit_parl.module import GRPOModule
from lit_parl.objectives import GRPOObjective
from lit_parl.trajectory import Group, GroupCompletions, GroupRequest, MicroBatch, Packing, SamplingParams, Trajectory

__all__ = [
    "GRPOModule",
    "GRPOObjective",
    "Group",
    "GroupCompletions",
    "GroupRequest",
    "IterationShape",
    "MicroBatch",
    "OffPolicyError",
    "Packing",
    "RolloutDataModule",
    "SamplingParams",
    "Trajectory",
    "WarmupSchedule",
    "pretrained",
    "tiny_qwen2",
]
