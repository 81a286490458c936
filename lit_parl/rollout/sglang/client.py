"""Talking HTTP to SGLang servers: an asyncio loop of the pool's own, one aiohttp session, and retries.

The loop runs in a daemon thread, so the trainer's thread only submits coroutines and waits on their
results; all of an iteration's requests are in flight at once on it. Errors are sorted for the
caller: ``ServerError`` (5xx, an aborted sample), ``ConnectionError`` and ``asyncio.TimeoutError`` are
worth retrying on another server; ``MalformedResponse`` and a 4xx are not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from lit_parl.extras import require
from lit_parl.rollout.sglang.messages import MalformedResponse

if TYPE_CHECKING:
    from lit_parl.rollout.sglang.servers import ServerFleet


class ServerError(RuntimeError):
    """A server answered with an error status or an aborted sample: worth retrying elsewhere."""


class RouteNotFound(RuntimeError):
    """HTTP 404: the server has no such route (an SGLang release older or newer than the route)."""


RETRYABLE = (ServerError, OSError, asyncio.TimeoutError)  # OSError: ConnectionError included
KEEPALIVE_S = 3.0  # how long an idle connection is kept for reuse: below SGLang's 5 s


class HTTPClient:
    """An asyncio loop in a thread of its own and the aiohttp session every request of a pool goes through.

    Args:
        request_timeout_s: the default total timeout of one request.
    """

    def __init__(self, request_timeout_s: float) -> None:
        aiohttp = require("aiohttp", "sglang", "SGLangRolloutPool")
        self.request_timeout_s = request_timeout_s
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="lit_parl-sglang-client", daemon=True)
        self._thread.start()
        self.closed = False

        async def open_session():
            # no connection cap: all of an iteration's samples are in flight at once. Idle connections are let go
            # after 3 s, before SGLang's server closes them (5 s, SGLANG_TIMEOUT_KEEP_ALIVE): a request on one it is
            # closing fails, and a /health probe failing so takes a live server for dead
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            return aiohttp.ClientSession(connector=connector)

        self._session = self.run(open_session())

    def submit(self, coroutine: Coroutine) -> concurrent.futures.Future:
        """Start ``coroutine`` on the loop; its future's ``cancel`` cancels it there."""
        if self.closed:
            coroutine.close()
            raise RuntimeError("the SGLang client is closed")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine) -> Any:
        """Run ``coroutine`` on the loop and wait for its result (from any thread but the loop's)."""
        return self.submit(coroutine).result()

    async def post(self, url: str, path: str, payload: dict, timeout: float | None = None) -> Any:
        return await self._request("POST", url + path, payload, timeout or self.request_timeout_s)

    async def get(self, url: str, path: str, timeout: float | None = None) -> Any:
        return await self._request("GET", url + path, None, timeout or self.request_timeout_s)

    async def _request(self, method: str, url: str, payload: dict | None, timeout: float) -> Any:
        import aiohttp

        try:
            timeouts = aiohttp.ClientTimeout(total=timeout)
            async with self._session.request(method, url, json=payload, timeout=timeouts) as response:
                body = await response.read()
                if response.status >= 500:
                    raise ServerError(f"{method} {url}: HTTP {response.status}: {body[:200]!r}")
                if response.status == 404:
                    raise RouteNotFound(f"{method} {url}: HTTP 404: {body[:300]!r}")
                if response.status >= 400:
                    raise RuntimeError(f"{method} {url}: HTTP {response.status}: {body[:300]!r}")
                if response.content_type == "application/json":
                    return await response.json()
                return body.decode(errors="replace")
        except aiohttp.ClientConnectionError as error:
            raise ConnectionError(f"{method} {url}: {error}") from error
        except aiohttp.ContentTypeError as error:
            raise MalformedResponse(f"{method} {url}: {error}") from error

    def close(self) -> None:
        """Close the session and stop the loop; idempotent. Requests still in flight are cancelled."""
        if self.closed:
            return
        self.closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._session.close(), self.loop).result(timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if not self.loop.is_running():
                self.loop.close()


async def post_with_retries(
    client: HTTPClient,
    fleet: ServerFleet,
    path: str,
    payload: dict,
    max_retries: int,
    what: str,
    check: Callable[[Any], str | None] = lambda answer: None,
    episode: tuple[int, int, int] | None = None,
) -> tuple[str, Any]:
    """POST to the least busy live server (through the router, if any); on a retryable failure, again elsewhere.

    A server that fails is health-checked and dropped if it is down. ``check(answer)`` names a failure
    hidden in a successful answer (an aborted sample), which is retried too. An ``episode``'s turn goes to the
    server of its previous turn while that one is up (without a router: a router picks by its own policy).
    Returns ``(url, answer)``; raises after ``max_retries`` retries or when no live server is left.
    """
    errors: list[str] = []
    while True:
        server = fleet.pick(episode)
        if server is None:
            everyone = [s.url for s in fleet.servers]
            raise RuntimeError(f"{what}: no live SGLang server left (all of {everyone} failed); errors: {errors[-3:]}")
        target = fleet.router or server  # with a router, it balances; `server` only keeps the books
        server.in_flight += 1
        server.busy_from = server.busy_from or time.monotonic()
        try:
            answer = await client.post(target.url, path, payload)
            failure = check(answer)
            if failure is not None:
                raise ServerError(failure)
        except RETRYABLE as error:
            errors.append(f"{target.url}: {type(error).__name__}: {error}")
            if len(errors) > max_retries:
                raise RuntimeError(f"{what}: {path} failed {len(errors)} times: {errors}") from error
            await fleet.check_alive(client, target)
            continue
        finally:
            server.in_flight -= 1
        server.busy_to = time.monotonic()
        if episode is not None:
            fleet.episodes[episode] = server.url
        return target.url, answer
