"""An environment call that misses its deadline: the episode gives up on it, and the call may still return later."""

from __future__ import annotations

import threading

import pytest

from lit_parl.episodes.environment_calls import EnvironmentCalls, EnvironmentFailure


def test_a_call_that_returns_after_its_episode_gave_up_on_it_raises_nothing_in_its_thread(monkeypatch):
    """The step returns once its deadline passed and its future was given up (cancelled): its thread must end
    quietly, where setting the abandoned future's result raised InvalidStateError in it."""
    escaped: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: escaped.append(hook.exc_value))
    release, ran_in = threading.Event(), []

    def slow_step(text: str) -> str:
        ran_in.append(threading.current_thread())
        release.wait(10)
        return text

    calls = EnvironmentCalls(timeout_s=0.05)
    call = calls.start(slow_step, "answer")
    with pytest.raises(EnvironmentFailure, match=r"timed out after 0.05 s"):
        calls.result(call)
    release.set()  # the step completes now, after the episode gave up on it
    ran_in[0].join(10)
    assert not ran_in[0].is_alive()
    assert not escaped, f"the environment call's thread raised {escaped[0]!r}"


def test_a_call_within_its_deadline_returns_its_value_or_its_error():
    calls = EnvironmentCalls(timeout_s=10)
    assert calls.result(calls.start(str.upper, "done")) == "DONE"
    with pytest.raises(EnvironmentFailure, match="raised ZeroDivisionError"):
        calls.result(calls.start(lambda: 1 / 0))
