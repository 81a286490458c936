"""lit_parl's SGLang pool against a real SGLang server, launched on the CPU (``pool=sglang`` without a GPU:
``lit_parl.rollout.sglang.cpu_server``). One server serves the whole module (its start takes about a minute).

- generation: sampled, greedy, top-k/top-p with stop tokens and stop strings: every group's log-probs equal the
  trainer's (a transformers forward of the synced weights at logits / T) within the float32 on-policy bound;
- every weight-sync route the pool offers: ``tensor`` (inside ``/begin_weight_update`` … ``/end_weight_update``),
  ``disk`` and ``distributed`` (over gloo): each version reported by the server before the first request, and
  its samples' log-probs are those of that version's weights (and far from the previous version's);
- a launched CPU server's start-up heap is frozen out of its garbage collector (``servers.freeze_start_heap``), after
  a flush, before anything else is asked of it;
- the pool's close leaves nothing of its servers behind, of one it stops or one that crashed before: no process, no
  ``/dev/shm/sglang_loads_*`` file, no ZeroMQ socket in ``/tmp``.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock
from urllib.parse import urlsplit

import pytest
import torch

from sglang_contract.sglang_side import require_sglang

require_sglang()

from lit_parl.models import tiny_qwen2  # noqa: E402
from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE  # noqa: E402
from lit_parl.rollout.sglang import SGLangRolloutPool  # noqa: E402
from lit_parl.rollout.sglang.client import HTTPClient  # noqa: E402
from lit_parl.rollout.sglang.commands import launches_on_cpu  # noqa: E402
from lit_parl.trainer.guards import worst_group_mismatch  # noqa: E402
from sglang_contract.pool_run import SAMPLINGS, STOP_TOKEN, free_port, group_requests  # noqa: E402


def policy(version: int):
    model, _ = tiny_qwen2(seed=10 + version)  # other weights at each version
    return model.eval()


def sync(pool: SGLangRolloutPool, method: str, version: int) -> None:
    pool.sync = replace(pool.sync, method=method)  # the method is read at each sync
    named = list(policy(version).named_parameters())
    pool.sync_weights([named[i : i + 5] for i in range(0, len(named), 5)], version=version)


def trainer_logprobs(model, prompt, completion, temperature: float) -> list[float]:
    ids = torch.tensor([[*prompt, *completion]])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / (temperature or 1.0)
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


def worst_mismatch(groups, requests, model, temperature: float) -> float:
    """The on-policy check's worst group mean |Δ log-prob| per token, over every group."""
    prompts = {r.prompt_id: r.prompt_tokens for r in requests}
    rollout, old, ids = [], [], []
    for group in groups:
        for completion, logprobs in zip(group.completions, group.logprobs, strict=True):
            rollout.append(torch.tensor(logprobs, dtype=torch.float64))
            old.append(torch.tensor(trainer_logprobs(model, prompts[group.prompt_id], completion, temperature)))
            ids.append(group.prompt_id)
    pad = torch.nn.utils.rnn.pad_sequence
    mask = pad([torch.ones(len(r)) for r in rollout], batch_first=True)
    worst, _ = worst_group_mismatch(pad(rollout, batch_first=True), pad(old, batch_first=True), mask, ids)
    return worst


START_REQUESTS: list[tuple[str, str]] = []  # (method, path) of each request the module pool's start had answered


@pytest.fixture(scope="module")
def pool(spec):
    assert launches_on_cpu(SGLangRolloutPool().launch), "these tests launch SGLang on the CPU platform"
    pool = SGLangRolloutPool(
        servers={"deterministic_inference": False},  # SGLang refuses it with the CPU's attention backend
        launch={"port": free_port(), "start_timeout_s": 600},
        sync={"backend": "gloo", "master_port": free_port()},
    )
    request = HTTPClient._request

    async def recorded(self, method, url, payload, timeout):
        answer = await request(self, method, url, payload, timeout)  # raises on a refusal: not recorded
        START_REQUESTS.append((method, urlsplit(url).path))
        return answer

    with mock.patch.object(HTTPClient, "_request", recorded):
        pool.start(spec)
    yield pool
    pool.close()


def test_the_start_freezes_the_servers_start_up_heap_after_a_flush(pool):
    """SGLang's own request for the freeze comes before its HTTP server listens when warm-up is skipped (the CPU
    launch's): the pool asks, once the server is healthy, and the real server takes both requests."""
    assert START_REQUESTS[-3:] == [("GET", "/health"), ("POST", "/flush_cache"), ("POST", "/freeze_gc")]


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_real_server_samples_are_on_policy_at_the_float32_bound(pool, name):
    version = (pool.version or 0) + 1
    sync(pool, "tensor", version)
    sampling = SAMPLINGS[name]
    requests = group_requests(version, prompts=4)
    groups = list(pool.generate(requests, sampling))
    assert sorted(g.prompt_id for g in groups) == [r.prompt_id for r in requests]
    assert all(g.version == version for g in groups)
    assert pool.logprob_tolerance() == FP32_LOGPROB_TOLERANCE  # a float32 CPU server
    assert worst_mismatch(groups, requests, policy(version), sampling.temperature) <= FP32_LOGPROB_TOLERANCE
    if name == "greedy":
        assert all(len(set(map(tuple, g.completions))) == 1 for g in groups)
    if name == "filtered":
        # a stop token ends a sample and is its last token; a stop string ends it at the token completing it
        for group in groups:
            for completion, reason in zip(group.completions, group.finish_reasons, strict=True):
                assert STOP_TOKEN not in completion[:-1]
                assert reason in ("stop", "length")
        # whether a sample above stopped is chance (the CPU server ignores seeds): a stop token is also checked on a
        # greedy completion, stopped at the token it holds third, where it must end, as finished by a stop
        greedy = SAMPLINGS["greedy"]
        whole = list(pool.generate(requests[:1], greedy))[0].completions[0]
        stop = whole[min(2, len(whole) - 1)]
        stopped = list(pool.generate(requests[:1], replace(greedy, stop_token_ids=(stop,))))[0]
        assert stopped.completions[0] == whole[: whole.index(stop) + 1]
        assert stopped.finish_reasons[0] == "stop"


@pytest.mark.parametrize("method", ["disk", "tensor", "distributed"])
def test_every_sync_route_loads_the_version_the_server_confirms(pool, method):
    version = (pool.version or 0) + 1
    sync(pool, method, version)
    server = pool._fleet.servers[0]
    assert pool._client.run(pool._weights.reported_version(server)) == str(version)
    sampling = SAMPLINGS["sampled"]
    requests = group_requests(version, prompts=3)
    groups = list(pool.generate(requests, sampling))
    assert worst_mismatch(groups, requests, policy(version), sampling.temperature) <= FP32_LOGPROB_TOLERANCE
    assert worst_mismatch(groups, requests, policy(version - 1), sampling.temperature) > 100 * FP32_LOGPROB_TOLERANCE


def test_closing_the_pool_leaves_no_server_process_and_no_shared_memory_file(spec):
    """Two servers: one stopped by the close (SIGTERM leaves SGLang's files, which it still holds), one that crashed
    before it (SIGKILLed: nothing holds its files any more)."""
    port = free_port()
    while _listening(port + 1):
        port = free_port()
    pool = SGLangRolloutPool(
        servers={"deterministic_inference": False},
        launch={"num_servers": 2, "port": port, "start_timeout_s": 600},
    )
    before = set(Path("/dev/shm").glob("sglang_*"))
    sockets = set(_sockets_in_tmp())
    pool.start(spec)
    pids = pool.launched_pids()
    sync(pool, "tensor", 1)
    list(pool.generate(group_requests(1, prompts=2), SAMPLINGS["greedy"]))
    os.killpg(pids[1], signal.SIGKILL)  # a crash: no process of that server is left to hold its files
    pool.close()
    # SIGKILLed children of the server are reparented to init, which reaps them a moment later
    deadline = time.monotonic() + 30.0
    while (left := [p for p in os.listdir("/proc") if p.isdigit() and _session(int(p)) in pids]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert left == []
    assert set(Path("/dev/shm").glob("sglang_*")) - before == set()
    assert set(_sockets_in_tmp()) - sockets == set()  # SGLang's ZeroMQ sockets: in the pool's work dir, removed


def _sockets_in_tmp() -> list[Path]:
    """ZeroMQ's socket files where a server would put them without its own TMPDIR (the tests' temporary directory)."""
    return [p for p in Path(tempfile.gettempdir()).glob("tmp*") if p.is_socket()]


def _session(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])  # the session id
    except (OSError, IndexError, ValueError):
        return None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
