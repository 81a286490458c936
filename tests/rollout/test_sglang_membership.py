"""Servers that join and leave an SGLang pool between iterations (``lit_parl.rollout.sglang.membership``), against
stand-in servers (tests/helpers/sglang_standin.py) that journal every weight load and every sample they draw.

The 2-rank run with a server joining at iteration 2 and another dying mid-iteration 4 is in
tests/system/test_shared_pool.py. The tests that start stand-ins run in ``make test-slow``."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

from helpers.multi_process import free_port
from helpers.sglang_pools import SAMPLING, alive, buckets, launch_standin, requests_for, start_pool, sync_by
from lit_parl.rollout.sglang import SGLangRolloutPool
from lit_parl.rollout.sglang.membership import Membership, read_membership_file
from lit_parl.rollout.sglang.servers import ServerFleet

pytest.importorskip("aiohttp")

STANDINS = pytest.mark.slow  # make test-slow: each starts stand-in servers (a few seconds each)


def events(journal: Path) -> list[dict]:
    return [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_bad_membership_file_names_the_line_and_the_fix(tmp_path):
    path = tmp_path / "servers.txt"
    path.write_text("http://infer1:30000 2\n# a comment\n\nhttp://infer2:30000/  # trailing slash\n")
    assert read_membership_file(path) == {"http://infer1:30000": 2.0, "http://infer2:30000": 1.0}
    path.write_text("http://infer1:30000\ninfer2:30000\n")
    with pytest.raises(ValueError, match=r"servers.txt:2: 'infer2:30000' is not 'URL \[capacity\]'"):
        read_membership_file(path)
    path.write_text("http://infer1:30000 0\n")
    with pytest.raises(ValueError, match=r"servers.txt:1: capacity '0' must be a positive number"):
        read_membership_file(path)
    with pytest.raises(ValueError, match=r"add_server\('infer1'\): give the server's URL"):
        SGLangRolloutPool().add_server("infer1")
    # read at a push of a running fit: a typo does not stop it, and changes nothing
    path.write_text("http://infer1:30000\ninfer2:30000\n")
    with pytest.warns(RuntimeWarning, match=r"servers.txt:2: .* the SGLang servers stay as they are"):
        assert Membership(path).asked({"http://infer0:30000": 1.0}) == ({}, set())


def test_a_membership_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "servers.txt"
    path.write_bytes(b"http://infer1:30000\nhttp://infer2:30000 \xff2\n")  # a stray Latin-1 byte on line 2
    with pytest.warns(RuntimeWarning, match=r"servers.txt:2: not UTF-8 text .* the SGLang servers stay as they are"):
        assert Membership(path).asked({"http://infer0:30000": 1.0}) == ({}, set())


def test_requests_are_spread_by_capacity(tmp_path):
    fleet = ServerFleet(tmp_path)
    fleet.attach(["http://a:1", "http://b:1", "http://c:1"], [3.0, 1.0, 2.0])
    for _ in range(60):  # requests sent and not answered yet
        fleet.pick().in_flight += 1
    assert [server.in_flight for server in fleet.servers] == [30, 10, 20]


@STANDINS
def test_servers_join_and_leave_at_a_push_and_a_joiner_holds_the_version_before_its_first_draw(saved_model, tmp_path):
    """A launched server, and a server started elsewhere that the membership file brings in at version 1 (with
    three times the capacity) and takes out at version 2; then one asked for from Python that does not answer."""
    model, spec, model_dir = saved_model
    journal, listing = tmp_path / "journal", tmp_path / "servers.txt"
    joiner, joiner_url = launch_standin(model_dir, "--journal", str(journal))
    launch, servers = {"args": ["--journal", str(journal)]}, {"membership_file": str(listing)}
    pool = start_pool(spec, launch=launch, servers=servers, sync=sync_by("tensor"))
    launched = port_of(pool.health().details["urls"][0])
    try:
        pool.sync_weights(buckets(model), version=0)  # no file yet: nothing changes
        assert len(list(pool.generate(requests_for(0, prompts=4), SAMPLING))) == 4
        listing.write_text(f"{joiner_url} 3\n")
        pool.sync_weights(buckets(model), version=1)
        assert pool.health().workers == 2
        groups = list(pool.generate(requests_for(1, prompts=8), SAMPLING))
        assert sorted(g.prompt_id for g in groups) == list(range(8)) and {g.version for g in groups} == {1}
        listing.write_text("# every attached server leaves\n")
        pool.sync_weights(buckets(model), version=2)
        assert pool.health().workers == 1 and joiner.poll() is None, "an attached server that leaves is not stopped"
        assert len(list(pool.generate(requests_for(2, prompts=4), SAMPLING))) == 4
        pool.add_server(f"http://127.0.0.1:{free_port()}")  # nothing listens there
        with pytest.warns(RuntimeWarning, match="does not answer /health, so it was not added"):
            pool.sync_weights(buckets(model), version=3)
        assert pool.health().workers == 1
    finally:
        pool.close()
        joiner.kill()
        joiner.wait()
    seen = events(journal)
    loads = Counter((e["port"], e["version"]) for e in seen if e["event"] == "load")
    draws = Counter((e["port"], e["version"]) for e in seen if e["event"] == "generate")
    joined = port_of(joiner_url)
    assert {v for (p, v) in loads if p == joined} == {"1"}, "the joiner loads θ_1 only: it joined at 1, left at 2"
    assert {v for (p, v) in draws if p == joined} == {"1"}
    first_draw = next(i for i, e in enumerate(seen) if e["port"] == joined and e["event"] == "generate")
    first_load = next(i for i, e in enumerate(seen) if e["port"] == joined and e["event"] == "load")
    assert first_load < first_draw, "the joiner drew a sample before it held the iteration's weights"
    # capacity 3 against 1: the joiner takes most of version 1's 32 samples
    assert draws[(joined, "1")] > 2 * draws.get((launched, "1"), 0) > 0, draws
    assert draws[(launched, "0")] == draws[(launched, "2")] == 16, "version 0 and 2: the launched server alone"


@STANDINS
def test_a_launched_server_that_leaves_is_stopped(saved_model):
    model, spec, _ = saved_model
    pool = start_pool(spec, launch={"num_servers": 2}, sync=sync_by("tensor"))
    try:
        leaving_url, leaving_pid = pool.health().details["urls"][1], pool.launched_pids()[1]
        pool.remove_server(leaving_url)
        pool.sync_weights(buckets(model), version=0)
        assert leaving_url not in pool.health().details["urls"] and pool.health().workers == 1
        assert not alive(leaving_pid) and len(pool.launched_pids()) == 1
        assert len(list(pool.generate(requests_for(0, prompts=2), SAMPLING))) == 2
    finally:
        pool.close()


@STANDINS
def test_a_rank_that_joined_the_pool_follows_the_servers_rank_0_pushed_to(saved_model, tmp_path):
    model, spec, model_dir = saved_model
    journal = tmp_path / "journal"
    extra, extra_url = launch_standin(model_dir, "--journal", str(journal))
    owner = start_pool(spec, sync=sync_by("tensor"))
    joined = SGLangRolloutPool()
    try:
        joined.join(spec, owner.address())
        owner.add_server(extra_url)
        owner.sync_weights(buckets(model), version=0)
        joined.adopt_version(0, owner.address())
        assert joined.health().details["urls"] == owner.health().details["urls"] and joined.health().workers == 2
        assert len(list(joined.generate(requests_for(0, prompts=8), SAMPLING))) == 8
        assert any(e["event"] == "generate" for e in events(journal)), "the joined rank never used the new server"
        owner.remove_server(extra_url)
        owner.sync_weights(buckets(model), version=1)
        joined.adopt_version(1, owner.address())
        assert joined.health().workers == 1 and extra_url not in joined.health().details["urls"]
    finally:
        joined.close()
        owner.close()
        extra.kill()
        extra.wait()


@STANDINS
def test_a_pool_whose_servers_are_fixed_refuses_a_change_with_a_warning(saved_model):
    """The distributed sync's NCCL group is formed once: a server cannot join it later."""
    model, spec, model_dir = saved_model
    extra, extra_url = launch_standin(model_dir)
    pool = start_pool(spec, sync=sync_by("distributed"))
    try:
        pool.add_server(extra_url)
        with pytest.warns(RuntimeWarning, match=r"not added .* the distributed sync's NCCL group is formed once"):
            pool.sync_weights(buckets(model), version=0)
        assert pool.health().workers == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # asked once: nothing is left to refuse at the next push
            pool.sync_weights(buckets(model), version=1)
    finally:
        pool.close()
        extra.kill()
        extra.wait()


@STANDINS
def test_the_membership_is_logged_at_each_push(saved_model, caplog):
    model, spec, _ = saved_model
    pool = start_pool(spec, sync=sync_by("tensor"))
    try:
        with caplog.at_level("INFO", logger="lit_parl"):
            pool.sync_weights(buckets(model), version=0)
    finally:
        pool.close()
    assert "SGLang pool, version 0: 1 server(s) [http://127.0.0.1:" in caplog.text and "joined []" in caplog.text
