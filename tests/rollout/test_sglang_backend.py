"""The SGLang pool against a stand-in server (tests/helpers/sglang_standin.py: SGLang's endpoints over a tiny
transformers model; it is not SGLang, which needs a GPU). What is checked here is the pool's side of the
protocol: launch and attach, the three weight-sync methods and their confirmation, generation with
per-sample seeds and log-probs, stop strings and greedy decoding, the finish reasons, retries when a
server dies, clear errors, and a training run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import fields, replace
from inspect import signature
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from omegaconf.errors import MissingMandatoryValue

from helpers.multi_process import free_port
from helpers.sampling_references import argmax_loop, filtered_distribution, stop_strings_for
from helpers.sglang_pools import (
    SAMPLING,
    STANDIN,
    alive,
    attached,
    buckets,
    launch_standin,
    requests_for,
    start_pool,
    sync_by,
)
from lit_parl.models import tiny_qwen2
from lit_parl.rollout.records import GroupCompletions, SamplingParams
from lit_parl.rollout.sampling import sample_groups
from lit_parl.rollout.sglang import (
    LaunchSettings,
    MalformedResponse,
    RequestSettings,
    RouterSettings,
    ServerSettings,
    SGLangRolloutPool,
    SyncSettings,
)
from lit_parl.rollout.sglang.commands import server_command
from lit_parl.rollout.sglang.messages import Ends, parse_group

pytest.importorskip("aiohttp")


def trainer_logprobs(model, prompt: tuple[int, ...], completion: list[int], temperature: float) -> torch.Tensor:
    """The trainer's view: log p(completion | prompt) at logits / T, from one plain forward pass."""
    ids = torch.tensor([list(prompt) + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ------------------------------------------------------------------------------------------------------
# start: launch, attach, and the errors when a server is not there
# ------------------------------------------------------------------------------------------------------
def test_attaching_to_a_server_that_is_down_names_its_url(spec):
    url = f"http://127.0.0.1:{free_port()}"
    pool = attached([url], attach_timeout_s=1.5)
    with pytest.raises(RuntimeError, match=f"SGLang server {url} is not healthy"):
        pool.start(spec)
    assert pool.health().workers == 0


def test_a_launched_server_that_exits_reports_its_log(spec):
    with pytest.raises(RuntimeError, match=r"exited with code 3 while starting(.|\n)*exiting at start as asked"):
        start_pool(spec, launch={"command": [*STANDIN, "--exit-at-start"]})


def test_bad_configuration_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"SyncSettings\(method='nccl'\): choose one of"):
        SGLangRolloutPool(sync={"method": "nccl"})
    expected = (
        r"SGLangRolloutPool\(gpu_ids=\[0, 1\]\): 2 GPU id\(s\) for 2 worker\(s\); "
        r"give launch.num_servers \* servers.tp_size = 2 \* 2 = 4"
    )
    with pytest.raises(ValueError, match=expected):
        SGLangRolloutPool(servers={"tp_size": 2}, launch={"num_servers": 2, "gpu_ids": [0, 1]})
    with pytest.raises(ValueError, match=r"GPU 1 is given to workers 0 and 1"):
        SGLangRolloutPool(launch={"num_servers": 2, "gpu_ids": [1, 1]})
    with pytest.raises(ValueError, match=r"ServerSettings\(urls=\[\]\): give a list of server URLs"):
        SGLangRolloutPool(servers={"urls": []})
    with pytest.raises(ValueError, match=r"LaunchSettings\(num_servers=0\): at least one server"):
        SGLangRolloutPool(launch={"num_servers": 0})
    with pytest.raises(ValueError, match=r"RequestSettings\(max_retries=-1\): must be >= 0"):
        SGLangRolloutPool(requests={"max_retries": -1})
    # attached servers have GPUs of their own: the launch's placement is not checked against them
    placed_elsewhere = SGLangRolloutPool(servers={"urls": ["http://a:1"]}, launch={"gpu_ids": [1, 1]})
    assert placed_elsewhere.servers.urls == ("http://a:1",)


# ------------------------------------------------------------------------------------------------------
# weight sync by each method: confirmed version, outputs of exactly the synced weights
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["tensor", "distributed", "disk"])
def test_each_sync_method_serves_exactly_the_synced_weights(method, spec):
    model, tokenizer = tiny_qwen2(seed=0)
    pool = start_pool(spec, launch={"num_servers": 2}, sync=sync_by(method))
    pids = pool.launched_pids()
    try:
        assert len(pids) == 2 and all(alive(p) for p in pids)
        pool.sync_weights(buckets(model), version=0)
        assert pool.version == 0
        groups = {g.prompt_id: g for g in pool.generate(requests_for(0), SAMPLING)}
        assert sorted(groups) == [0, 1, 2, 3] and {g.version for g in groups.values()} == {0}
        assert all(type(g) is GroupCompletions for g in groups.values())  # unscored: the trainer scores
        request = requests_for(0)[0]
        for completion, logprobs in zip(groups[0].completions, groups[0].logprobs):
            expected = trainer_logprobs(model, request.prompt_tokens, completion, 0.7)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
        # distinct seeds within a group give distinct samples; the same seeds give the same samples
        assert len({tuple(c) for g in groups.values() for c in g.completions}) > 4
        again = {g.prompt_id: g for g in pool.generate(requests_for(0), SAMPLING)}
        assert all(again[i].completions == groups[i].completions for i in groups)

        # version 1: other weights; the servers must serve exactly those
        changed, _ = tiny_qwen2(seed=1)
        pool.sync_weights(buckets(changed), version=1)
        after = {g.prompt_id: g for g in pool.generate(requests_for(1), SAMPLING)}
        assert {g.version for g in after.values()} == {1}
        for completion, logprobs in zip(after[0].completions, after[0].logprobs):
            served = torch.tensor(logprobs)
            expected = trainer_logprobs(changed, request.prompt_tokens, completion, 0.7)
            torch.testing.assert_close(served, expected, atol=1e-4, rtol=0)
            before = trainer_logprobs(model, request.prompt_tokens, completion, 0.7)
            assert not torch.allclose(served, before, atol=1e-3)
    finally:
        pool.close()
    assert not any(alive(p) for p in pids)


def test_a_version_the_servers_do_not_confirm_is_an_error(saved_model):
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir, "--stale-version")
    pool = attached([url], "disk")
    try:
        pool.start(spec)
        with pytest.raises(RuntimeError, match=rf"sync to version 0 was not confirmed: .*'{url}', 'default'"):
            pool.sync_weights(buckets(model), version=0)
        assert pool.version is None
        with pytest.raises(RuntimeError, match="no confirmed weights"):
            next(pool.generate(requests_for(0), SAMPLING))
    finally:
        pool.close()
        process.kill()
        process.wait()


@pytest.mark.parametrize("method", ["tensor", "disk"])
def test_an_sglang_from_before_update_sessions_is_detected_and_synced(method, saved_model):
    """An SGLang without ``/begin_weight_update`` and without ``weight_version`` in ``/model_info`` (the stand-in's
    ``--legacy-api``): the pool learns it from the 404s, updates without a session, and confirms the version
    through ``/get_weight_version``. The default stand-in (current SGLang) has neither that route nor updates
    outside a session, so the other sync tests need the session and ``/model_info``."""
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir, "--legacy-api")
    pool = attached([url], method)
    try:
        pool.start(spec)
        for version, seed in enumerate((0, 1)):
            weights, _ = tiny_qwen2(seed=seed)
            pool.sync_weights(buckets(weights), version=version)
            assert pool.version == version
            assert {g.version for g in pool.generate(requests_for(version), SAMPLING)} == {version}
    finally:
        pool.close()
        process.kill()
        process.wait()


def test_a_session_left_open_by_a_stopped_trainer_is_closed_and_the_sync_goes_on(saved_model):
    """A trainer that died between /begin_weight_update and /end_weight_update leaves the server in a session,
    where SGLang refuses a new begin: the next pool closes it once and syncs."""
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir)
    try:
        begin = urllib.request.Request(
            url + "/begin_weight_update", data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
        )
        urllib.request.urlopen(begin, timeout=10).read()
        pool = attached([url])
        try:
            pool.start(spec)
            pool.sync_weights(buckets(model), version=0)
            assert pool.version == 0 and {g.version for g in pool.generate(requests_for(0), SAMPLING)} == {0}
        finally:
            pool.close()
    finally:
        process.kill()
        process.wait()


def test_seeds_hold_only_on_servers_with_deterministic_inference_and_an_attached_one_without_is_named(saved_model):
    """SGLang honours ``sampling_seed`` only under ``--enable-deterministic-inference``: the pool launches its servers
    with it (the same seeds then give the same samples, as the sync tests check), and warns about an attached
    server without it, whose samples do not follow their seeds; ``deterministic_inference=False`` accepts that."""
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir, deterministic=False)
    try:
        pool = attached([url], "disk")
        with pytest.warns(UserWarning, match=rf"\['{url}'\] do not report --enable-deterministic-inference"):
            pool.start(spec)
        try:
            pool.sync_weights(buckets(model), version=0)

            def drawn() -> list[tuple[int, ...]]:
                return sorted(tuple(c) for g in pool.generate(requests_for(0), SAMPLING) for c in g.completions)

            first, again = drawn(), drawn()
            assert first != again, "the server followed the seeds without the flag: the stand-in is laxer than SGLang"
        finally:
            pool.close()
        quiet = attached([url], "disk", deterministic_inference=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            quiet.start(spec)
        quiet.close()
    finally:
        process.kill()
        process.wait()
    launch = LaunchSettings(command=["sglang"])
    assert "--enable-deterministic-inference" in server_command(launch, "m", 1, 1, deterministic_inference=True)
    assert "--enable-deterministic-inference" not in server_command(launch, "m", 1, 1, deterministic_inference=False)


def test_an_unknown_launch_flag_stops_the_standin_as_it_stops_sglang(spec):
    refused = r"exited with code 2 while starting(.|\n)*unrecognized arguments: --no-such-flag"
    with pytest.raises(RuntimeError, match=refused):
        start_pool(spec, launch={"args": ["--no-such-flag"]})


def test_requests_of_another_version_are_refused(spec):
    model, tokenizer = tiny_qwen2()
    pool = start_pool(spec, sync=sync_by("disk"))
    try:
        pool.sync_weights(buckets(model), version=3)
        with pytest.raises(RuntimeError, match=r"version gate: requests for policy version\(s\) \[2\]"):
            next(pool.generate(requests_for(2), SAMPLING))
    finally:
        pool.close()


# ------------------------------------------------------------------------------------------------------
# which distribution the log-probs refer to: the full softmax at T, whatever top-k/top-p drew
# ------------------------------------------------------------------------------------------------------
def test_under_top_k_and_top_p_the_logprobs_are_the_full_softmax_at_t(spec):
    peaked, _ = tiny_qwen2(seed=0)
    with torch.no_grad():
        peaked.model.norm.weight.mul_(3.0)  # logits 3x: a random init is too flat for top-p or T to show
    sampling = SamplingParams(max_new_tokens=5, temperature=0.7, top_k=6, top_p=0.8)
    pool = start_pool(spec)
    try:
        pool.sync_weights(buckets(peaked), version=0)
        requests = requests_for(0, prompts=3)
        groups = {g.prompt_id: g for g in pool.generate(requests, sampling)}
    finally:
        pool.close()
    for request in requests:
        for completion, logprobs in zip(groups[request.prompt_id].completions, groups[request.prompt_id].logprobs):
            expected = trainer_logprobs(peaked, request.prompt_tokens, completion, 0.7)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
            with torch.no_grad():
                ids = torch.tensor([[*request.prompt_tokens, *completion]])
                logits = peaked(ids).logits[0, len(request.prompt_tokens) - 1 : -1]
            for t, token in enumerate(completion):
                kept = filtered_distribution(logits[t], 0.7, 6, 0.8)
                assert token in kept, f"token {token} at step {t} is outside the filtered set {sorted(kept)}"


def test_sglang_return_original_logprob_is_refused_when_launching(saved_model, monkeypatch):
    """With it, SGLang reports log-probs before the temperature (the stand-in too, shown on an attached
    server, whose environment the pool cannot see)."""
    model, spec, model_dir = saved_model
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "True")
    pool = SGLangRolloutPool(launch={"command": STANDIN, "port": free_port()})
    refused = r"SGLANG_RETURN_ORIGINAL_LOGPROB=True is set: .* before temperature, .* Unset"
    with pytest.raises(ValueError, match=refused):
        pool.start(spec)
    assert pool.health().workers == 0

    process, url = launch_standin(model_dir)  # inherits the variable
    pool = attached([url], "disk")
    try:
        pool.start(spec)
        pool.sync_weights(buckets(model), version=0)
        (request,) = requests_for(0, prompts=1, group_size=2)
        (group,) = pool.generate([request], SAMPLING)
    finally:
        pool.close()
        process.kill()
        process.wait()
    for completion, logprobs in zip(group.completions, group.logprobs):
        served = torch.tensor(logprobs)
        before_t = trainer_logprobs(model, request.prompt_tokens, completion, 1.0)
        torch.testing.assert_close(served, before_t, atol=1e-4, rtol=0)
        at_t = trainer_logprobs(model, request.prompt_tokens, completion, SAMPLING.temperature)
        assert not torch.allclose(served, at_t, atol=1e-4)


# ------------------------------------------------------------------------------------------------------
# failures while generating
# ------------------------------------------------------------------------------------------------------
def test_a_server_dying_mid_iteration_loses_and_duplicates_nothing(saved_model):
    """Two attached servers; one crashes while answering its third request. Its groups are generated again
    on the other server, every prompt comes back exactly once, with the same samples it would have had."""
    model, spec, model_dir = saved_model
    dying, dying_url = launch_standin(model_dir, "--die-after-generates", "2")
    healthy, healthy_url = launch_standin(model_dir)
    pool = attached([dying_url, healthy_url], "disk", requests={"max_retries": 2})
    try:
        pool.start(spec)
        pool.sync_weights(buckets(model), version=0)
        with pytest.warns(RuntimeWarning, match=f"SGLang server {dying_url} is down"):
            groups = list(pool.generate(requests_for(0, prompts=12), SAMPLING))
        assert sorted(g.prompt_id for g in groups) == list(range(12))
        assert pool.health().alive == 1
        # seeds make a group independent of the server that generated it
        reference = {g.prompt_id: g.completions for g in pool.generate(requests_for(0, prompts=12), SAMPLING)}
        assert all(g.completions == reference[g.prompt_id] for g in groups)
    finally:
        pool.close()
        assert healthy.poll() is None, "close() must leave attached servers running"
        for process in (dying, healthy):
            process.kill()
            process.wait()


def test_the_last_server_dying_is_a_clear_error(saved_model):
    model, spec, model_dir = saved_model
    dying, url = launch_standin(model_dir, "--die-after-generates", "1")
    pool = attached([url], "disk", requests={"max_retries": 2})
    try:
        pool.start(spec)
        pool.sync_weights(buckets(model), version=0)
        with pytest.raises(RuntimeError, match="no live SGLang server left"), pytest.warns(RuntimeWarning):
            list(pool.generate(requests_for(0, prompts=4), SAMPLING))
    finally:
        pool.close()
        dying.kill()
        dying.wait()


def test_a_malformed_response_is_a_clear_error(saved_model):
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir, "--malformed")
    pool = attached([url], "disk")
    try:
        pool.start(spec)
        pool.sync_weights(buckets(model), version=0)
        refused = f"{url}/generate for prompt .* meta_info lacks output_token_logprobs"
        with pytest.raises(MalformedResponse, match=refused):
            list(pool.generate(requests_for(0, prompts=2), SAMPLING))
    finally:
        pool.close()
        process.kill()
        process.wait()


def test_parse_checks_every_field():
    """The response checks, without a server: versions, lengths, finish reasons."""
    request = requests_for(0, prompts=1, group_size=2)[0]
    _, tokenizer = tiny_qwen2()
    sampling = SamplingParams(max_new_tokens=3, stop_token_ids=(9,), stop=("ab",))
    ends = Ends.of(sampling, eos_id=2, decode=tokenizer.decode)

    def parse(answers, url):  # the pool holds version 0
        return parse_group(request, answers, url, ends=ends)

    def output(tokens, version="0", reason=None):
        if reason is None:
            reason = {"type": "length", "length": 3} if len(tokens) == 3 else {"type": "stop", "matched": tokens[-1]}
        return {
            "output_ids": tokens,
            "meta_info": {
                "output_token_logprobs": [[-0.5, t, None] for t in tokens],
                "finish_reason": reason,
                "weight_version": version,
            },
        }

    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    group = parse([output([5, 2]), output([7, 8, 10])], "u")
    assert group.completions == [[5, 2], [7, 8, 10]] and group.finish_reasons == ["stop", "length"]
    assert group.version == 0
    assert parse([output([5, 2], "4"), output([5, 2], "4")], "u").version == 4  # stamped by the server
    # SGLang checks the length limit first: a stop token or string met by the last allowed token says "length"
    at_limit = parse([output([5, 6, 9]), output([7, a, b])], "u")
    assert at_limit.finish_reasons == ["stop", "stop"]
    on_string = {"type": "stop", "matched": "ab"}
    on_strings = parse([output([5, a, b], reason=on_string), output([a, b], reason=on_string)], "u")
    assert on_strings.finish_reasons == ["stop", "stop"]
    with pytest.raises(MalformedResponse, match="expected a list of 2 outputs, got a list of 1"):
        parse([output([5])], "u")
    with pytest.raises(MalformedResponse, match="several weight versions"):
        parse([output([5], "0"), output([5], "1")], "u")
    with pytest.raises(MalformedResponse, match="weight_version 'default'"):
        parse([output([5], "default"), output([5], "default")], "u")
    unversioned = output([5, 2])
    del unversioned["meta_info"]["weight_version"]
    # never the pool's own belief
    with pytest.raises(MalformedResponse, match="sample 1: meta_info has no weight_version"):
        parse([output([5, 2]), unversioned], "u")
    with pytest.raises(MalformedResponse, match="unknown finish_reason"):
        parse([output([5], reason={"type": "eos"}), output([5])], "u")
    unmatched = r"sample 0: a 'stop' finish_reason without the token or string it matched"
    with pytest.raises(MalformedResponse, match=unmatched):
        parse([output([5], reason={"type": "stop"}), output([5])], "u")
    with pytest.raises(MalformedResponse, match="sample 1: finished on token 2, but the completion ends with 5"):
        parse([output([5]), output([5], reason={"type": "stop", "matched": 2})], "u")
    other_string = r"finished on the string 'NaN happened', not one of sampling.stop \('ab',\)"
    with pytest.raises(MalformedResponse, match=other_string):
        parse([output([5], reason={"type": "stop", "matched": "NaN happened"}), output([5])], "u")
    with pytest.raises(MalformedResponse, match="finish_reason 'length' after 2 tokens; the limit is 3"):
        parse([output([5, 6], reason={"type": "length", "length": 2}), output([5])], "u")
    bad = output([5, 6])
    bad["output_ids"] = [5]
    with pytest.raises(MalformedResponse, match="output_ids disagree"):
        parse([bad, output([5])], "u")
    with pytest.raises(ValueError, match="stop strings need decode"):
        Ends.of(sampling, eos_id=2)


# ------------------------------------------------------------------------------------------------------
# stop strings and greedy: the hf sampler's results, whatever SGLang's own order of checks
# ------------------------------------------------------------------------------------------------------
def test_stop_strings_and_greedy_give_the_hf_samplers_results(spec):
    """The same seeds through the pool and through the hf sampler: stop strings cut the same samples at the
    same token with "stop", the last allowed token too (where SGLang says "length"); greedy is the argmax."""
    model, tokenizer = tiny_qwen2(seed=0)
    requests = requests_for(0, prompts=6)
    plain = SamplingParams(max_new_tokens=6, temperature=0.7)

    def hf(sampling):
        groups = sample_groups(model, requests, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer)
        return {g.request.prompt_id: (g.completions, g.finish_reasons) for g in groups}

    stop = stop_strings_for(tokenizer, [c for completions, _ in hf(plain).values() for c in completions], 6)
    with_stop = replace(plain, stop=stop)
    expected = hf(with_stop)
    reasons = {(r, len(c) == 6) for completions, rs in expected.values() for c, r in zip(completions, rs)}
    assert ("stop", True) in reasons and ("stop", False) in reasons, reasons

    pool = start_pool(spec, sync=sync_by("disk"))
    try:
        pool.sync_weights(buckets(model), version=0)
        got = {g.prompt_id: (g.completions, g.finish_reasons) for g in pool.generate(requests, with_stop)}
        greedy = {g.prompt_id: g for g in pool.generate(requests, SamplingParams(max_new_tokens=6, temperature=0.0))}
    finally:
        pool.close()
    assert got == expected
    for request in requests:
        tokens, logprobs = argmax_loop(model, request.prompt_tokens, 6, {tokenizer.eos_token_id})
        assert greedy[request.prompt_id].completions == [tokens] * 4
        for row in greedy[request.prompt_id].logprobs:
            torch.testing.assert_close(torch.tensor(row), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_the_standin_answers_and_refuses_as_sglang_does(saved_model):
    """Finish reasons as SGLang reports them; stop strings refused by a server without its tokenizer, and
    sampling parameters SGLang does not have refused (an attached server's 400 reaches the caller)."""
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir)
    bare, bare_url = launch_standin(model_dir, "--skip-tokenizer-init")
    try:
        prompt = list(requests_for(0, prompts=1)[0].prompt_tokens)

        def post(target, params, seed=3):
            params = {"max_new_tokens": 6, "sampling_seed": seed, **params}
            body = json.dumps({"input_ids": prompt, "sampling_params": params, "return_logprob": True})
            request = urllib.request.Request(target + "/generate", body.encode(), {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read())

        # a seed whose 6 tokens are distinct, so that each of them stops the sample at its own place
        answers = ((seed, post(url, {}, seed)[1]["output_ids"]) for seed in range(50))
        seed, tokens = next((seed, tokens) for seed, tokens in answers if len(set(tokens)) == 6)
        assert post(url, {}, seed)[1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        _, tokenizer = tiny_qwen2()
        text = tokenizer.decode(tokens[:3], skip_special_tokens=True)

        def finish(params: dict) -> dict:
            return post(url, params, seed)[1]["meta_info"]["finish_reason"]

        assert finish({"stop": ["@@", text[1:]]}) == {"type": "stop", "matched": text[1:]}
        assert finish({"stop_token_ids": [1, tokens[1]]}) == {"type": "stop", "matched": tokens[1]}
        # the last allowed token is a stop token: SGLang checks the length limit first
        assert finish({"stop_token_ids": [1, tokens[5]]}) == {"type": "length", "length": 6}
        status, refused = post(url, {"stop_strings": ["x"]})
        assert status == 400 and "unknown field(s) ['stop_strings']" in refused["error"]["message"]
        status, refused = post(bare_url, {"stop": ["x"]})
        assert status == 400 and "unavailable when skip_tokenizer_init=True" in refused["error"]["message"]

        pool = attached([bare_url], "disk")
        try:
            pool.start(spec)
            pool.sync_weights(buckets(model), version=0)
            with pytest.raises(RuntimeError, match=r"HTTP 400: .*unavailable when skip_tokenizer_init=True"):
                list(pool.generate(requests_for(0, prompts=1), replace(SAMPLING, stop=("x",))))
        finally:
            pool.close()
    finally:
        for p in (process, bare):
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------------------------------
# the configuration: conf/pool/sglang.yaml and the SGLang experiments build the pool's settings
# ------------------------------------------------------------------------------------------------------
SETTINGS = {
    "servers": ServerSettings,
    "launch": LaunchSettings,
    "router": RouterSettings,
    "sync": SyncSettings,
    "requests": RequestSettings,
}


def compose_config(*overrides: str):
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_pool_config_mirrors_the_settings_with_their_defaults():
    """``conf/pool/sglang.yaml`` has a node per settings object, with every field, and builds the defaults: the
    YAML and the code cannot drift apart."""
    cfg = compose_config("pool=sglang")
    assert set(cfg.pool) - {"_target_"} == set(SETTINGS) == set(signature(SGLangRolloutPool).parameters)
    pool = instantiate(cfg.pool)
    assert type(pool) is SGLangRolloutPool
    for name, kind in SETTINGS.items():
        assert set(cfg.pool[name]) - {"_target_"} == {f.name for f in fields(kind)}, name
        assert getattr(pool, name) == kind(), name


def test_the_sglang_experiments_compose_and_build_their_pools():
    """``+experiment=sglang_one_node``: a 4-rank FSDP2 trainer on GPUs 0-3, servers launched on GPUs 4-7 of its
    node; ``sglang_nodes``: an FSDP2 trainer of 8 GPUs a node, servers attached behind the router (listening
    where the other trainer nodes reach it), which the pool cannot build before it is told where they are."""
    one_node = compose_config("+experiment=sglang_one_node", "model.path=/models/policy")
    trainer = one_node.trainer
    assert (trainer.accelerator, trainer.devices, trainer.precision) == ("gpu", 4, "bf16-mixed")
    assert trainer.strategy._target_ == "lightning.pytorch.strategies.ModelParallelStrategy"
    pool = instantiate(one_node.pool)
    assert pool.launch.model_path == "/models/policy" and pool.launch.num_servers == 4
    assert pool._gpus == [[4], [5], [6], [7]] and pool.sync.method == "distributed" and pool.servers.urls is None

    nodes = compose_config("+experiment=sglang_nodes")
    assert nodes.trainer.devices == 8 and nodes.trainer.strategy.data_parallel_size == 8
    assert nodes.pool.sync.method == "distributed" and nodes.pool.launch.host == "0.0.0.0"
    with pytest.raises(MissingMandatoryValue, match="urls"):
        instantiate(nodes.pool)
    urls = "pool.servers.urls=[http://infer1:30000,http://infer2:30000]"
    with pytest.raises(MissingMandatoryValue, match="master_address"):
        instantiate(compose_config("+experiment=sglang_nodes", urls).pool)
    pool = instantiate(compose_config("+experiment=sglang_nodes", urls, "pool.sync.master_address=10.0.0.1").pool)
    assert pool.servers == ServerSettings(urls=("http://infer1:30000", "http://infer2:30000"), tp_size=8)
    assert pool.router.enabled and pool.sync == SyncSettings(method="distributed", master_address="10.0.0.1")


# ------------------------------------------------------------------------------------------------------
# a training run through the backend, with the on-policy checks of the datamodule active
# ------------------------------------------------------------------------------------------------------
def test_training_through_the_sglang_pool(tmp_path, monkeypatch):
    import lit_parl.cli as cli

    cfg = compose_config(
        "pool=sglang",
        "iterations=3",
        f"run_dir={tmp_path}",
        "checkpoint_every=0",
        "shape.prompts=8",
        "shape.micro_batch_size=16",
        "pool.launch.num_servers=2",
        f"pool.launch.port={free_port(2)}",
        "pool.sync.method=tensor",
        f"pool.launch.command=[{STANDIN[0]},{STANDIN[1]}]",
        "pool.launch.start_timeout_s=120",
    )
    built = {}
    real_build = cli.build

    def capturing_build(config):
        built["parts"] = real_build(config)
        return built["parts"]

    monkeypatch.setattr(cli, "build", capturing_build)
    summary = cli.run(cfg)
    module, datamodule, trainer = built["parts"]
    assert summary["iterations"] == 3
    assert [s.version for s in datamodule.history] == [0, 1, 2]
    assert all(s.completions == 8 * 8 for s in datamodule.history)
    assert datamodule.schedule.cursor == 24  # every prompt scheduled once
    assert datamodule.pool.health().workers == 0  # closed at the end of the run


@pytest.mark.slow  # make test-slow: the GPU check's whole SGLang sequence
def test_the_gpu_check_sglang_section_runs_its_sequence_against_the_standin(tmp_path):
    """gpu_check/gpu_check_sglang.py (for GPU boxes with sglang) exercised here with the stand-in."""
    script = Path(__file__).resolve().parents[2] / "gpu_check" / "gpu_check_sglang.py"
    command = [
        sys.executable,
        str(script),
        "--out",
        str(tmp_path),
        "--launch-command",
        *STANDIN,
        "--tolerance",
        "1e-4",
        "--dtype",
        "float32",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = {r["check"]: r for r in map(json.loads, (tmp_path / "gpu_check.jsonl").read_text().splitlines())}
    for method, version in [("disk", 0), ("tensor", 1), ("distributed", 2)]:
        record = records[f"sglang_sync_{method}"]
        assert record["status"] == "ok", record
        assert record["group_versions"] == [version]
    assert records["sglang_sync_tensor"]["max_abs_logprob_diff_old_weights"] > 1e-4


def test_a_distributed_sync_refuses_a_group_with_a_dead_member(spec):
    """A broadcast to a group with a dead rank would hang until the NCCL timeout: refused at once instead."""
    model, tokenizer = tiny_qwen2()
    pool = start_pool(spec, launch={"num_servers": 2}, sync=sync_by())
    try:
        pool.sync_weights(buckets(model), version=0)
        dead = pool._fleet.servers[0]
        dead.process.kill()
        dead.process.wait()
        with pytest.warns(RuntimeWarning, match="is down"):
            groups = list(pool.generate(requests_for(0, prompts=6), SAMPLING))
        assert sorted(g.prompt_id for g in groups) == list(range(6))
        with pytest.raises(RuntimeError, match=rf"\['{dead.url}'\] left the weight-update group"):
            pool.sync_weights(buckets(model), version=1)
    finally:
        pool.close()


def test_generation_through_sglang_router(spec):
    """The real sglang_router (PyPI) in front of two stand-in servers: generation goes through the router,
    weight updates to each server; close() stops the router and the servers it launched. A pool another rank
    joins at the launching pool's address generates through the same router."""
    pytest.importorskip("sglang_router")
    model, tokenizer = tiny_qwen2()
    router = {"enabled": True, "port": free_port()}
    pool = start_pool(spec, launch={"num_servers": 2}, router=router, sync=sync_by("disk"))
    pids = pool.launched_pids()
    joined = SGLangRolloutPool()
    try:
        assert len(pids) == 3 and pool.health().details["router"] is not None
        pool.sync_weights(buckets(model), version=0)
        groups = {g.prompt_id: g for g in pool.generate(requests_for(0, prompts=6), SAMPLING)}
        assert sorted(groups) == list(range(6)) and {g.version for g in groups.values()} == {0}
        request = requests_for(0)[0]
        for completion, logprobs in zip(groups[0].completions, groups[0].logprobs):
            expected = trainer_logprobs(model, request.prompt_tokens, completion, 0.7)
            torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
        joined.join(spec, pool.address())
        joined.adopt_version(0)
        assert joined.health().details["router"] == pool.health().details["router"]
        again = {g.prompt_id: g for g in joined.generate(requests_for(0, prompts=6), SAMPLING)}
        assert all(again[i].completions == groups[i].completions for i in groups), "the same seeds, other samples"
    finally:
        joined.close()
        pool.close()
    assert not any(alive(p) for p in pids)


def test_a_pool_joined_from_another_rank_generates_on_the_same_servers_and_never_pushes(spec):
    """What a rank other than 0 holds under a multi-rank trainer: the servers rank 0 launched, reached at its
    ``address``; it takes a version only once the servers report it, never pushes, and stops nothing."""
    model, _ = tiny_qwen2(seed=0)
    owner = start_pool(spec, launch={"num_servers": 2}, sync=sync_by("tensor"))
    pids = owner.launched_pids()
    joined = SGLangRolloutPool()
    try:
        joined.join(spec, owner.address())
        assert joined.joined and joined.health().workers == 2 and joined.launched_pids() == []
        owner.sync_weights(buckets(model), version=0)
        with pytest.raises(RuntimeError, match=r"weight sync to version 1 was not confirmed: the servers reported"):
            joined.adopt_version(1)
        assert joined.version is None, "a version the servers do not report must not be taken"
        joined.adopt_version(0)
        mine = {g.prompt_id: g for g in owner.generate(requests_for(0, prompts=2), SAMPLING)}
        theirs = {g.prompt_id: g for g in joined.generate(requests_for(0, prompts=2, first=2), SAMPLING)}
        assert sorted(theirs) == [2, 3] and {g.version for g in [*mine.values(), *theirs.values()]} == {0}
        with pytest.raises(RuntimeError, match="joined a pool another rank started: that rank pushes the weights"):
            joined.sync_weights(buckets(model), version=1)
        with pytest.raises(RuntimeError, match="joined a pool: ask the rank that started it"):
            joined.address()
        joined.close()
        assert all(alive(p) for p in pids), "a joined pool stopped servers it did not launch"
        assert list(owner.generate(requests_for(0, prompts=1), SAMPLING))
    finally:
        joined.close()
        owner.close()
    assert not any(alive(p) for p in pids)


def test_each_tensor_parallel_rank_gets_its_own_payload(saved_model, monkeypatch):
    """SGLang's rank r unpickles ``serialized_named_tensors[r]`` and only that one (each unpickling of a CUDA IPC
    handle is counted by the producer): a server at tp 2 needs two payloads, each pickled on its own. The
    stand-in at ``--tp-size 2`` refuses a short list, as a real rank 1 would fail."""
    import lit_parl.rollout.sglang.weights as weights

    model, spec, model_dir = saved_model
    calls = []
    real = weights.serialize_named_tensors
    monkeypatch.setattr(
        weights, "serialize_named_tensors", lambda named, *manager: calls.append(len(named)) or real(named, *manager)
    )
    process, url = launch_standin(model_dir, "--tp-size", "2")
    try:
        pool = attached([url], tp_size=2)
        try:
            pool.start(spec)
            pool.sync_weights(buckets(model), version=0)
            assert len(calls) == 2 * len(buckets(model))  # two picklings per bucket
            request = requests_for(0)[0]
            (group,) = pool.generate([request], SAMPLING)
            for completion, logprobs in zip(group.completions, group.logprobs):
                expected = trainer_logprobs(model, request.prompt_tokens, completion, 0.7)
                torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
        finally:
            pool.close()
        short = attached([url], tp_size=1)
        try:
            short.start(spec)
            with pytest.raises(RuntimeError, match="1 payloads for tp_size 2"):
                short.sync_weights(buckets(model), version=1)
        finally:
            short.close()
    finally:
        process.kill()
        process.wait()


class SaysCUDA(torch.Tensor):
    """A CPU tensor that answers ``is_cuda=True`` (there is no CUDA here)."""

    is_cuda = True


def test_cuda_tensors_are_pickled_with_sglangs_device_uuid_patch(monkeypatch):
    """A CUDA IPC handle names its device by index, another GPU in a server with other CUDA_VISIBLE_DEVICES:
    SGLang's ``monkey_patch_torch_reductions`` sends the UUID instead. The trainer applies it (once per
    call, idempotent in SGLang) and, without sglang, says what to install. The real patch is applied in
    the contract suite (tests/sglang_contract), a real CUDA handle in the GPU check."""
    import types

    from lit_parl.rollout import weight_transfer

    applied = []
    fake = types.ModuleType("sglang.srt.utils.patch_torch")
    fake.monkey_patch_torch_reductions = lambda: applied.append(True)
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.patch_torch", fake)
    weight_transfer.send_cuda_devices_by_uuid()
    assert applied == [True]
    weight_transfer.serialize_named_tensors([("w", torch.zeros(2))])  # CPU tensors: shared-memory files, no patch
    assert applied == [True]
    # the serializer patches first
    weight_transfer.serialize_named_tensors([("w", torch.zeros(2).as_subclass(SaysCUDA))])
    assert applied == [True, True]
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.patch_torch", None)  # not importable
    refused = r"pool.sync.method='tensor' with CUDA weights .* pip install 'lit-parl\[sglang\]' .*'distributed'"
    with pytest.raises(ImportError, match=refused):
        weight_transfer.send_cuda_devices_by_uuid()


def test_launched_servers_serve_bfloat16_by_default(spec):
    """SGLang's ``--dtype auto`` serves a float32 checkpoint (what the trainer saves) in float16; the pool asks for
    bfloat16, the trainer's compute precision under bf16-mixed, unless told otherwise."""
    assert server_command(LaunchSettings(command=["sglang"]), "m", 1, 1, False)[-2:] == ["--dtype", "bfloat16"]
    assert "--dtype" not in server_command(LaunchSettings(command=["sglang"], dtype=None), "m", 1, 1, False)
    with pytest.raises(ValueError, match=r"dtype='bf16'\): SGLang serves one of"):
        SGLangRolloutPool(launch={"dtype": "bf16"})
    pool = SGLangRolloutPool(launch={"command": STANDIN, "port": free_port(), "start_timeout_s": 120})  # default dtype
    pool.start(spec)
    try:
        with urllib.request.urlopen(pool._fleet.servers[0].url + "/server_info", timeout=10) as answer:
            assert json.load(answer)["dtype"] == "bfloat16"
    finally:
        pool.close()


def test_the_standin_holds_requests_while_paused_and_refuses_a_flush_while_one_runs(saved_model):
    """As SGLang: a /generate sent while paused waits for /continue_generation (not refused), and /flush_cache
    answers 400 while a request is being sampled."""
    import concurrent.futures

    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir)

    def post(path: str, body: dict, timeout: float = 60):
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()

    generate = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True}
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as threads:
            post("/pause_generation", {})
            held = threads.submit(post, "/generate", generate)
            time.sleep(1.5)
            assert not held.done(), "a request sent while paused was answered before /continue_generation"
            post("/continue_generation", {})
            assert held.result(timeout=30)[0] == 200
            # 500 tokens: the end token asked for (the first stop token id, to the stand-in) is never drawn
            endless = {"max_new_tokens": 500, "stop_token_ids": [10**6]}
            long = threads.submit(post, "/generate", {**generate, "sampling_params": endless})
            refused = []
            while not long.done() and not refused:  # SGLang refuses while a request runs
                try:
                    post("/flush_cache", {})
                except urllib.error.HTTPError as error:
                    refused.append(error.code)
                time.sleep(0.05)
            assert refused == [400], "no flush was refused while a 500-token request ran"
            long.result(timeout=120)
            assert post("/flush_cache", {})[0] == 200
    finally:
        process.kill()
        process.wait()


def test_a_refused_distributed_update_stops_the_sync_at_once_instead_of_waiting_out_the_broadcast(saved_model):
    """A server that refuses /update_weights_from_distributed never joins the broadcast, which would wait for it
    until the group's timeout (10 minutes): the refusal is raised as soon as it arrives."""
    import threading

    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir, "--refuse-distributed-updates")
    pool = attached([url], "distributed")
    outcome = []

    def sync():
        try:
            pool.sync_weights(buckets(model), version=0)
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome.append(error)

    try:
        pool.start(spec)
        thread = threading.Thread(target=sync, daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the sync still waits on a broadcast the server refused"
        assert time.monotonic() - started < 30
        assert len(outcome) == 1
        assert "no weight update group" in str(outcome[0]) and "broadcast was abandoned" in str(outcome[0])
        assert pool.version is None
        # not a second broadcast into it
        with pytest.raises(RuntimeError, match="left the weight-update group unusable"):
            pool.sync_weights(buckets(model), version=0)
    finally:
        pool.close()
        process.kill()
        process.wait()


def test_closing_the_pool_destroys_the_servers_side_of_the_weight_update_group(saved_model):
    """An attached server outlives the pool: on close it is told to destroy its side of the group
    (``/destroy_weights_update_group``), and the next trainer's pool builds a new one and syncs."""
    model, spec, model_dir = saved_model
    process, url = launch_standin(model_dir)
    body = json.dumps({"group_name": "lit_parl_weight_update"}).encode()
    destroy = urllib.request.Request(
        url + "/destroy_weights_update_group", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        for version in range(2):  # two trainers in turn
            pool = attached([url], "distributed")
            try:
                pool.start(spec)
                pool.sync_weights(buckets(model), version=version)
                assert {g.version for g in pool.generate(requests_for(version), SAMPLING)} == {version}
            finally:
                pool.close()
            with pytest.raises(urllib.error.HTTPError, match="400"):  # already destroyed by close()
                urllib.request.urlopen(destroy, timeout=10)
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("blocks_for", [None, 0.3])
def test_a_refusal_is_seen_while_the_broadcast_blocks_the_host(monkeypatch, blocks_for):
    """NCCL builds its communicator inside the first broadcast and blocks the host there until every rank has
    joined: the refusal must still be seen. A broadcast that never ends is abandoned (the group is unusable);
    one that still ends within the grace period (a server that failed after receiving) leaves it usable."""
    import threading
    import types

    from lit_parl.rollout import weight_transfer

    release = threading.Event()

    def blocking_broadcast(tensor, src, group, async_op):
        release.wait(blocks_for)  # None: until the test ends
        return types.SimpleNamespace(wait=lambda: None)

    monkeypatch.setattr(torch.distributed, "broadcast", blocking_broadcast)
    started = time.monotonic()
    refusal = RuntimeError("the distributed weight update was refused: HTTP 400")
    refused = lambda: refusal if time.monotonic() - started > 0.1 else None  # noqa: E731
    expected = weight_transfer.BroadcastAbandoned if blocks_for is None else RuntimeError
    try:
        with pytest.raises(expected, match="refused: HTTP 400") as raised:
            weight_transfer.broadcast_from_trainer(None, [torch.zeros(2)], refused, grace_s=1.0)
        assert (type(raised.value) is weight_transfer.BroadcastAbandoned) == (blocks_for is None)
        assert time.monotonic() - started < 3
    finally:
        release.set()


def test_launched_servers_get_their_gpus_as_the_trainer_numbers_them(spec, tmp_path, monkeypatch):
    """``gpu_ids`` are read as the vLLM pool reads them (lit_parl.rollout.gpu_placement): an integer is a GPU as the
    trainer's process numbers them, so under its own CUDA_VISIBLE_DEVICES, that list's entry."""
    launcher = tmp_path / "write_down.py"
    launcher.write_text(
        "import glob, json, os, sys, time\n"
        "port = sys.argv[sys.argv.index('--port') + 1]\n"
        "visible = json.dumps(os.environ.get('CUDA_VISIBLE_DEVICES'))\n"
        "open(os.path.join(sys.argv[1], f'server-{port}.json'), 'w').write(visible)\n"
        "deadline = time.monotonic() + 30\n"  # both written before either exits (the pool stops the other then)
        "while len(glob.glob(os.path.join(sys.argv[1], 'server-*.json'))) < 2 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "sys.exit(3)\n"
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    port = free_port(2)
    launch = {
        "command": [sys.executable, str(launcher), str(tmp_path)],
        "num_servers": 2,
        "gpu_ids": [[2], [0]],
        "port": port,
        "start_timeout_s": 60,
    }
    pool = SGLangRolloutPool(launch=launch)
    try:
        with pytest.raises(RuntimeError, match="exited with code 3 while starting"):
            pool.start(spec)
    finally:
        pool.close()
    assert [json.loads((tmp_path / f"server-{port + i}.json").read_text()) for i in range(2)] == ["7", "3"]
