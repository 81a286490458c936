"""JudgeReward: an LLM judge behind an OpenAI-compatible endpoint (a server in this process, tests/helpers). Its
verdicts are parsed and scaled; cache hits skip the call; failures are retried and then follow the scoring policy,
as do slow and unparsable verdicts; concurrency is bounded; an unreachable endpoint stops the run at once, in one
line; an episode's whole exchange reaches the rubric."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from helpers.judge_server import JudgeServer
from lit_parl.errors import EndpointError
from lit_parl.rewards import JudgeReward, RewardError, ScoringPolicy, score_group


def sample(reply: str, prompt: str = "2+2=") -> dict:
    conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
    return {"prompt": prompt, "conversation": conversation, "answer": "4"}


@pytest.fixture
def server():
    running = JudgeServer().start()
    yield running
    running.stop()


def test_verdicts_are_parsed_scaled_and_cached(server):
    judge = JudgeReward(server.url, rubric="{completion}", retry_backoff_s=0.01)
    assert judge.endpoint.model == "tiny-judge"  # the first model the server lists
    samples = [sample("4"), sample("44"), sample("444 4")]
    assert score_group([judge], samples, ScoringPolicy(), 0).totals == [0.1, 0.2, 0.4]
    assert len(server.requests) == 3
    assert server.requests[0] == {
        "model": "tiny-judge",
        "messages": [{"role": "user", "content": "4"}],
        "max_tokens": 64,
        "temperature": 0.0,
    }
    assert score_group([judge], samples, ScoringPolicy(), 1).totals == [0.1, 0.2, 0.4]
    assert len(server.requests) == 3 and judge.cache_hits == 3  # judged before: no request
    same = score_group([judge], [sample("4 4 4")] * 8, ScoringPolicy(), 2).totals
    assert same == [0.3] * 8 and len(server.requests) == 4  # eight identical replies at once: one request
    uncached = JudgeReward(server.url, rubric="{completion}", cache_size=0)
    score_group([uncached], samples, ScoringPolicy(), 3)
    assert len(server.requests) == 7
    judge.close(), uncached.close()


def test_a_failing_judge_is_retried_then_follows_the_policy(server):
    judge = JudgeReward(server.url, name="judge", rubric="{completion}", retries=2, retry_backoff_s=0.01, cache_size=0)
    server.fail_next = [503]
    assert score_group([judge], [sample("44")], ScoringPolicy(), 0).totals == [0.2]
    assert len(server.requests) == 2  # the 503, then the answer

    server.fail_next = [500, 502, 503]
    with pytest.raises(
        RewardError,
        match=r"reward 'judge' raised EndpointError: the judge's endpoint .* failed after "
        r"3 tries \(HTTP 503: overloaded\) on prompt 4",
    ):
        score_group([judge], [sample("4")], ScoringPolicy(), 4)
    server.fail_next = [500, 500, 500]
    scored = score_group([judge], [sample("4")], ScoringPolicy(on_error="score", error_score=-1.0), 5)
    assert scored.totals == [-1.0] and scored.failures == {"judge": [0]}

    cached = JudgeReward(server.url, rubric="{completion}", retries=0)
    server.fail_next = [500]
    assert score_group([cached], [sample("4")], ScoringPolicy(on_error="score"), 7).failures == {"judge": [0]}
    assert score_group([cached], [sample("4")], ScoringPolicy(), 8).totals == [0.1]  # a failure is not cached
    cached.close()

    server.fail_next, before = [400], len(server.requests)
    scored = score_group([judge], [sample("4")], ScoringPolicy(on_error="score"), 6)
    assert scored.failures == {"judge": [0]} and len(server.requests) == before + 1  # a bad request is not retried
    judge.close()


def test_a_slow_judge_times_out_under_the_policy(server):
    server.stall_s = 2.0
    judge = JudgeReward(server.url, rubric="{completion}")
    with pytest.raises(RewardError, match="reward 'judge' timed out after 0.2 s"):
        score_group([judge], [sample("4")], ScoringPolicy(timeout_s=0.2), 0)
    scored = score_group([judge], [sample("44")], ScoringPolicy(timeout_s=0.2, on_error="score"), 1)
    assert scored.failures == {"judge": [0]}
    server.stall_s = 0.0
    assert score_group([judge], [sample("44")], ScoringPolicy(timeout_s=30), 2).totals == [0.2]  # asked again
    judge.close()


@pytest.mark.parametrize("verdict", ["I cannot tell.", "Score: 11", "Score: -1"])
def test_an_unparsable_or_out_of_range_verdict_follows_the_policy(server, verdict):
    server.answer = lambda text: verdict
    judge = JudgeReward(server.url)
    with pytest.raises(RewardError, match="raised JudgeParseError: the judge's"):
        score_group([judge], [sample("4")], ScoringPolicy(), 0)
    scored = score_group([judge], [sample("4")], ScoringPolicy(on_error="score", error_score=0.0), 1)
    assert scored.failures == {"judge": [0]}
    judge.close()


def test_requests_in_flight_are_bounded_by_concurrency(server):
    server.stall_s = 0.1
    judge = JudgeReward(server.url, rubric="{completion}", concurrency=2)
    score_group([judge], [sample("4" * k) for k in range(8)], ScoringPolicy(), 0)
    assert server.most_in_flight == 2
    judge.close()


def test_an_unreachable_or_wrong_endpoint_is_refused_when_the_run_starts(server):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(EndpointError, match=rf"the judge's endpoint http://127.0.0.1:{port} cannot be reached"):
        JudgeReward(f"http://127.0.0.1:{port}")
    with socket.socket() as silent:  # accepts connections and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        with pytest.raises(EndpointError, match="cannot be reached .*timed out"):
            JudgeReward(f"http://127.0.0.1:{silent.getsockname()[1]}", probe_timeout_s=0.5)
    with pytest.raises(EndpointError, match=r"serves \['tiny-judge'\], not model='gpt'"):
        JudgeReward(server.url, model="gpt")
    with pytest.raises(ValueError, match=r"judge rubric: KeyError 'reply'"):
        JudgeReward(server.url, rubric="Rate {reply}")
    with pytest.raises(ValueError, match="needs a group"):
        JudgeReward(server.url, pattern=r"Score: \d+")


def test_the_cli_stops_in_one_line_when_the_judge_cannot_be_reached(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_parl",
            "reward=judge",
            f"reward.judge.url=http://127.0.0.1:{port}",
            f"run_dir={tmp_path}",
            "iterations=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,  # a guard against a hang, not a measure
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"lit-parl: error: config reward.judge: the judge's endpoint http://127.0.0.1:{port} cannot be reached "
        "([Errno 111] Connection refused); start the judge's server or fix reward.<name>.url"
    ], done.stderr


def test_an_episodes_turns_reach_the_rubric(server):
    judge = JudgeReward(server.url, rubric="{conversation}|{prompt}|{completion}|{answer}")
    conversation = [
        {"role": "user", "content": "guess"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "lower"},
        {"role": "assistant", "content": "4"},
    ]
    messages = judge.messages("raw", conversation, None)
    assert messages == [
        {"role": "user", "content": "user: guess\n\nassistant: 5\n\nuser: lower\n\nassistant: 4|lower|4|"}
    ]
    judge.close()


def test_a_hosted_api_gets_its_key_from_the_variable_named_and_a_missing_key_is_named(server, monkeypatch):
    server.api_key = "sekret"
    with pytest.raises(EndpointError, match="refused the request \\(HTTP 401\\): it wants a key; set .*api_key_env"):
        JudgeReward(server.url)
    with pytest.raises(ValueError, match="api_key_env='LIT_PARL_TEST_JUDGE_KEY': that environment variable is not set"):
        JudgeReward(server.url, api_key_env="LIT_PARL_TEST_JUDGE_KEY")
    monkeypatch.setenv("LIT_PARL_TEST_JUDGE_KEY", "sekret")
    judge = JudgeReward(server.url, api_key_env="LIT_PARL_TEST_JUDGE_KEY", rubric="{completion}")
    assert score_group([judge], [sample("44")], ScoringPolicy(), 0).totals == [0.2]
    judge.close()
