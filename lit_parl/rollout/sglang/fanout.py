"""``ServerFanout``: one call of a weight push made on every server at once, going on without those that went down.

A server that fails a call of the push (a connection, a timeout, a 5xx) may have died between iterations or during
the push. ``lose`` (set by the pool) tells: when the server is down it leaves the push, which completes on the
others; a server that is up and refused still fails it. The push stops only when no server is left.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Awaitable, Callable

from lit_parl.rollout.sglang.client import RETRYABLE, HTTPClient
from lit_parl.rollout.sglang.servers import Server

LOST = object()  # what `guarded` returns for a server that went down during the push and left it


class ServerFanout:
    """Calls made on every server of a push; the servers that went down leave it.

    Args:
        lose: ``await lose(server, error)`` is True when ``server``, which failed a call of the push, is down and
            leaves the push (the rest goes on without it); ``None``: every failure fails the push.
    """

    def __init__(self, lose: Callable[[Server, BaseException], Awaitable[bool]] | None = None) -> None:
        self.lose = lose

    async def each(self, servers: list[Server], call) -> list:
        """``call`` on every server at once; those that fail it and are down leave ``servers``, in place, so the
        rest of the push skips them. Returns the others' answers, in their order."""
        results = await asyncio.gather(*(self.guarded(call, s) for s in servers))
        self.leave(servers, results)
        return [result for result in results if result is not LOST]

    @staticmethod
    def leave(servers: list[Server], results: list) -> None:
        """Take the servers whose result is ``LOST`` out of ``servers``, in place; raise if none is left."""
        lost = [s.url for s, result in zip(servers, results) if result is LOST]
        if lost:
            servers[:] = [s for s, result in zip(servers, results) if result is not LOST]
            if not servers:
                raise RuntimeError(
                    f"SGLang server(s) {lost} failed during the weight push and are down: no live server is left. "
                    "Start servers, list them (pool.servers.urls) and resume from the last checkpoint"
                )

    async def guarded(self, call, server: Server):
        """``call(server)``, or ``LOST`` when it failed as a server that went down fails and ``lose`` dropped it."""
        try:
            return await call(server)
        except RETRYABLE as error:
            if self.lose is None or not await self.lose(server, error):
                raise
            return LOST


async def leaves_push(client: HTTPClient, server: Server, error: BaseException) -> bool:
    """Whether ``server``, which failed a call of the push with ``error``, is down (its process gone, for one launched
    here, or no answer at ``/health``): it then leaves this push, which goes on with the others, and the next push
    drops it, as one that fails a request. One that is up refused: the push's own error."""
    if server.process is None or server.process.poll() is None:
        try:
            await client.get(server.url, "/health", timeout=5.0)
            return False
        except RETRYABLE:
            pass
    server.alive = False
    warnings.warn(
        f"SGLang server {server.url} failed during the weight push ({type(error).__name__}: {error}) and is down: "
        "the push and the run go on with the other servers",
        RuntimeWarning,
        stacklevel=2,
    )
    return True
