"""One iteration's requests as SGLang ``/generate`` calls, each group handed over as soon as its samples are in.

Every sample is a request of its own (``sglang_router`` accepts only single requests, and a failed sample is
sent again alone, to another live server: ``client.post_with_retries``); a multi-turn episode's turns go to one
server while it is up (its prefix cache holds the episode so far; behind a router, the router's own cache-aware
policy decides); at most
``RequestSettings.max_groups_in_flight`` groups generate at once. The requests run on the HTTP client's event loop;
the trainer's thread takes the finished groups from a queue, and stops waiting with a clear error when the pool
is closed under it or the loop ends without a word.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator

from lit_parl.rollout.records import GroupCompletions, GroupRequest
from lit_parl.rollout.sglang.client import HTTPClient, post_with_retries
from lit_parl.rollout.sglang.messages import Ends, abort_reason, parse_group
from lit_parl.rollout.sglang.servers import ServerFleet
from lit_parl.rollout.sglang.settings import RequestSettings

Payload = Callable[[GroupRequest, int], dict]  # the /generate body of sample k of a request


def stream_groups(
    client: HTTPClient,
    fleet: ServerFleet,
    requests: list[GroupRequest],
    payload: Payload,
    ends: Ends,
    settings: RequestSettings,
) -> Iterator[GroupCompletions]:
    """Yield each request's completions, in completion order; ``payload(request, k)``: sample k's body."""
    finished: queue.Queue = queue.Queue()
    future = client.submit(_generate_all(client, fleet, requests, payload, ends, settings, finished))
    try:
        for received in range(len(requests)):
            while True:
                try:
                    item = finished.get(timeout=1.0)
                    break
                except queue.Empty:
                    if client.closed:  # closed from another thread (the trainer failed): stop waiting
                        raise RuntimeError("the SGLang pool was closed while generating") from None
                    if future.done() and finished.empty():  # the client loop ended without a word
                        cause = None if future.cancelled() else future.exception()
                        missing = len(requests) - received
                        raise RuntimeError(f"the SGLang client stopped with {missing} groups missing") from cause
            if isinstance(item, BaseException):
                if client.closed:  # the requests failed because the pool was closed under them
                    raise RuntimeError("the SGLang pool was closed while generating") from item
                raise item
            yield item
    finally:
        future.cancel()  # the consumer stopped early (or failed): no request keeps running for nobody


async def _generate_all(client, fleet, requests, payload, ends, settings: RequestSettings, finished) -> None:
    limit = asyncio.Semaphore(settings.max_groups_in_flight)
    versions = {r.version for r in requests}
    fleet.episodes = {key: url for key, url in fleet.episodes.items() if key[0] in versions}  # older: not cached

    async def group(request: GroupRequest) -> None:
        async with limit:
            draws = (
                post_with_retries(
                    client,
                    fleet,
                    "/generate",
                    payload(request, k),
                    settings.max_retries,
                    f"prompt {request.prompt_id} sample {k}",
                    check=abort_reason,
                    episode=(request.version, *(request.episode or (request.prompt_id, k))),
                )
                for k in range(request.group_size)
            )
            samples = await asyncio.gather(*draws)
        urls = ", ".join(sorted({url for url, _ in samples}))
        finished.put(parse_group(request, [answer for _, answer in samples], urls, ends))

    tasks = [asyncio.ensure_future(group(r)) for r in requests]
    try:
        await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        raise
    except BaseException as error:  # noqa: BLE001 - hand it to the trainer's thread
        finished.put(error)
    finally:
        for task in tasks:
            task.cancel()
