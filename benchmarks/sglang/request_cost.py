"""What lit_parl's SGLang pool costs per request against a direct call of the same real server (issue 40, item 3).

One real SGLang server launched on the CPU by ``SGLangRolloutPool`` (the tiny Qwen2 of the default job, float32),
one iteration's requests (``--prompts`` x ``--group-size`` samples, prompts of the default job's length), sent two
ways to that one server, interleaved, ``--repeats`` times each:

- ``direct``: the same ``/generate`` bodies (byte for byte: ``messages.sample_payload``), all in flight at once from
  a bare aiohttp session on an event loop of the caller's thread, each answer only JSON-decoded;
- ``pool``: ``SGLangRolloutPool.generate`` (its loop thread, the least-busy pick and the retry bookkeeping, the
  abort check, each group's answers checked and parsed into ``GroupCompletions`` and handed over by a queue).

Per request, for both: wall seconds, the client's CPU seconds (this process: every thread), the server's CPU seconds
(its processes' user + system time from ``/proc``), and the bytes of the request and answer bodies (JSON). A row with
``max_new_tokens=1`` shows the fixed cost of a request; one with the default job's 6 tokens, the job's.

The weight sync's HTTP calls are timed too: ``--syncs`` tensor syncs of the pool, each call by its route (the
pool's ``HTTPClient._request`` wrapped to time it), against the sync's wall: what the wrap (pause, session, flush,
version check, continue) costs beside the update itself, and how big the update's body is (pickled handles to shared
memory, base64 in JSON).

Run from the SGLang environment, on a quiet machine:
``.venv-sglang/bin/python benchmarks/sglang/request_cost.py [--prompts 32] [--group-size 8] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import aiohttp
import torch

from lit_parl.models import tiny_qwen2
from lit_parl.rollout import PoolSpec
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sglang import SGLangRolloutPool
from lit_parl.rollout.sglang.client import KEEPALIVE_S, HTTPClient
from lit_parl.rollout.sglang.messages import sample_payload

DEFAULT_MODEL = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 512}
PROMPT_TOKENS = 12  # about the default job's copy prompts (chat markup and a handful of characters)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` and every descendant (the server's scheduler and detokenizer)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{pid}/task").iterdir():
                children = (task / "children").read_text().split()
                todo.extend(int(child) for child in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def requests_of(prompts: int, group_size: int, version: int, vocabulary: int) -> list[GroupRequest]:
    generator = torch.Generator().manual_seed(version)
    return [
        GroupRequest(
            prompt_id=i,
            prompt_tokens=tuple(torch.randint(4, vocabulary, (PROMPT_TOKENS,), generator=generator).tolist()),
            version=version,
            seeds=tuple(sample_seed(0, version, i, k) for k in range(group_size)),
        )
        for i in range(prompts)
    ]


class DirectClient:
    """A bare aiohttp session kept across rounds (its connections reused, as the pool's are), on a loop of the
    caller's thread: every body POSTed at once, each answer JSON-decoded, nothing checked."""

    def __init__(self, url: str) -> None:
        self.url, self.loop = url, asyncio.new_event_loop()

        async def open_session():
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S))

        self.session = self.loop.run_until_complete(open_session())

    async def _one(self, body: dict) -> int:
        async with self.session.post(self.url + "/generate", json=body) as response:
            response.raise_for_status()
            answer = await response.read()
            json.loads(answer)
            return len(answer)

    def call(self, bodies: list[dict]) -> tuple[int, int]:
        """Returns (request bytes, answer bytes) of the round."""

        async def every():
            return await asyncio.gather(*(self._one(body) for body in bodies))

        answers = self.loop.run_until_complete(every())
        return sum(len(json.dumps(body)) for body in bodies), sum(answers)

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


def measure(what, run, server_pids: list[int], samples: int) -> dict:
    server_cpu, client_cpu, start = cpu_seconds(server_pids), time.process_time(), time.perf_counter()
    run()
    wall = time.perf_counter() - start
    return {
        "how": what,
        "wall_ms_per_request": 1e3 * wall / samples,
        "client_cpu_ms_per_request": 1e3 * (time.process_time() - client_cpu) / samples,
        "server_cpu_ms_per_request": 1e3 * (cpu_seconds(server_pids) - server_cpu) / samples,
    }


def generation_rows(pool, direct_client: DirectClient, server_pids, args, max_new_tokens: int) -> list[dict]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    eos_id, vocabulary = args.eos_id, args.vocabulary
    rows = []
    for repeat in range(args.repeats):
        requests = requests_of(args.prompts, args.group_size, 0, vocabulary)
        requests = [replace(r, seeds=tuple(s + repeat for s in r.seeds)) for r in requests]  # new draws each round
        bodies = [sample_payload(r, k, sampling, eos_id) for r in requests for k in range(r.group_size)]
        n = len(bodies)
        sizes = {}

        def direct():
            sizes["request_bytes"], sizes["answer_bytes"] = direct_client.call(bodies)

        def through_pool():
            groups = list(pool.generate(requests, sampling))
            assert sum(len(g.completions) for g in groups) == n

        order = [("direct", direct), ("pool", through_pool)]
        for what, call in order if repeat % 2 == 0 else order[::-1]:  # interleaved, each first half the time
            rows.append(measure(what, call, server_pids, n) | {"max_new_tokens": max_new_tokens, "repeat": repeat})
        for row in rows[-2:]:
            row |= {key: value / n for key, value in sizes.items()}
    return rows


def sync_rows(pool, model, syncs: int) -> list[dict]:
    """Each tensor sync's wall and its HTTP calls' seconds by route (the pool's ``HTTPClient._request`` timed)."""
    calls: list[tuple[str, float, int]] = []
    original = HTTPClient._request

    async def timed(self, method, url, payload, timeout):
        start = time.perf_counter()
        try:
            return await original(self, method, url, payload, timeout)
        finally:
            size = len(json.dumps(payload)) if payload is not None else 0
            calls.append((url.rsplit("/", 1)[1], time.perf_counter() - start, size))

    HTTPClient._request = timed
    rows = []
    try:
        named = list(model.named_parameters())
        for version in range(1, syncs + 1):
            calls.clear()
            start = time.perf_counter()
            pool.sync_weights([named], version=version)
            wall = time.perf_counter() - start
            by_route: dict[str, float] = defaultdict(float)
            sizes: dict[str, int] = defaultdict(int)
            for route, seconds, size in calls:
                by_route[route] += seconds
                sizes[route] += size
            rows.append({"version": version, "wall_s": wall, "by_route_s": dict(by_route), "body_bytes": dict(sizes)})
    finally:
        HTTPClient._request = original
    return rows


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 6])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        model, tokenizer = tiny_qwen2(**DEFAULT_MODEL, seed=0)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        args.eos_id, args.vocabulary = tokenizer.eos_token_id, len(tokenizer)
        spec = PoolSpec(model_dir=directory, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
        pool = SGLangRolloutPool(
            servers={"deterministic_inference": False},  # SGLang refuses it with the CPU's attention backend
            launch={"port": free_port(), "start_timeout_s": 600},
        )
        pool.start(spec)
        try:
            pool.sync_weights([list(model.named_parameters())], version=0)
            url, server_pids = pool.health().details["urls"][0], pool.launched_pids()
            generated, direct_client = [], DirectClient(url)
            try:
                for tokens in args.tokens:
                    generated += generation_rows(pool, direct_client, server_pids, args, tokens)
            finally:
                direct_client.close()
            synced = sync_rows(pool, model, args.syncs)
        finally:
            pool.close()
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    print(json.dumps({"generate": generated, "sync": synced, "megabytes": megabytes}))
    print(
        f"\none real CPU SGLang server, {args.prompts} prompts x {args.group_size} samples per round, "
        f"{args.repeats} rounds each, interleaved; medians per request (ms)\n"
    )
    print("| max new tokens | how | wall | client CPU | server CPU | request body, bytes | answer body, bytes |")
    print("|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        for how in ("direct", "pool"):
            rows = [r for r in generated if r["max_new_tokens"] == tokens and r["how"] == how]
            print(
                f"| {tokens} | {how} | {median_of(rows, 'wall_ms_per_request'):.2f} "
                f"| {median_of(rows, 'client_cpu_ms_per_request'):.2f} "
                f"| {median_of(rows, 'server_cpu_ms_per_request'):.2f} "
                f"| {median_of(rows, 'request_bytes'):.0f} | {median_of(rows, 'answer_bytes'):.0f} |"
            )
        pool_rows = [r for r in generated if r["max_new_tokens"] == tokens and r["how"] == "pool"]
        direct_rows = [r for r in generated if r["max_new_tokens"] == tokens and r["how"] == "direct"]
        ratios = [p["wall_ms_per_request"] / d["wall_ms_per_request"] for p, d in zip(pool_rows, direct_rows)]
        print(f"|  | pool / direct, wall (median of rounds) | {statistics.median(ratios):.2f}x |  |  |  |  |")
    routes = sorted({route for row in synced for route in row["by_route_s"]})
    print(f"\n{args.syncs} tensor syncs of {megabytes:.2f} MB (one bucket), medians, ms:\n")
    print("| sync wall | " + " | ".join(routes) + " | outside HTTP |")
    print("|---|" + "---|" * (len(routes) + 1))
    walls = [row["wall_s"] for row in synced]
    per_route = [statistics.median(row["by_route_s"].get(route, 0.0) for row in synced) for route in routes]
    outside = statistics.median(row["wall_s"] - sum(row["by_route_s"].values()) for row in synced)
    cells = " | ".join(f"{1e3 * s:.1f}" for s in per_route)
    print(f"| {1e3 * statistics.median(walls):.1f} | {cells} | {1e3 * outside:.1f} |")
    update = statistics.median(row["body_bytes"].get("update_weights_from_tensor", 0) for row in synced)
    print(f"\nthe update's JSON body: {update:.0f} bytes for {megabytes:.2f} MB of weights (handles, not the tensors)")


if __name__ == "__main__":
    main()
