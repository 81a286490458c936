"""Episodes through the real hf pool (spawned transformers workers): the runtime on-policy check passes on
multi-turn episodes and catches a context re-tokenized from text, and a worker killed mid-episode loses
nothing (every episode trained once, the same tokens as the undisturbed run)."""

from __future__ import annotations

import functools
import os
import time

import pytest

from helpers.components import BatchRecorder, fit, make_components
from helpers.episode_envs import TurnTaker
from helpers.pools import EnginePool, Retokenizing
from lit_parl import OffPolicyError
from lit_parl.episodes import EpisodeSettings, environment_reward
from lit_parl.rewards import Reward
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.hf_pool import HFEngine
from lit_parl.rollout.records import SamplingParams

# long turns, so that about half of them end with the end token (a random-init model draws it 1 in 53)
SAMPLING = SamplingParams(max_new_tokens=40)
EPISODES = EpisodeSettings(TurnTaker, max_turns=3, max_episode_tokens=120)
POOL = dict(threads_per_worker=1, prompts_per_request=2, colocated_threads=1)


def _train(pool, iterations=1, callbacks=()):
    module, data = make_components(
        pool=pool,
        prompts=4,
        group_size=4,
        micro_batch_size=16,
        rewards=[Reward(environment_reward)],
        datamodule_kwargs={"episodes": EPISODES, "sampling": SAMPLING},
    )
    recorder = BatchRecorder()
    fit(module, data, iterations=iterations, callbacks=[recorder, *callbacks])
    return {
        (t.prompt_id, t.sample_index): (tuple(t.completion_tokens), tuple(t.loss_mask))
        for _, batch in recorder.batches
        for t in batch.trajectories
    }, recorder


def test_multi_turn_episodes_pass_the_on_policy_check_and_a_retokenized_context_is_caught():
    episodes, _ = _train(HFRolloutPool(num_workers=1, **POOL))
    after_end_token = [
        e
        for e, (tokens, mask) in episodes.items()
        if any(t == 1 and m and i + 1 < len(mask) and not mask[i + 1] for i, (t, m) in enumerate(zip(tokens, mask)))
    ]
    assert len(after_end_token) >= 2, "no episode went on after a turn ended with the end token"
    with pytest.raises(OffPolicyError, match="differ from θ_k's"):
        _train(Retokenizing(HFRolloutPool(num_workers=1, **POOL)))


class CrashInSecondTurn:
    """An hf engine that exits in the middle of the first continuation batch it serves, once (a marker file)."""

    def __init__(self, marker: str, *hf_args) -> None:
        self.engine, self.marker = HFEngine(*hf_args), marker

    def load(self, shared, version):
        self.engine.load(shared, version)

    def sample(self, requests, sampling, version):
        for group in self.engine.sample(requests, sampling, version):
            yield group
            if requests[0].group_size == 1 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                time.sleep(0.5)  # the group leaves first: delivered, then its piece is sent again
                os._exit(3)


@pytest.mark.slow  # make test-slow: fault injection, half a minute
def test_a_worker_killed_mid_episode_loses_nothing(tmp_path):
    undisturbed, _ = _train(HFRolloutPool(num_workers=2, **POOL), iterations=2)
    marker = tmp_path / "crashed"
    pool = EnginePool(functools.partial(CrashInSecondTurn, str(marker)), num_workers=2, **POOL)
    disturbed, recorder = _train(pool, iterations=2)
    assert marker.exists(), "no worker crashed: the test proved nothing"
    trained = recorder.samples()
    assert len(trained) == len(set(trained)) == 2 * 16
    assert disturbed == undisturbed
