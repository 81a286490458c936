"""Multi-turn, tool-using episodes: the environment API, the limits, and the driver over any rollout pool."""

from lit_parl.episodes.environment import Environment, Step, environment_reward
from lit_parl.episodes.episode_runner import EpisodeError, EpisodeRunner
from lit_parl.episodes.episode_settings import EpisodeSettings
from lit_parl.episodes.observation_tokens import ObservationTokens, TemplateNotAppendOnly

__all__ = [
    "Environment",
    "EpisodeError",
    "EpisodeRunner",
    "EpisodeSettings",
    "ObservationTokens",
    "Step",
    "TemplateNotAppendOnly",
    "environment_reward",
]
