"""Rewards over text: the signature (``Reward``), the scoring policy, and built-in verifiers."""

from lit_parl.rewards.reward import REWARD_FIELDS, Reward, RewardError, as_reward
from lit_parl.rewards.scoring_policy import ScoringPolicy, score_group

__all__ = ["REWARD_FIELDS", "Reward", "RewardError", "ScoringPolicy", "as_reward", "score_group"]
