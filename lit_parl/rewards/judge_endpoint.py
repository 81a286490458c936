"""JudgeEndpoint: an OpenAI-compatible chat-completions server (SGLang, vLLM, or a hosted API) as a judge asks it.

It owns the transport: a probe when the run starts (``GET /v1/models``: an unreachable or wrong address stops the
run within seconds, in one line naming the endpoint), then ``POST /v1/chat/completions`` with at most
``concurrency`` requests in flight, each with its own timeout, and ``retries`` more tries with a doubling pause for
what a server may answer differently next time (a connection error, a timeout, 429 and 5xx). A 4xx other than 429
is a mistake in the request and is not retried. The HTTP session (aiohttp) is made on the rewards' event loop, the
one every call of an async reward runs on.

Example (no server needed to build the request)::

    >>> endpoint = JudgeEndpoint("http://127.0.0.1:30000/", model="judge", probe=False)
    >>> endpoint.url, endpoint.body([{"role": "user", "content": "Rate: 2+2=4"}], max_tokens=8, temperature=0.0)
    ('http://127.0.0.1:30000', {'model': 'judge', 'messages': [{'role': 'user', 'content': 'Rate: 2+2=4'}], \
'max_tokens': 8, 'temperature': 0.0})
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
from concurrent.futures import TimeoutError as FutureTimeout

from lit_parl.errors import EndpointError
from lit_parl.extras import require

RETRIED_STATUS = {408, 429, 500, 502, 503, 504}


class JudgeEndpoint:
    """Where a judge's requests go, and how they are sent.

    Args:
        url: the server's address (``http://host:port``; a trailing ``/v1`` is allowed).
        model: the model name sent with each request; ``None``: the first one the server lists.
        api_key_env: the environment variable holding a bearer token (hosted APIs); ``None``: none sent.
        concurrency: the most requests in flight at once, over every group.
        request_timeout_s: one request's limit.
        retries: tries after the first for a connection error, a timeout, 429 or 5xx.
        retry_backoff_s: the first pause before a retry (doubled each time).
        probe: ask the server for its models now (``False``: trust the address; tests of the request only).
        probe_timeout_s: how long the probe waits for an answer.
    """

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key_env: str | None = None,
        concurrency: int = 16,
        request_timeout_s: float = 60.0,
        retries: int = 2,
        retry_backoff_s: float = 0.5,
        probe: bool = True,
        probe_timeout_s: float = 5.0,
    ) -> None:
        self._aiohttp = require("aiohttp", "judge", "reward=judge")  # a missing extra fails before the run starts
        if concurrency < 1:
            raise ValueError(f"judge concurrency={concurrency} must be >= 1")
        if retries < 0:
            raise ValueError(f"judge retries={retries} must be >= 0")
        self.url = url.rstrip("/").removesuffix("/v1")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(
                f"judge url={url!r}: give the server's address with its scheme, e.g. http://127.0.0.1:30000"
            )
        self.api_key = None
        if api_key_env is not None:
            self.api_key = os.environ.get(api_key_env)
            if not self.api_key:
                raise ValueError(f"judge api_key_env={api_key_env!r}: that environment variable is not set")
        self.concurrency, self.request_timeout_s = concurrency, request_timeout_s
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.requests = 0  # requests sent (retries included): what the cache saves is seen here
        self.model = model
        if probe:
            served = self.probe(probe_timeout_s)
            if self.model is None:
                self.model = served[0]
        self._session = None
        self._semaphore = None

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def probe(self, timeout_s: float) -> list[str]:
        """The models the server lists; an ``EndpointError`` naming the endpoint when it does not answer."""
        request = urllib.request.Request(f"{self.url}/v1/models", headers=self._headers())
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                listed = json.loads(answer.read())
        except urllib.error.HTTPError as error:
            if error.code in (401, 403):
                raise EndpointError(
                    f"the judge's endpoint {self.url} refused the request (HTTP {error.code}): it wants a key; set "
                    "reward.<name>.api_key_env to the environment variable that holds it"
                ) from None
            raise EndpointError(
                f"the judge's endpoint {self.url} answered GET /v1/models with HTTP {error.code}: is it an "
                "OpenAI-compatible server (SGLang, vLLM)? Check reward.<name>.url"
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise EndpointError(
                f"the judge's endpoint {self.url} cannot be reached ({reason}); start the judge's server or "
                "fix reward.<name>.url"
            ) from None
        models = [entry.get("id") for entry in listed.get("data", []) if entry.get("id")]
        if not models:
            raise EndpointError(f"the judge's endpoint {self.url} lists no model at /v1/models; is its model loaded?")
        if self.model is not None and self.model not in models:
            raise EndpointError(
                f"the judge's endpoint {self.url} serves {models}, not model={self.model!r}; name one of them"
            )
        return models

    def body(self, messages: list[dict], max_tokens: int, temperature: float) -> dict:
        return {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature}

    async def complete(self, messages: list[dict], max_tokens: int, temperature: float) -> str:
        """The judge's answer text; an ``EndpointError`` once every try failed."""
        aiohttp = self._aiohttp
        if self._session is None:  # made here, on the loop the calls run on
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.request_timeout_s))
            self._semaphore = asyncio.Semaphore(self.concurrency)
        body, pause, last = self.body(messages, max_tokens, temperature), self.retry_backoff_s, ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(pause)
                pause *= 2
            async with self._semaphore:
                self.requests += 1
                try:
                    async with self._session.post(
                        f"{self.url}/v1/chat/completions", json=body, headers=self._headers()
                    ) as answer:
                        text = await answer.text()
                        if answer.status == 200:
                            return json.loads(text)["choices"][0]["message"]["content"] or ""
                        last = f"HTTP {answer.status}: {text[:200]}"
                        if answer.status not in RETRIED_STATUS:
                            break
                except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                    last = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise EndpointError(f"the judge's endpoint {self.url} failed after {attempt + 1} tries ({last})")

    def close(self) -> None:
        """Close the HTTP session on the loop it was made on (the rewards')."""
        if self._session is None:
            return
        from lit_parl.rewards.scoring_policy import event_loop

        try:
            asyncio.run_coroutine_threadsafe(self._session.close(), event_loop()).result(5)
        except (FutureTimeout, RuntimeError):
            pass  # the loop stopped: the process is ending and its sockets with it
        self._session = None
