"""Rewards over text: the signature (``Reward``), the scoring policy, built-in verifiers, and learned rewards
(a reward model, an LLM judge)."""

from lit_parl.rewards.judge import JudgeReward
from lit_parl.rewards.reward import REWARD_FIELDS, Reward, RewardError, as_reward
from lit_parl.rewards.reward_model import RewardModel
from lit_parl.rewards.scoring_policy import ScoringPolicy, score_group

__all__ = [
    "REWARD_FIELDS",
    "JudgeReward",
    "Reward",
    "RewardError",
    "RewardModel",
    "ScoringPolicy",
    "as_reward",
    "score_group",
]
