"""A small OpenAI-compatible chat server for the judge's tests, in a thread of the test process: it lists one model
and answers ``/v1/chat/completions`` with what ``answer(text)`` returns for the request's last message, and can be
told to fail the next requests with a status, to stall, to answer garbage, or to want a key. It counts what it was
asked."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


def digit_sum_verdict(text: str) -> str:
    """A deterministic judge: the digits 4 in the request, as a 0-10 score."""
    return f"Looks fine. Score: {min(text.count('4'), 10)}"


@dataclass
class JudgeServer:
    answer: Callable[[str], str] = digit_sum_verdict
    model: str = "tiny-judge"
    fail_next: list[int] = field(default_factory=list)  # statuses for the next requests, one each
    stall_s: float = 0.0
    api_key: str | None = None  # set: every route wants "Authorization: Bearer <api_key>", as hosted APIs do
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    most_in_flight: int = 0

    def start(self) -> JudgeServer:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True, name="judge-server").start()
        ready.wait(10)
        return self

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        ready.set()
        self._loop.run_forever()

    def _refused(self, request: web.Request) -> bool:
        return self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.Response:
        if self._refused(request):
            return web.Response(status=401, text="missing or wrong key")
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        if self._refused(request):
            return web.Response(status=401, text="missing or wrong key")
        body = await request.json()
        self.requests.append(body)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            if self.stall_s:
                await asyncio.sleep(self.stall_s)
            if self.fail_next:
                return web.Response(status=self.fail_next.pop(0), text="overloaded")
            text = self.answer(body["messages"][-1]["content"])
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})
        finally:
            self.in_flight -= 1

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
