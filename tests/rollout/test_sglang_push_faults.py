"""The SGLang pool's push when servers join, fail or die: who gets the weights, who is left out, and when the run
stops. The fast tests drive the pool's push with its HTTP calls replaced; the ones marked slow push to stand-in
servers (tests/helpers/sglang_standin.py) that die at a chosen route."""

from __future__ import annotations

import asyncio
import warnings

import pytest
import torch

from helpers.sglang_pools import SAMPLING, attached, buckets, launch_standin, requests_for
from lit_parl.rollout import PoolSpec
from lit_parl.rollout.sglang import SGLangRolloutPool
from lit_parl.rollout.sglang.client import ServerError
from lit_parl.rollout.sglang.servers import ServerFleet
from lit_parl.rollout.sglang.weights import WeightUpdater

pytest.importorskip("aiohttp")

SPEC = PoolSpec(model_dir="unused", eos_id=1, pad_id=0)
WEIGHTS = [[("w", torch.zeros(1))]]


class AnswersHealth:
    """The pool's HTTP client, where every server answers ``/health``."""

    def run(self, coroutine):
        return asyncio.run(coroutine)

    async def get(self, url, path, timeout=None):
        return {"enable_deterministic_inference": True}  # /health's answer is not read

    def close(self):
        pass


class Recorder:
    """The pool's weight updater: which live servers each push went to."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, list[str]]] = []

    def sync(self, method, servers, everyone, buckets, version):
        self.pushed.append((version, [s.url for s in servers]))

    def close(self, servers):
        pass


class RecordedPool(SGLangRolloutPool):
    """An SGLang pool attached to ``servers.urls`` whose push is recorded instead of sent."""

    def _start(self, spec):
        self._fleet = ServerFleet("unused")
        self._fleet.attach(list(self.servers.urls))
        self._client, self._weights = AnswersHealth(), Recorder()


def test_a_server_that_joins_at_a_push_gets_that_push():
    """Added after the weights went out, it would serve the iteration with no weights (or the last ones)."""
    pool = RecordedPool(servers={"urls": ["http://a:1"]}, sync={"method": "tensor"})
    pool.start(SPEC)
    try:
        pool.add_server("http://b:1")
        pool.sync_weights(WEIGHTS, version=0)
        assert pool._weights.pushed == [(0, ["http://a:1", "http://b:1"])]
    finally:
        pool.close()


def test_a_server_another_rank_saw_fail_leaves_at_the_next_push_with_a_warning():
    pool = RecordedPool(servers={"urls": ["http://a:1", "http://b:1"]}, sync={"method": "tensor"})
    pool.start(SPEC)
    try:
        assert pool.failed_engines() == []
        with pytest.warns(RuntimeWarning, match=r"SGLang server http://b:1 failed another rank's requests"):
            pool.mark_failed(["http://b:1"])
        assert pool.failed_engines() == ["http://b:1"]
        pool.sync_weights(WEIGHTS, version=0)
        assert pool._weights.pushed == [(0, ["http://a:1"])] and pool.health().details["urls"] == ["http://a:1"]
    finally:
        pool.close()


class Servers(AnswersHealth):
    """The pool's HTTP client, before servers that take a ``disk`` push; a URL in ``dead`` refuses every connection
    once it received a request to ``dead[url]``; one in ``refusing`` answers /health but fails every update."""

    def __init__(self, dead: dict[str, str], refusing: tuple[str, ...] = ()) -> None:
        self.dead, self.refusing, self.gone = dead, refusing, set()
        self.versions: dict[str, str] = {}

    async def post(self, url, path, payload, timeout=None):
        if url in self.gone or self.dead.get(url) == path:
            self.gone.add(url)
            raise ConnectionError(f"POST {url}{path}: Cannot connect")
        if url in self.refusing and path == "/update_weights_from_disk":
            raise ServerError(f"POST {url}{path}: HTTP 500")
        if path == "/update_weights_from_disk":
            self.versions[url] = payload["weight_version"]
        return {"success": True}

    async def get(self, url, path, timeout=None):
        if url in self.gone:
            raise ConnectionError(f"GET {url}{path}: Cannot connect")
        return {"weight_version": self.versions.get(url)} if path == "/model_info" else "ok"


class FaultyPool(SGLangRolloutPool):
    """An SGLang pool attached to ``servers.urls`` that pushes by ``disk`` through ``Servers``."""

    def __init__(self, client: Servers, sync_dir, **settings) -> None:
        super().__init__(sync={"method": "disk"}, **settings)
        self.client, self.sync_dir = client, sync_dir

    def _start(self, spec):
        self._fleet = ServerFleet("unused")
        self._fleet.attach(list(self.servers.urls))
        self._client = self.client
        self._weights = WeightUpdater(self.client, self.sync_dir, self.sync_dir, 1, self.sync)
        self._weights.fanout.lose = self._lose_in_push


def test_a_server_that_dies_during_the_push_leaves_it_and_the_push_completes_on_the_others(tmp_path):
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    client = Servers(dead={"http://b:1": "/pause_generation", "http://c:1": "/update_weights_from_disk"})
    pool = FaultyPool(client, tmp_path, servers={"urls": urls})
    pool.start(SPEC)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool.sync_weights(WEIGHTS, version=0)
        said = [str(w.message) for w in caught]
        assert [m.split(" (")[0] for m in said] == [
            f"SGLang server http://{h}:1 failed during the weight push" for h in "bc"
        ]
        assert pool.version == 0 and client.versions == {"http://a:1": "0"}
        assert pool.health().alive == 1 and pool.address()["urls"] == ["http://a:1"]
        client.gone.add("http://a:1")
        with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"no live server is left"):
            pool.sync_weights(WEIGHTS, version=1)
    finally:
        pool.close()


def test_a_server_that_refuses_the_push_but_is_up_fails_it(tmp_path):
    """Only a server that is down leaves the push; one that answers /health and refuses is the push's error."""
    client = Servers(dead={}, refusing=("http://b:1",))
    pool = FaultyPool(client, tmp_path, servers={"urls": ["http://a:1", "http://b:1"]})
    pool.start(SPEC)
    try:
        with warnings.catch_warnings(), pytest.raises(ServerError, match="HTTP 500"):
            warnings.simplefilter("error")  # and no warning says it was dropped
            pool.sync_weights(WEIGHTS, version=0)
    finally:
        pool.close()


STANDINS = pytest.mark.slow  # make test-slow: each starts stand-in servers (a few seconds each)


@STANDINS
@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_servers_that_die_between_iterations_or_during_the_push_leave_it_and_the_run_goes_on(saved_model, method):
    """Three attached servers: one killed between two pushes, one that dies at the pause of the second push,
    one that dies at its second weight update. The pushes complete on the one left, which generates every group
    of each iteration; when it dies too, the push stops with an error naming the lost servers."""
    model, spec, model_dir = saved_model
    # the first update of the second push: one per bucket (tensor), or one per push (disk)
    update = (
        f"/update_weights_from_tensor:{len(buckets(model)) + 1}"
        if method == "tensor"
        else "/update_weights_from_disk:2"
    )
    killed, killed_url = launch_standin(model_dir)
    paused, paused_url = launch_standin(model_dir, "--die-at", "/pause_generation:2")
    updating, updating_url = launch_standin(model_dir, "--die-at", update)
    last, last_url = launch_standin(model_dir)
    processes = [killed, paused, updating, last]
    pool = attached([killed_url, paused_url, updating_url, last_url], method=method)
    pool.start(spec)
    try:
        pool.sync_weights(buckets(model), version=0)
        assert len(list(pool.generate(requests_for(0, prompts=4), SAMPLING))) == 4
        killed.kill()
        killed.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool.sync_weights(buckets(model), version=1)
        said = " ".join(str(w.message) for w in caught)
        for url in (killed_url, paused_url, updating_url):
            assert f"SGLang server {url} failed during the weight push" in said, said
        health = pool.health()
        assert pool.version == 1 and (health.workers, health.alive) == (4, 1) and health.details["urls"][-1] == last_url
        groups = list(pool.generate(requests_for(1, prompts=4), SAMPLING))
        assert sorted(g.prompt_id for g in groups) == [0, 1, 2, 3] and {g.version for g in groups} == {1}
        pool.sync_weights(buckets(model), version=2)  # the next push drops the dead servers from the pool
        assert pool.health().details["urls"] == [last_url]
        last.kill()
        last.wait()
        with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"no live server is left"):
            pool.sync_weights(buckets(model), version=3)
    finally:
        pool.close()
        for process in processes:
            process.kill()
            process.wait()
