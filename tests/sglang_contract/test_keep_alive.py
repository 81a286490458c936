"""The pool's HTTP client never reuses a connection that an SGLang server may have closed.

SGLang's HTTP server (uvicorn) closes a connection idle for ``SGLANG_TIMEOUT_KEEP_ALIVE`` seconds (5 by default,
``sglang/srt/environ.py``); aiohttp keeps idle connections 15 s by default. A request sent on a connection the
server is closing fails ("Server disconnected", "Can not write request body"): seen on this CPU between
iterations, where the pool then took the live server for dead (its ``/health`` probe failed the same way) and
stopped it at the next push. The client must let idle connections go before the server does.
"""

from __future__ import annotations

from sglang_contract.sglang_side import require_sglang

require_sglang()

from sglang.srt.environ import envs  # noqa: E402

from lit_parl.rollout.sglang.client import HTTPClient  # noqa: E402


def test_the_client_drops_idle_connections_before_sglang_closes_them():
    client = HTTPClient(request_timeout_s=5.0)
    try:
        connector = client._session.connector
        assert connector._keepalive_timeout < envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()
    finally:
        client.close()
