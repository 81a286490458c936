"""RewardModel: a sequence-classification reward model as a reward. Its batches across groups give each sample
the score it has alone; it reads the exchange through its own chat template, not the policy's; its scores repeat;
the scorer runs its groups concurrently so that they share batches; normalisation; and a failing or slow forward
follows the scoring policy."""

from __future__ import annotations

import threading

import pytest

from lit_parl import tiny_reward_model
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rewards import Reward, RewardError, RewardModel, ScoringPolicy, score_group
from lit_parl.rollout.records import GroupCompletions
from lit_parl.tasks import CopyTask

POLICY_TOKENIZER = build_char_tokenizer()
# the reward model's own template: its markers are characters of its vocabulary that no prompt of the copy task holds
RM_TEMPLATE = "{% for m in messages %}{{ '(' if m['role'] == 'user' else '!' }}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    model, tokenizer = tiny_reward_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, seed=3)
    path = tmp_path_factory.mktemp("reward_model")
    model.save_pretrained(path)
    tokenizer.chat_template = RM_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def _groups(n: int, group_size: int = 4):
    drawn = PromptSchedule(CopyTask(seed=0), POLICY_TOKENIZER, group_size=group_size).draw(list(range(n)), version=0)
    groups = []
    for i, prompt in drawn.items():
        answer = list(prompt.answer_ids)
        completions = [answer[: k + 1] + [POLICY_TOKENIZER.eos_token_id] for k in range(group_size)]
        groups.append(
            GroupCompletions(
                i, 0, list(range(group_size)), completions, [[0.0] * len(c) for c in completions], ["stop"] * group_size
            )
        )
    return drawn, groups


def test_batches_across_groups_give_each_sample_its_score_alone(rm_dir):
    drawn, groups = _groups(6)
    reward = RewardModel(rm_dir, batch_size=16, max_wait_s=0.5)
    scorer = GroupScorer([reward], POLICY_TOKENIZER)  # workers=None: the reward model's concurrent_groups
    assert scorer.workers == reward.concurrent_groups == 4
    scored = {g.prompt_id: g.rewards for g in scorer.stream(iter(groups), drawn)}
    scorer.close()
    assert max(reward.batcher.batch_sizes) > 4  # a batch held samples of more than one group

    alone = RewardModel(rm_dir, batch_size=1)
    for group in groups:
        inputs = GroupScorer([alone], POLICY_TOKENIZER, workers=0).inputs(drawn[group.prompt_id], group)
        texts = [alone.text(s["prompt"], s["conversation"]) for s in inputs]
        one_by_one = [alone.score_texts([text])[0] for text in texts]
        assert scored[group.prompt_id] == pytest.approx(one_by_one, rel=1e-5, abs=1e-6)
    assert set(alone.batcher.batch_sizes) <= {1}
    alone.close()


def test_it_reads_the_exchange_through_its_own_template_not_the_policys(rm_dir):
    reward = RewardModel(rm_dir)
    conversation = [{"role": "user", "content": "123="}, {"role": "assistant", "content": "123"}]
    assert reward.text("policy template: 123=", conversation) == "(123=!123"
    scores = score_group(
        [reward], [{"prompt": "policy template: 123=", "conversation": conversation}], ScoringPolicy(), 0
    ).totals
    assert scores == [reward.score_texts(["(123=!123"])[0]]
    # without a chat template: the prompt as the policy saw it, then the turns
    plain = RewardModel(rm_dir, chat_template=None)
    plain.chat_template = None
    assert plain.text("12=", conversation) == "12=123"
    reward.close(), plain.close()


def test_scores_repeat_and_differ_between_texts(rm_dir):
    reward = RewardModel(rm_dir)
    texts = ["(12=!12", "(12=!21", "(345=!3"]
    first = reward.score_texts(texts)
    assert reward.score_texts(texts) == first
    assert RewardModel(rm_dir).score_texts(texts) == first  # a fresh load of the same model
    assert len(set(first)) == 3
    reward.close()


def test_group_and_running_normalisation(rm_dir):
    samples = [
        {"prompt": "1=", "conversation": [{"role": "user", "content": "1="}, {"role": "assistant", "content": c}]}
        for c in ("1", "11", "2")
    ]
    group = RewardModel(rm_dir, normalize="group")
    values = score_group([group], samples, ScoringPolicy(), 0).totals
    assert sum(values) == pytest.approx(0.0, abs=1e-5) and max(values) > 0.5

    running = RewardModel(rm_dir, normalize="running")
    score_group([running], samples, ScoringPolicy(), 0)
    state = running.state_dict()
    assert state["count"] == 3
    resumed = RewardModel(rm_dir, normalize="running")
    resumed.load_state_dict(state)
    again = score_group([running], samples[:1], ScoringPolicy(), 1).totals
    assert score_group([resumed], samples[:1], ScoringPolicy(), 1).totals == again
    group.close(), running.close(), resumed.close()


def test_a_failing_or_slow_forward_follows_the_scoring_policy(rm_dir):
    samples = [{"prompt": "1=", "conversation": [{"role": "assistant", "content": "1"}]}] * 2
    broken = RewardModel(rm_dir, name="rm")
    broken.model.forward = lambda **kwargs: (_ for _ in ()).throw(RuntimeError("out of memory"))
    with pytest.raises(RewardError, match="reward 'rm' raised RuntimeError: out of memory on prompt 5"):
        score_group([broken], samples, ScoringPolicy(), 5)
    scored = score_group([broken], samples, ScoringPolicy(on_error="score", error_score=-2.0), 5)
    assert scored.totals == [-2.0, -2.0] and scored.failures == {"rm": [0, 1]}

    release = threading.Event()
    slow = RewardModel(rm_dir, name="rm", max_wait_s=0.0)
    forward = slow.model.forward

    def waits(**kwargs):
        release.wait(10)
        return forward(**kwargs)

    slow.model.forward = waits
    scored = score_group([slow], samples, ScoringPolicy(timeout_s=0.2, on_error="score"), 6)
    assert scored.failures == {"rm": [0, 1]}
    release.set()  # the cancelled group's batch finishes: its results are dropped, nothing raises in a thread
    assert score_group([slow], samples, ScoringPolicy(timeout_s=30), 7).failures == {}
    broken.close(), slow.close()


def test_a_bad_directory_or_a_model_of_several_labels_is_refused(tmp_path, rm_dir):
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        RewardModel(str(tmp_path))
    with pytest.raises(ValueError, match="normalize='batch'"):
        RewardModel(rm_dir, normalize="batch")
    model, _ = tiny_reward_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
    model.config.num_labels = 2  # what the config says is refused before any weight is read
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="the model has 2 labels"):
        RewardModel(str(tmp_path))


def test_a_plain_reward_keeps_scoring_inline():
    assert Reward(lambda completion: 1.0).concurrent_groups == 0
    assert GroupScorer([lambda completion: 1.0], POLICY_TOKENIZER).workers == 0
