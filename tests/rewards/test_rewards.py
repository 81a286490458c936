"""The reward signature and the scoring policy: what a reward receives, how its value is read, and what a
failing, hanging or non-finite reward does (stop the run naming it, or a counted score; never a silent 0)."""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
import warnings

import pytest

from lit_parl.rewards import Reward, RewardError, ScoringPolicy, score_group

SAMPLES = [
    {"completion": "4", "completion_ids": [7, 1], "answer": "4", "stopped": True},
    {"completion": "5", "completion_ids": [8], "answer": "4", "stopped": False},
]


def exact(completion: str, answer: str) -> float:
    return float(completion == answer)


def test_a_reward_gets_only_the_fields_it_names_and_is_weighted():
    seen = []

    def stopped_only(stopped):
        seen.append(stopped)
        return stopped

    scored = score_group(
        [Reward(exact, weight=2.0), Reward(stopped_only, weight=0.5)], SAMPLES, ScoringPolicy(), prompt_id=0
    )
    assert seen == [True, False]
    assert scored.totals == [2.5, 0.0]
    assert scored.components == {"exact": [1.0, 0.0], "stopped_only": [1.0, 0.0]} and scored.failures == {}


def test_a_dict_is_named_components_summed():
    def parts(completion, answer):
        return {"format": 0.5, "correct": float(completion == answer)}

    scored = score_group([Reward(parts, weight=2.0)], SAMPLES, ScoringPolicy(), prompt_id=0)
    assert scored.totals == [3.0, 1.0]
    assert scored.components == {"parts/format": [0.5, 0.5], "parts/correct": [1.0, 0.0]}


def test_batched_and_async_rewards_equal_the_plain_one():
    def batched(completion, answer):
        return [float(c == a) for c, a in zip(completion, answer)]

    async def awaited(completion, answer):
        await asyncio.sleep(0.01)
        return float(completion == answer)

    plain = score_group([Reward(exact)], SAMPLES, ScoringPolicy(), 0).totals
    assert score_group([Reward(batched, batched=True)], SAMPLES, ScoringPolicy(), 0).totals == plain == [1.0, 0.0]
    assert score_group([Reward(awaited)], SAMPLES, ScoringPolicy(), 0).totals == plain
    batched.batched = True  # the attribute form
    assert Reward(batched).batched
    with pytest.raises(TypeError, match="must return a list of 2 values"):
        score_group([Reward(lambda completion: 1.0, batched=True)], SAMPLES, ScoringPolicy(), 0)


def test_async_samples_of_a_group_run_concurrently_on_a_loop_of_their_own():
    loops = []

    async def slow(completion):
        loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0.3)
        return 1.0

    start = time.monotonic()
    assert score_group([Reward(slow)], SAMPLES * 3, ScoringPolicy(), 0).totals == [1.0] * 6
    assert time.monotonic() - start < 1.2  # six calls of 0.3 s overlapped
    assert len(set(map(id, loops))) == 1


@pytest.mark.parametrize("kind", ["sync", "async", "batched"])
def test_a_hanging_reward_times_out_under_either_policy(kind):
    release = threading.Event()

    def hangs(completion):
        release.wait(5)
        return 1.0

    async def hangs_async(completion):
        await asyncio.sleep(5)
        return 1.0

    def hangs_batched(completion):
        release.wait(5)
        return [1.0] * len(completion)

    fn = {
        "sync": Reward(hangs),
        "async": Reward(hangs_async, name="hangs"),
        "batched": Reward(hangs_batched, name="hangs", batched=True),
    }[kind]
    start = time.monotonic()
    with pytest.raises(
        RewardError, match=r"reward 'hangs' timed out after 0.2 s on prompt 9, sample 0; set scoring.on_error=score"
    ):
        score_group([fn], SAMPLES, ScoringPolicy(timeout_s=0.2), prompt_id=9)
    scored = score_group(
        [fn, Reward(exact)], SAMPLES, ScoringPolicy(timeout_s=0.2, on_error="score", error_score=-1.0), prompt_id=9
    )
    release.set()
    assert time.monotonic() - start < 2.0
    assert scored.totals == [0.0, -1.0]  # -1 for the hung reward, plus the exact match
    assert scored.failures == {"hangs": [0, 1]} and scored.components == {"exact": [1.0, 0.0]}


def test_raising_and_non_finite_values_follow_the_policy():
    def flaky(completion):
        if completion == "5":
            raise ConnectionError("sandbox unreachable")
        return 1.0

    def nan_on_five(completion):
        return math.nan if completion == "5" else 1.0

    with pytest.raises(
        RewardError,
        match=r"(?s)reward 'flaky' raised ConnectionError: sandbox unreachable on prompt 3, sample 1.*Traceback",
    ):
        score_group([Reward(flaky)], SAMPLES, ScoringPolicy(), prompt_id=3)
    with pytest.raises(RewardError, match=r"reward 'nan_on_five' returned a non-finite value"):
        score_group([Reward(nan_on_five)], SAMPLES, ScoringPolicy(), prompt_id=3)
    for reward in (flaky, nan_on_five):
        wrapped = Reward(reward)
        with pytest.warns(RuntimeWarning, match=rf"reward '{reward.__name__}' .* on prompt 3, sample 1; such samples"):
            scored = score_group([wrapped], SAMPLES, ScoringPolicy(on_error="score", error_score=0.25), prompt_id=3)
        assert scored.totals == [1.0, 0.25] and scored.failures == {reward.__name__: [1]}
        assert scored.components == {reward.__name__: [1.0, None]}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once: later failures are only counted
            again = score_group([wrapped], SAMPLES, ScoringPolicy(on_error="score", error_score=0.25), prompt_id=4)
        assert again.failures == {reward.__name__: [1]}


@pytest.mark.parametrize("value", ["1.0", None, [1.0], {}])
def test_a_value_that_is_not_a_number_always_raises(value):
    def returns(completion):
        return value

    with pytest.raises(TypeError, match="return a number|returns a number"):
        score_group([Reward(returns)], SAMPLES, ScoringPolicy(on_error="score"), prompt_id=0)


def test_signatures_are_checked_when_the_reward_is_built():
    with pytest.raises(TypeError, match=r"requires a parameter 'response', which is not a reward field"):
        Reward(lambda response: 1.0)
    with pytest.raises(TypeError, match="takes none of the reward fields"):
        Reward(lambda: 1.0)
    assert Reward(lambda **fields: 1.0).fields[0] == "prompt"  # **kwargs: every field
    assert Reward(functools.partial(lambda completion, scale: scale, scale=2.0)).fields == ("completion",)
    with pytest.raises(ValueError, match="weight must be a finite number"):
        Reward(exact, weight=math.inf)
    with pytest.raises(ValueError, match="error_score"):
        ScoringPolicy(error_score=math.nan)
    with pytest.raises(ValueError, match="on_error"):
        ScoringPolicy(on_error="ignore")


def test_a_reward_is_named_by_import_path_or_by_file(tmp_path):
    assert Reward("lit_parl.tasks.positional_reward").name == "positional_reward"
    (tmp_path / "my_rewards.py").write_text("def shout(completion):\n    return float(completion.isupper())\n")
    reward = Reward(f"{tmp_path}/my_rewards.py:shout")
    assert reward.call({"completion": "YES"}) == 1.0
    with pytest.raises(ImportError, match=r"cannot import module 'no_such_module'.*path/to/file.py:fn"):
        Reward("no_such_module.fn")
    with pytest.raises(ImportError, match=r"lit_parl.tasks has no 'positional'.*positional_reward"):
        Reward("lit_parl.tasks.positional")
    with pytest.raises(ImportError, match="no file"):
        Reward(f"{tmp_path}/missing.py:shout")


def test_with_a_timeout_calls_run_one_at_a_time_each_with_its_own_deadline():
    running, most = [0], [0]
    lock = threading.Lock()

    def counted(completion):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.15)
        with lock:
            running[0] -= 1
        return 1.0

    # four calls of 0.15 s under a 0.3 s timeout: each within its own deadline, none concurrent
    assert score_group([Reward(counted)], SAMPLES * 2, ScoringPolicy(timeout_s=0.3), 0).totals == [1.0] * 4
    assert most[0] == 1


def test_async_rewards_work_where_the_caller_already_runs_an_event_loop():
    """A notebook's main thread runs a loop; scoring inline there must not call asyncio.run on it."""

    async def awaited(completion, answer):
        await asyncio.sleep(0)
        return float(completion == answer)

    async def caller():
        return score_group([Reward(awaited)], SAMPLES, ScoringPolicy(timeout_s=5.0), 0).totals

    assert asyncio.run(caller()) == [1.0, 0.0]


def test_a_component_named_failures_is_refused():
    with pytest.raises(TypeError, match="named 'failures'"):
        score_group([Reward(lambda completion: {"failures": 1.0}, name="parts")], SAMPLES, ScoringPolicy(), 0)


def test_a_reward_config_that_cannot_be_imported_names_it(tmp_path):
    from hydra import compose, initialize_config_module

    from lit_parl.cli import build

    overrides = [
        "+reward.mine._target_=lit_parl.rewards.Reward",
        "+reward.mine.fn=no_such_module.exact",
        f"run_dir={tmp_path}",
    ]
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(Exception, match=r"cannot import module 'no_such_module'"):
        build(cfg)
