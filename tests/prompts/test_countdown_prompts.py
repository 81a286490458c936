"""``+experiment=countdown`` on the tiny model: its prompts and tags reach the model as written, and scoring
the model's text prints nothing."""

from __future__ import annotations

import warnings

from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from lit_parl.tasks.countdown import countdown_reward


def compose_config(*overrides: str):
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_countdown_experiment_gives_the_tiny_model_its_prompts_tags_and_stop_as_written():
    """No ``<unk>`` in a prompt, and the tags the format reward and the ``</answer>`` stop read survive the round
    trip through the model's tokens (the default vocabulary has no capitals, ``<``, ``>`` or ``[ ]``)."""
    cfg = compose_config("+experiment=countdown")
    _, tokenizer = instantiate(cfg.model)
    task = instantiate(cfg.data)
    for index in range(8):
        ids = tokenizer(task.row(index).prompt).input_ids
        assert tokenizer.unk_token_id not in ids, tokenizer.decode(ids)
    answer = "<think>100 - 4 is 96</think><answer>(100 - 4) / 8 * 2</answer>"
    sampled = tokenizer.decode(tokenizer(answer).input_ids)
    assert sampled == answer and all(stop in sampled for stop in cfg.sampling.stop)
    metadata = {"numbers": [2, 4, 8, 100], "target": 24}
    rewards = {name: instantiate(reward) for name, reward in cfg.reward.items()}
    assert {name: reward.fn(sampled, metadata) for name, reward in rewards.items() if name != "format"} == {
        "countdown": 1.0
    }
    assert rewards["format"].fn(sampled) == 1.0


def test_a_model_named_beside_the_countdown_experiment_replaces_its_tiny_one():
    cfg = compose_config("+experiment=countdown", "model=smollm2")
    assert cfg.model._target_ == "lit_parl.models.smollm2_instruct" and "vocabulary" not in cfg.model


def test_scoring_a_countdown_expression_that_python_warns_about_prints_no_warning():
    """``2if 3 else 4`` parses with a SyntaxWarning ("invalid decimal literal") that reached the console."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert countdown_reward("<answer>2if 3 else 4</answer>", {"numbers": [2, 3, 4], "target": 2}) == 0.0
    assert not [w for w in caught if issubclass(w.category, SyntaxWarning)], [str(w.message) for w in caught]
