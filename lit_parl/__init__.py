"""lit_parl: periodic-asynchronous, on-policy GRPO as PyTorch Lightning components."""

from lit_parl.datamodule import OffPolicyError, RolloutDataModule
from lit_parl.model import pretrained, tiny_qwen2
from lit_parl.module import GRPOModule
from lit_parl.objectives import GRPOObjective
from lit_parl.trajectory import Group, GroupRequest, MicroBatch, SamplingParams, Trajectory

__all__ = [
    "GRPOModule",
    "GRPOObjective",
    "Group",
    "GroupRequest",
    "MicroBatch",
    "OffPolicyError",
    "RolloutDataModule",
    "SamplingParams",
    "Trajectory",
    "pretrained",
    "tiny_qwen2",
]
