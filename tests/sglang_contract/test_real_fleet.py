"""Two real SGLang servers on the CPU, shared by this module's tests (a start takes about a minute), driven by fits
of ``tests/helpers/real_sglang_fit.py`` that attach to them: the shared pool under DDP behind the real router, a
LoRA policy synced merged, multi-turn episodes (a pool in this process), then elastic membership (a server joins,
then is SIGKILLed mid-iteration). The elastic test kills server B, so it runs last.

What the servers received is read from their own access logs (uvicorn's, one line per request answered), not from
the pool. SGLang on the CPU ignores per-sample seeds (it refuses --enable-deterministic-inference there), so no
two fits draw the same samples: the weights a fit ends on are compared with a one-process fit trained on the very
groups that fit received (``--replay``). That comparison is what "the same policy as one process" means here:
the same samples, one process, no server, every group's log-probs checked against the replaying trainer's θ_k
at the float32 bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import torch

from sglang_contract.sglang_side import require_sglang

require_sglang()

from helpers.episode_envs import DIGIT_STOPS, TurnTaker  # noqa: E402
from helpers.multi_process import assert_same_policy, free_port  # noqa: E402
from helpers.real_sglang_servers import start_servers, stop_servers  # noqa: E402
from lit_parl.data.prompt_schedule import PromptSchedule  # noqa: E402
from lit_parl.episodes import EpisodeRunner, EpisodeSettings  # noqa: E402
from lit_parl.episodes.episode import turn_seed  # noqa: E402
from lit_parl.models import tiny_qwen2  # noqa: E402
from lit_parl.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from lit_parl.rollout.records import SamplingParams  # noqa: E402
from lit_parl.rollout.sglang import SGLangRolloutPool  # noqa: E402
from lit_parl.rollout.sglang.client import HTTPClient  # noqa: E402
from lit_parl.rollout.sglang.servers import sglang_shm_files  # noqa: E402
from lit_parl.tasks import CopyTask  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "real_sglang_fit.py"
ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP = 8, 4  # per iteration, as real_sglang_fit sets them
# the fits sync by disk (real_sglang_fit's default): one load of the whole checkpoint per push
LOAD = "POST /update_weights_from_disk"


@pytest.fixture(scope="module")
def servers(spec, tmp_path_factory):
    started = start_servers(spec.model_dir, [free_port(), free_port()], tmp_path_factory.mktemp("real_fleet"))
    yield started
    stop_servers(started)


def fit(out: Path, *flags: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), "--out", str(out), *flags]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, start_new_session=True)
    assert result.returncode == 0, result.stderr[-5000:]
    return {
        "policy": torch.load(out / "policy.pt"),
        "ranks": [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))],
    }


def trained(result: dict) -> list[tuple]:
    return sorted(tuple(sample) for rank in result["ranks"] for sample in rank["samples"])


def every_sample(iterations: int) -> list[tuple]:
    return sorted(
        (i, p, s) for i in range(iterations) for p in range(i * PROMPTS, (i + 1) * PROMPTS) for s in range(GROUP)
    )


def reported_version(url: str) -> str:
    with urllib.request.urlopen(url + "/model_info", timeout=10) as answer:
        return json.loads(answer.read())["weight_version"]


def test_two_ranks_share_two_real_servers_behind_the_router(servers, tmp_path):
    """DDP at 2 ranks: rank 0 launches sglang_router in front of both servers and pushes each version once."""
    marks = [s.mark() for s in servers]
    urls = [s.url for s in servers]
    iterations = 3
    ddp = fit(tmp_path / "ddp", "--devices", "2", "--iterations", str(iterations), "--urls", *urls,
              "--router-port", str(free_port()))  # fmt: skip
    replay = fit(tmp_path / "replay", "--iterations", str(iterations), "--replay", str(tmp_path / "ddp"))
    assert_same_policy(ddp["policy"], replay["policy"])
    first, second = (set(map(tuple, rank["samples"])) for rank in ddp["ranks"])
    assert first and second and not first & second, "a sample was trained on both ranks, or one rank trained none"
    assert trained(ddp) == trained(replay) == every_sample(iterations)
    for server, mark in zip(servers, marks, strict=True):
        answered = server.answered(since=mark)
        assert answered.count(LOAD) == iterations, (server.url, Counter(answered))  # one load per iteration
        assert "POST /generate" in answered, "the router sent this server nothing"
        assert reported_version(server.url) == str(iterations - 1)
    # generation went through the router only, from both ranks
    assert all(url not in urls for rank in ddp["ranks"] for url, _, _ in rank["generates"])
    assert all(rank["generates"] for rank in ddp["ranks"])


def test_a_lora_policy_reaches_a_real_server_merged(servers, tmp_path):
    """pool.sync.lora=merged (SGLang's CPU path cannot serve adapters: test_real_lora_refused): every group the
    server sampled has the log-probs of the merged policy θ_k = base + (α / r) B A at the float32 bound."""
    iterations = 2
    lora = fit(tmp_path / "lora", "--iterations", str(iterations), "--urls", servers[0].url, "--lora")
    replay = fit(tmp_path / "replay", "--iterations", str(iterations), "--lora", "--replay", str(tmp_path / "lora"))
    assert_same_policy(lora["policy"], replay["policy"])
    assert trained(lora) == every_sample(iterations)
    moved = [name for name in lora["policy"] if "lora_B" in name and lora["policy"][name].abs().max() > 0]
    assert moved, "the adapters did not train: merged and base weights would be the same"
    assert reported_version(servers[0].url) == str(iterations - 1)


def test_an_episodes_turns_continue_on_the_real_server_that_holds_its_prefix(servers, spec):
    """Multi-turn episodes (``TurnTaker``) over a pool attached to both servers: every turn of an episode goes to one
    server, the episodes spread over both, and each continuation finds its episode so far in that server's prefix
    cache: SGLang reports ``cached_tokens`` ≥ the previous turn's whole input."""
    sent = []  # (server, input ids, seed, cached tokens SGLang reports) of each /generate
    original = HTTPClient._request

    async def _request(self, method, url, payload, timeout):
        answer = await original(self, method, url, payload, timeout)
        if url.endswith("/generate"):
            seed, cached = payload["sampling_params"]["sampling_seed"], answer["meta_info"]["cached_tokens"]
            sent.append((url.rsplit("/", 1)[0], payload["input_ids"], seed, cached))
        return answer

    pool = SGLangRolloutPool(
        servers={"urls": [s.url for s in servers], "deterministic_inference": False}, sync={"method": "disk"}
    )
    with mock.patch.object(HTTPClient, "_request", _request):
        pool.start(spec)
        try:
            named = list(tiny_qwen2(seed=0)[0].named_parameters())
            pool.sync_weights([named], version=100)
            tok = build_char_tokenizer()
            drawn = PromptSchedule(CopyTask(seed=0), tok, group_size=4).draw(list(range(6)), version=100)
            runner = EpisodeRunner(EpisodeSettings(TurnTaker, max_turns=4, max_episode_tokens=40), tok)
            sampling = SamplingParams(max_new_tokens=6, stop_token_ids=DIGIT_STOPS)
            groups = list(runner.generate(pool, [d.request for d in drawn.values()], sampling, drawn))
        finally:
            pool.close()
    servers_of, continued = {}, 0
    for group in groups:
        request = drawn[group.prompt_id].request
        for sample, tokens, episode in zip(group.sample_indices, group.completions, group.episodes, strict=True):
            whole = [*request.prompt_tokens, *tokens]
            seeds = [turn_seed(request.seeds[sample], t) for t in range(4)]
            model_turns = sum(1 for role, _ in episode.turns if role == "assistant")
            turns = [[x for x in sent if x[2] == seeds[t] and whole[: len(x[1])] == x[1]] for t in range(model_turns)]
            assert all(len(found) == 1 for found in turns), (group.prompt_id, sample)
            turns = [found[0] for found in turns]
            servers_of[(group.prompt_id, sample)] = {server for server, *_ in turns}
            for previous, turn in zip(turns, turns[1:]):
                assert turn[3] >= len(previous[1]), "a continuation did not find its episode in the server's cache"
                continued += 1
    assert continued > 0, "no episode had a second turn"
    assert all(len(used) == 1 for used in servers_of.values()), "an episode's turns went to two servers"
    assert set().union(*servers_of.values()) == {s.url for s in servers}, "the episodes did not spread over both"


def test_a_real_server_joins_then_is_killed_mid_iteration(servers, tmp_path):
    """One process, 4 iterations, attached to A. B is added to the membership file during iteration 0 and joins at
    version 1's push; it is SIGKILLed just before its second request of version 2 (the first may be in flight).
    B must load θ_1 before answering any request; every sample is trained once; the weights are those of one
    process trained on the same groups without any failure."""
    a, b = servers
    mark = b.mark()
    held = sglang_shm_files([b.process.pid])  # its load snapshot: a killed server cannot remove it
    assert held, "B holds no /dev/shm/sglang_* file: nothing to check"
    listing = tmp_path / "servers.txt"
    listing.write_text(f"{a.url}\n")
    iterations = 4
    flags = ("--iterations", str(iterations), "--urls", a.url, "--membership", str(listing))
    run = fit(tmp_path / "elastic", *flags, "--join-at", "1", b.url, "--kill", b.url, str(b.process.pid), "2", "2")
    replay = fit(tmp_path / "replay", "--iterations", str(iterations), "--replay", str(tmp_path / "elastic"))
    assert b.process.wait(timeout=30) == -9, "B was not killed"
    assert not [path for path in held if path.exists()], "the killed server's shared-memory file was left behind"
    assert_same_policy(run["policy"], replay["policy"])
    assert trained(run) == every_sample(iterations), "a sample was lost or trained twice"
    answered = b.answered(since=mark)
    assert "POST /generate" in answered, "B answered no request"
    before_first = answered[: answered.index("POST /generate")]
    assert LOAD in before_first and "GET /model_info" in before_first, before_first
    assert answered.count(LOAD) == 2, Counter(answered)  # θ_1, θ_2; dead before θ_3
    sent = Counter({(url, version): n for url, version, n in run["ranks"][0]["generates"]})
    assert {v for (url, v) in sent if url == b.url} == {1, 2}, sent  # nothing before it joined, nothing once dead
    assert {v for (url, v) in sent if url == a.url} == set(range(iterations))
    assert run["ranks"][0]["pool_urls"] == [a.url]
