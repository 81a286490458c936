"""An episode's failure reaches the scores as the policy says, and an episode budget the context cannot hold is
refused before anything starts."""

from __future__ import annotations

import pytest

from helpers.episode_envs import TurnTaker
from lit_parl import GRPOObjective, IterationShape, RolloutDataModule, tiny_qwen2
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.episodes import EpisodeSettings, environment_reward
from lit_parl.rewards import Reward, ScoringPolicy
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.records import EpisodeTrace, GroupCompletions
from lit_parl.tasks import CopyTask


def test_a_failed_episode_scores_the_policys_value_and_is_counted_and_the_others_their_rewards(tok):
    drawn = PromptSchedule(CopyTask(seed=0), tok, group_size=2).draw([0], version=0)[0]
    traces = [
        EpisodeTrace([1, 0, 1], [("assistant", "1"), ("user", "+"), ("assistant", "2")], env_reward=0.5),
        EpisodeTrace([1], [("assistant", "1")], env_reward=0.25, failed="raised ConnectionError: down"),
    ]
    completions = GroupCompletions(0, 0, [0, 1], [[4, 41, 5], [4]], [[-1.0, 0.0, -1.0], [-1.0]], ["stop"] * 2, traces)

    def length(turns) -> float:  # a second reward, that reads the episode's turns
        return 0.1 * len(turns)

    scorer = GroupScorer(
        [Reward(environment_reward), Reward(length)], tok, policy=ScoringPolicy(on_error="score", error_score=-1.0)
    )
    group = scorer.score(drawn, completions)
    assert group.rewards[0] == pytest.approx(0.5 + 0.3) and group.rewards[1] == -1.0
    assert group.reward_failures == {"environment": [1]}
    assert group.loss_masks == [[1, 0, 1], [1]]


def test_an_episode_budget_the_models_context_cannot_hold_is_refused_at_construction():
    policy, tokenizer = tiny_qwen2(max_position_embeddings=64)
    shape, objective = IterationShape(4, 2, 8), GRPOObjective()
    with pytest.raises(ValueError, match=r"episodes.max_episode_tokens=64 does not fit this model's context of 64"):
        RolloutDataModule(
            CopyTask(),
            [environment_reward],
            HFRolloutPool(),
            tokenizer,
            shape,
            objective,
            initial_model=policy,
            episodes=EpisodeSettings(TurnTaker, max_episode_tokens=64),
        )
