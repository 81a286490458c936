from lit_parl.rollout.base import RewardFunction, RolloutPool
from lit_parl.rollout.hf import HFRolloutPool
from lit_parl.rollout.sglang import SGLangRolloutPool

__all__ = ["HFRolloutPool", "RewardFunction", "RolloutPool", "SGLangRolloutPool"]
