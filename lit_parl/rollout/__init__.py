from lit_parl.rollout.base import RewardFunction, RolloutPool
from lit_parl.rollout.hf import HFRolloutPool

__all__ = ["HFRolloutPool", "RewardFunction", "RolloutPool"]
