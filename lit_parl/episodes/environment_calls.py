"""EnvironmentCalls: an environment's ``reset`` and ``step`` started as futures, each under the scoring deadline.

An ``async def`` method runs on the rewards' event loop (one loop in a thread of its own, so a client an
environment keeps between calls stays on the loop it was made on), many episodes' steps at once. A
synchronous method runs inline when no timeout is set (the fastest for a step of microseconds), and on a
daemon thread of its own otherwise, so the deadline holds even when it never returns, and a call that
never returns does not hold the process at exit (Python cannot kill a thread: an environment that can
hang should do its work in a subprocess it can kill).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from lit_parl.rewards.scoring_policy import event_loop


class EnvironmentFailure(Exception):
    """An environment call raised or missed its deadline: ``why`` in one line, ``detail`` its traceback."""

    def __init__(self, why: str, detail: str = "") -> None:
        super().__init__(why)
        self.why, self.detail = why, detail


class EnvironmentCalls:
    """Starts environment calls and collects their results, under ``timeout_s`` each (``None``: no limit).

    Args:
        timeout_s: seconds one call may take, counted from its start.
    """

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s

    def start(self, method, *args) -> tuple[Future, float]:
        """``method(*args)`` under way: its future and its deadline (``inf``: none)."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else float("inf")
        if inspect.iscoroutinefunction(method):
            return asyncio.run_coroutine_threadsafe(method(*args), event_loop()), deadline
        future: Future = Future()
        if self.timeout_s:
            threading.Thread(target=_run, args=(future, method, args), daemon=True, name="lit_parl-env").start()
        else:
            _run(future, method, args)
        return future, deadline

    def result(self, call: tuple[Future, float]):
        """The call's value; ``EnvironmentFailure`` if it raised or is past its deadline."""
        future, deadline = call
        try:
            value = future.result(None if deadline == float("inf") else max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            future.cancel()  # an async call's task stops; a running thread's cannot (it ends on its own)
            raise EnvironmentFailure(f"timed out after {self.timeout_s} s") from None
        except Exception as error:  # noqa: BLE001
            detail = "".join(traceback.format_exception(error))
            raise EnvironmentFailure(f"raised {type(error).__name__}: {error}", detail) from None
        if inspect.isawaitable(value):
            raise TypeError(
                "an environment method returned an awaitable from a plain def: declare it `async def` so that it "
                "is awaited on the event loop"
            )
        return value


def _run(future: Future, method, args) -> None:
    # Running, the future can no longer be cancelled: a call past its deadline (``result`` gives it up) that
    # returns later then sets a result nobody reads, where setting it on a cancelled future raised in this thread.
    if not future.set_running_or_notify_cancel():
        return
    try:
        value = method(*args)
    except Exception as error:  # noqa: BLE001 - judged by the scoring policy where the result is read
        future.set_exception(error)
    else:
        future.set_result(value)
