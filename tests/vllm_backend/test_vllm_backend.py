"""The vLLM rollout pool against a real vLLM engine (the community CPU build, ``make test-vllm``).

* The version gate holds in the pool and in each worker.
* Per-sample seeds: distinct seeds give distinct samples, a seed reproduces its sample, whatever else
  shares the batch.
* The engine's log-probs are the trainer's (``completion_logprobs`` at temperature T), stop tokens end a
  completion and stay in it; under top-k and top-p too they are the full softmax at T, while every
  token is drawn from the filtered set. Groups come back unscored: the trainer scores them.
* A weight sync really changes what is generated: log-probs follow the synced model exactly, also for long
  prompts whose KV the prefix cache holds; syncing the old weights back reproduces the old samples.
* Stop strings end a sample at the token that completes one (kept, "stop", the last allowed token too),
  as the ``hf`` sampler's reference finds it; greedy (T = 0) is the argmax loop over the model, every
  sample of a group alike, with the plain softmax's log-probs.
* ``close`` leaves no process behind and the model directory it was given as it was; a SIGKILLed
  trainer takes its workers with it.
* A worker killed with its work unfinished is replaced: every prompt comes back once, with the
  undisturbed call's samples and log-probs.
* Tensor parallelism (two ranks under vLLM's multiprocessing executor, in the worker): each rank loads its
  shard of every sync (the log-probs follow the synced model exactly), the ranks die with their worker
  even when they cannot react (stopped), and a replaced worker starts ranks of its own that reproduce the
  samples.
* The vLLM functions the pool calls (``lit_parl.rollout.vllm_engine``'s docstring) still take the
  arguments it passes.
* Three iterations of the default job through the CLI with ``pool=vllm``: versions 0, 1, 2, every
  group stamped with its iteration's version, and a rollout/trainer log-prob mismatch near zero.

The model is the project's tiny Qwen2 with hidden size 128 (head size 32, the smallest that vLLM's CPU
attention runs); nothing is downloaded.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from lit_parl.cli import build
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import pack
from lit_parl.models import tiny_qwen2
from lit_parl.rollout import PoolHealth, PoolSpec, VLLMRolloutPool
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams, sample_seed
from lit_parl.tasks import CopyTask

# Where vLLM is not installed (the project's main environment), the whole module is skipped. An installed
# vLLM that fails to import is an error, not a skip. This is not a conftest.py: a second module named
# `conftest` would shadow tests/conftest.py for `from conftest import`.
if not Path("/proc/self/stat").exists():
    pytest.skip("needs Linux /proc", allow_module_level=True)
if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "vLLM is not installed here; `make test-vllm` installs it in .venv-vllm and runs these tests",
        allow_module_level=True,
    )
from vllm import EngineArgs, LLMEngine  # noqa: E402, F401 - fails the module if an installed vLLM does not import

# tests/ is on the path (tests/conftest.py)
from helpers.sampling_references import argmax_loop, filtered_distribution, first_stop, stop_strings_for  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 128, "intermediate_size": 512}  # 4 heads of 32
KV_CACHE = 64 * 2**20
MAX_NEW = 6


def tiny(seed: int = 0):
    model, tokenizer = tiny_qwen2(seed=seed, **TINY)
    return model.eval(), tokenizer


def save_spec(model, tokenizer, directory: Path) -> PoolSpec:
    """What the datamodule hands a pool: the policy and its tokenizer saved as a model directory."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return PoolSpec(model_dir=str(directory), eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def buckets(model, size: int = 5) -> list[list[tuple[str, torch.Tensor]]]:
    """The policy's parameters in buckets of ``size`` tensors, as WeightSync streams them."""
    named = list(model.named_parameters())
    return [named[i : i + size] for i in range(0, len(named), size)]


def group_requests(
    tokenizer, version: int, prompts: range, group_size: int = 4, run_seed: int = 0
) -> list[GroupRequest]:
    task = CopyTask(seed=run_seed)
    requests = []
    for prompt_id in prompts:
        prompt, answer = task.make(prompt_id)
        requests.append(
            GroupRequest(
                prompt_id=prompt_id,
                prompt_tokens=tuple(tokenizer(prompt, add_special_tokens=False).input_ids),
                version=version,
                seeds=tuple(sample_seed(run_seed, version, prompt_id, s) for s in range(group_size)),
            )
        )
    return requests


def trainer_logprobs(model, prompt_ids, completions, temperature: float) -> list[torch.Tensor]:
    """What the trainer computes: the packed shared-prompt forward of lit_parl.kernels."""
    packed = pack([(list(prompt_ids), [list(c) for c in completions])], pad_id=0, shared_prompt=True)
    with torch.no_grad():
        logprobs = completion_logprobs(model, packed, temperature)
    return [logprobs[i, : len(c)] for i, c in enumerate(completions)]


def max_logprob_gap(model, requests, groups, temperature: float) -> float:
    prompts = {r.prompt_id: r.prompt_tokens for r in requests}
    gaps = []
    for group in groups:
        expected = trainer_logprobs(model, prompts[group.prompt_id], group.completions, temperature)
        gaps += [(torch.tensor(lp) - e).abs().max().item() for lp, e in zip(group.logprobs, expected)]
    return max(gaps)


def by_prompt(groups) -> dict:
    return {g.prompt_id: g for g in groups}


def sync(pool: VLLMRolloutPool, model) -> int:
    version = 0 if pool.version is None else pool.version + 1
    pool.sync_weights(buckets(model), version)
    return version


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    model, tokenizer = tiny()
    pool = VLLMRolloutPool(kv_cache_memory_bytes=KV_CACHE)
    pool.start(save_spec(model, tokenizer, tmp_path_factory.mktemp("spec") / "model"))
    yield pool, model, tokenizer
    pool.close()


# -- the version gate ---------------------------------------------------------------------------------
def test_the_pool_refuses_requests_for_a_version_it_does_not_hold(started):
    pool, model, tokenizer = started
    version = sync(pool, model)
    ahead = group_requests(tokenizer, version + 1, range(2))
    refused = (
        rf"version gate: requests for policy version\(s\) \[{version + 1}\] reached a pool holding version {version}"
    )
    with pytest.raises(RuntimeError, match=refused):
        list(pool.generate(ahead, SamplingParams(max_new_tokens=MAX_NEW)))
    duplicated = group_requests(tokenizer, version, range(2)) * 2
    with pytest.raises(ValueError, match="duplicate prompt_id"):
        list(pool.generate(duplicated, SamplingParams(max_new_tokens=MAX_NEW)))
    # the refusals left the pool working: the right version is served and stamped
    groups = list(pool.generate(group_requests(tokenizer, version, range(2)), SamplingParams(max_new_tokens=MAX_NEW)))
    assert sorted(g.prompt_id for g in groups) == [0, 1]
    assert {g.version for g in groups} == {version}


# -- seeds --------------------------------------------------------------------------------------------
def test_distinct_seeds_give_distinct_samples_and_a_seed_reproduces_its_sample(started):
    pool, model, tokenizer = started
    version = sync(pool, model)
    sampling = SamplingParams(max_new_tokens=MAX_NEW)
    target = group_requests(tokenizer, version, range(7, 8), group_size=8)[0]
    a, b = target.seeds[:2]
    # one group size per call
    repeated = GroupRequest(prompt_id=99, prompt_tokens=target.prompt_tokens, version=version, seeds=(a, b) * 4)

    alone = by_prompt(pool.generate([target, repeated], sampling))
    others = group_requests(tokenizer, version, range(20, 26), group_size=8)
    crowded = by_prompt(pool.generate([*others, target, repeated], sampling))

    completions = [tuple(c) for c in alone[7].completions]
    assert len(set(completions)) == 8, f"samples of one group with distinct seeds coincide: {completions}"
    again = alone[99]
    assert again.completions[0] == again.completions[2] and again.completions[1] == again.completions[3]
    assert again.completions[0] != again.completions[1]
    assert again.completions[:2] == alone[7].completions[:2], "the same seed on the same prompt gave another sample"
    # the batch around a request does not change its samples
    assert crowded[7].completions == alone[7].completions
    for mine, theirs in zip(crowded[7].logprobs, alone[7].logprobs):
        assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), atol=1e-5)


# -- log-probs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_the_trainers_and_stop_tokens_end_completions(started, temperature):
    pool, model, tokenizer = started
    version = sync(pool, model)
    stops = tuple(range(10, 22))  # a fifth of the vocabulary: some samples stop, others run to the limit
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, stop_token_ids=stops)
    requests = group_requests(tokenizer, version, range(8))
    groups = list(pool.generate(requests, sampling))

    assert max_logprob_gap(model, requests, groups, temperature) < 1e-4
    ends = {tokenizer.eos_token_id, *stops}
    reasons = set()
    for group in groups:
        for completion, reason in zip(group.completions, group.finish_reasons):
            reasons.add(reason)
            assert not ends & set(completion[:-1]), f"a completion went on after a stop token: {completion}"
            if reason == "stop":
                assert completion[-1] in ends, f"'stop' without a stop token at the end: {completion}"
            else:
                assert reason == "length" and len(completion) == MAX_NEW and completion[-1] not in ends
    assert reasons == {"stop", "length"}, f"the sample should exercise both finish reasons, got {reasons}"
    # the pool does not score: groups come back unscored, for the trainer's scorer
    assert all(type(group) is GroupCompletions and not hasattr(group, "rewards") for group in groups)


def test_under_top_k_and_top_p_the_logprobs_are_the_full_softmax_at_t(started):
    """The trainer's log_softmax(logits / T) over the whole vocabulary, though each token is drawn from the
    top-k/top-p filtered distribution (vLLM's own processed_logprobs would give the filtered one)."""
    pool, model, tokenizer = started
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.model.norm.weight.mul_(3.0)  # logits 3x: a random init is too flat for top-p or T to show
    version = sync(pool, peaked)
    temperature, top_k, top_p = 0.7, 6, 0.8
    requests = group_requests(tokenizer, version, range(4))
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_k=top_k, top_p=top_p)
    groups = by_prompt(pool.generate(requests, sampling))

    assert max_logprob_gap(peaked, requests, groups.values(), temperature) < 1e-4
    filtered_gap = 0.0
    for request in requests:
        for completion, logprobs in zip(groups[request.prompt_id].completions, groups[request.prompt_id].logprobs):
            with torch.no_grad():
                logits = peaked(torch.tensor([[*request.prompt_tokens, *completion]])).logits
                logits = logits[0, len(request.prompt_tokens) - 1 : -1]
            for t, token in enumerate(completion):
                kept = filtered_distribution(logits[t], temperature, top_k, top_p)
                assert token in kept, f"token {token} at step {t} is outside the filtered set {sorted(kept)}"
                filtered_gap = max(filtered_gap, abs(logprobs[t] - torch.tensor(kept[token]).log().item()))
    assert filtered_gap > 0.05, "the filtered distribution's log-probs should differ from the full softmax's here"


def test_draws_follow_the_filtered_distribution_at_t(started):
    """1,000 one-token samples of one prompt: their frequencies are the top-k/top-p filtered softmax at T."""
    pool, model, tokenizer = started
    peaked = copy.deepcopy(model)
    with torch.no_grad():
        peaked.model.norm.weight.mul_(3.0)
    version = sync(pool, peaked)
    temperature, top_k, top_p = 0.7, 6, 0.95
    (request,) = group_requests(tokenizer, version, range(1), group_size=1000)
    sampling = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    (group,) = pool.generate([request], sampling)
    with torch.no_grad():
        logits = peaked(torch.tensor([request.prompt_tokens])).logits[0, -1]
    expected = filtered_distribution(logits, temperature, top_k, top_p)
    assert len(expected) >= 3, f"the test needs a spread distribution, got {expected}"
    drawn = torch.tensor([c[0] for c in group.completions])
    frequency = {t: (drawn == t).double().mean().item() for t in set(drawn.tolist()) | set(expected)}
    distance = 0.5 * sum(abs(frequency[t] - expected.get(t, 0.0)) for t in frequency)
    assert distance < 0.06, (
        f"total variation {distance:.3f} between the draws {frequency} and the filtered distribution {expected}"
    )


# -- stop strings and greedy --------------------------------------------------------------------------
def test_stop_strings_end_samples_at_the_token_that_completes_them(started):
    """The same seeds without and with stop strings: each sample is cut after the token whose text
    completes one (the hf reference decodes every prefix), also when that is the last token allowed."""
    pool, model, tokenizer = started
    version = sync(pool, model)
    requests = group_requests(tokenizer, version, range(8))
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    plain = by_prompt(pool.generate(requests, sampling))
    samples = [(g.prompt_id, k, c) for g in plain.values() for k, c in enumerate(g.completions)]
    stop = stop_strings_for(tokenizer, [c for _, _, c in samples], MAX_NEW)
    cut = by_prompt(pool.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, stop=stop)))

    ends = set()
    for prompt_id, k, completion in samples:
        t = first_stop(tokenizer, completion, stop)
        group = cut[prompt_id]
        got, reason, logprobs = group.completions[k], group.finish_reasons[k], group.logprobs[k]
        if t is None:
            assert (got, reason) == (completion, plain[prompt_id].finish_reasons[k])
        else:
            assert got == completion[: t + 1] and reason == "stop", (
                f"{stop}: {tokenizer.decode(completion)!r} gave {tokenizer.decode(got)!r}, {reason}"
            )
            ends.add("last" if t == MAX_NEW - 1 else "early")
        torch.testing.assert_close(logprobs, plain[prompt_id].logprobs[k][: len(got)], atol=1e-5, rtol=0)
    assert ends == {"last", "early"}, ends


def test_greedy_is_the_argmax_loop_and_the_temperature_comes_back_after_it(started):
    pool, model, tokenizer = started
    version = sync(pool, model)
    requests = group_requests(tokenizer, version, range(4))
    groups = by_prompt(pool.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)))
    for request in requests:
        tokens, logprobs = argmax_loop(model, request.prompt_tokens, MAX_NEW, {tokenizer.eos_token_id})
        group = groups[request.prompt_id]
        assert group.completions == [tokens] * 4, (
            f"prompt {request.prompt_id}: {group.completions} is not the argmax {tokens}"
        )
        for row in group.logprobs:
            torch.testing.assert_close(torch.tensor(row), torch.tensor(logprobs), atol=1e-4, rtol=0)
    # the next call samples at its own temperature again (the logit scale follows it)
    warm = list(pool.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7)))
    assert max_logprob_gap(model, requests, warm, 0.7) < 1e-4


def test_stop_strings_without_the_engines_tokenizer_are_refused():
    pool = VLLMRolloutPool(engine_kwargs={"skip_tokenizer_init": True})
    refused = r"sampling.stop=\('x',\) needs the engine's tokenizer.*remove skip_tokenizer_init"
    with pytest.raises(ValueError, match=refused):
        list(pool._generate([], SamplingParams(stop=("x",))))


# -- weight sync --------------------------------------------------------------------------------------
def test_a_sync_changes_the_outputs_to_the_new_models_and_back(started):
    pool, model, _ = started
    # long prompts: whole KV blocks of the shared prompt go into vLLM's prefix cache, which must be reset
    generator = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 53, (300,), generator=generator).tolist()) for _ in range(3)]

    def requests(version):
        seeds = (11, 12, 13, 14)
        return [GroupRequest(prompt_id=i, prompt_tokens=p, version=version, seeds=seeds) for i, p in enumerate(prompts)]

    sampling = SamplingParams(max_new_tokens=MAX_NEW)
    old_version = sync(pool, model)
    before = by_prompt(pool.generate(requests(old_version), sampling))

    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in perturbed.parameters():  # every tensor, the tied embedding / LM head included
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    new_version = sync(pool, perturbed)
    after = list(pool.generate(requests(new_version), sampling))
    assert {g.version for g in after} == {new_version}
    gap = max_logprob_gap(perturbed, requests(new_version), after, 1.0)
    assert gap < 1e-4, "the engine does not run the synced weights"
    assert max_logprob_gap(model, requests(new_version), after, 1.0) > 1e-2, "the old weights explain the new samples"

    back = sync(pool, model)
    again = by_prompt(pool.generate(requests(back), sampling))
    for i in range(len(prompts)):
        assert again[i].completions == before[i].completions, (
            "syncing the old weights back did not reproduce the old samples"
        )
        for mine, theirs in zip(again[i].logprobs, before[i].logprobs):
            assert torch.allclose(torch.tensor(mine), torch.tensor(theirs), atol=1e-5)


# -- processes ----------------------------------------------------------------------------------------
def _processes() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, state, start time) of every process, from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is proc(5)'s field 3, the state
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), fields[0], int(fields[19]))
    return table


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _tree(pid: int) -> dict[int, int]:
    """pid -> start time of ``pid``'s live descendants, multiprocessing's resource tracker excepted."""
    table, found, frontier = _processes(), {}, {pid}
    while frontier:
        children = {p: start for p, (parent, state, start) in table.items() if parent in frontier and state not in "ZX"}
        found.update(children)
        frontier = set(children)
    return {p: start for p, start in found.items() if "resource_tracker" not in _cmdline(p)}


def _alive(pid: int, start: int) -> bool:
    entry = _processes().get(pid)
    return entry is not None and entry[2] == start and entry[1] not in "ZX"  # a zombie has exited already


def _wait_gone(processes: dict[int, int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := {p for p, c in processes.items() if _alive(p, c)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def test_two_workers_share_the_requests_and_close_leaves_nothing_behind(tmp_path):
    model, tokenizer = tiny()
    spec = save_spec(model, tokenizer, tmp_path / "model")
    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    before, started = _tree(os.getpid()), {}
    pool = VLLMRolloutPool(num_workers=2, kv_cache_memory_bytes=KV_CACHE)
    try:
        pool.start(spec)
        assert pool.health().alive == 2
        version = sync(pool, model)
        sampling = SamplingParams(max_new_tokens=MAX_NEW)
        groups = list(pool.generate(group_requests(tokenizer, version, range(6)), sampling))
        assert sorted(g.prompt_id for g in groups) == list(range(6))
        assert len(pool.busy_intervals()) == 2, "both workers should have generated"
        started = {p: c for p, c in _tree(os.getpid()).items() if p not in before}
        assert set(pool.pids()) <= set(started) and len(pool.pids()) == 2

        # each worker refuses a stale request by itself, even past the pool's own check
        pool.check_requests = lambda requests: None
        refused = rf"holds policy version {version} but got requests for \[{version + 1}\]"
        with pytest.raises(RuntimeError, match=refused):
            list(pool.generate(group_requests(tokenizer, version + 1, range(2)), sampling))
    finally:
        pool.close()
    assert not _wait_gone(started, 10.0), f"processes left after close: {started}"
    assert pool.health() == PoolHealth(backend="vllm", started=False, workers=0, alive=0, version=None)
    left = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert left == files, "the pool changed a model directory it does not own"
    pool.close()  # idempotent


def test_a_vllm_worker_killed_mid_generation_is_replaced_and_its_groups_come_back_unchanged(tmp_path):
    """The restart path the hf pool's fault tests exercise, with the vLLM engine: the worker is killed while it
    owes the whole call's work; a replacement loads the pool's version, the work is sent again with the
    same seeds, and every prompt comes back once, with the samples and log-probs of an undisturbed call."""
    model, tokenizer = tiny()
    pool = VLLMRolloutPool(kv_cache_memory_bytes=KV_CACHE, max_restarts=1)
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7)
    try:
        pool.start(save_spec(model, tokenizer, tmp_path / "model"))
        version = sync(pool, model)
        requests = group_requests(tokenizer, version, range(6))
        undisturbed = by_prompt(pool.generate(requests, sampling))
        # stopped before the requests go out and killed a second later: it dies with all of its work unfinished
        killed = pool.pids()[0]
        os.kill(killed, signal.SIGSTOP)
        timer = threading.Timer(1.0, os.kill, (killed, signal.SIGKILL))
        timer.start()
        try:
            groups = list(pool.generate(requests, sampling))
        finally:
            timer.cancel()
        assert pool.health().details["restarts"] == 1 and pool.pids()[0] != killed
        assert sorted(g.prompt_id for g in groups) == list(range(6)), "a prompt was lost or came twice"
        for group in groups:
            assert group.version == version and group.completions == undisturbed[group.prompt_id].completions
            torch.testing.assert_close(group.logprobs, undisturbed[group.prompt_id].logprobs, atol=1e-5, rtol=0)
        gap = max_logprob_gap(model, requests, groups, sampling.temperature)
        assert gap < 1e-4, "the replacement holds other weights"
    finally:
        pool.close()


def test_a_sigkilled_trainer_takes_its_vllm_worker_with_it(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from lit_parl.models import tiny_qwen2
        from lit_parl.rollout import PoolSpec, VLLMRolloutPool

        if __name__ == "__main__":
            model, tokenizer = tiny_qwen2(**{TINY!r})
            model.save_pretrained({str(tmp_path / "model")!r})
            tokenizer.save_pretrained({str(tmp_path / "model")!r})
            pool = VLLMRolloutPool(kv_cache_memory_bytes={KV_CACHE})
            pool.start(PoolSpec({str(tmp_path / "model")!r}, tokenizer.eos_token_id, tokenizer.pad_token_id))
            pool.sync_weights([list(model.named_parameters())], 0)
            print("ready", *pool.pids(), flush=True)
            time.sleep(600)
    """)
    )
    shared_memory = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = []
        for text in proc.stdout:  # vLLM logs to stdout too
            if text.startswith("ready"):
                line = text.split()
                break
        assert line, f"the trainer script did not start its pool (exit code {proc.poll()})"
        workers = {int(p) for p in line[1:]}
        tree = _tree(proc.pid)
        assert workers and workers <= set(tree)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        left = _wait_gone(tree, 10.0)
        assert not left, f"processes of the pool outlived the SIGKILLed trainer (PR_SET_PDEATHSIG): {left}"
        # a SIGKILLed trainer removes nothing: a pool with neither adapters nor ranks makes no scratch directory
        assert not [n for n in set(os.listdir("/dev/shm")) - shared_memory if n.startswith("lit_parl_vllm_")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_model_vllm_cannot_run_fails_at_start_and_leaves_nothing(tmp_path):
    model, tokenizer = tiny_qwen2()  # hidden 64 / 4 heads: head size 16, below what vLLM's CPU attention runs
    spec = save_spec(model, tokenizer, tmp_path / "model")
    before, started = _tree(os.getpid()), {}
    pool = VLLMRolloutPool(kv_cache_memory_bytes=KV_CACHE)
    try:
        with pytest.raises(RuntimeError, match=r"head sizes \[.*\], but this model's is 16"):
            pool.start(spec)
        started = {p: c for p, c in _tree(os.getpid()).items() if p not in before}
    finally:
        pool.close()
    assert not _wait_gone(started, 10.0)
    assert pool.health().workers == 0 and not pool.pids()


# -- tensor parallelism -------------------------------------------------------------------------------
def test_two_tensor_parallel_ranks_load_their_shards_die_with_their_worker_and_come_back_with_it(tmp_path, monkeypatch):
    """tensor_parallel_size=2: vLLM's multiprocessing executor runs two ranks under the worker (whose engine
    core stays in-process); collective_rpc gives each the whole tensors and each loads its shard."""
    # vLLM's CPU build binds each rank's threads to a NUMA node of its own by default; this machine has one
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    shared_memory, temporary = set(os.listdir("/dev/shm")), set(os.listdir(tempfile.gettempdir()))
    model, tokenizer = tiny()
    pool = VLLMRolloutPool(tensor_parallel_size=2, kv_cache_memory_bytes=KV_CACHE, max_restarts=1)
    assert pool.engine_args["distributed_executor_backend"] == "mp"
    sampling = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7)
    try:
        pool.start(save_spec(model, tokenizer, tmp_path / "model"))
        (worker,) = pool.pids()
        ranks = {p: start for p, start in _tree(worker).items() if _processes()[p][0] == worker}
        assert len(ranks) == 2, f"expected two rank processes under the worker, found {ranks}"

        # other weights than the model directory's, which both ranks built their shards from
        perturbed = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for parameter in perturbed.parameters():
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
        version = sync(pool, perturbed)
        requests = group_requests(tokenizer, version, range(4))
        synced = by_prompt(pool.generate(requests, sampling))
        gap = max_logprob_gap(perturbed, requests, synced.values(), sampling.temperature)
        assert gap < 1e-4, "a rank runs other weights"
        assert max_logprob_gap(model, requests, synced.values(), sampling.temperature) > 1e-2

        # stopped ranks cannot notice anything: only PR_SET_PDEATHSIG (set in each rank) takes them with their worker
        for rank in ranks:
            os.kill(rank, signal.SIGSTOP)
        os.kill(worker, signal.SIGKILL)
        assert not _wait_gone(ranks, 10.0), "tensor-parallel ranks outlived their worker"

        again = by_prompt(pool.generate(requests, sampling))  # the dead worker is replaced, with ranks of its own
        assert pool.health().details["restarts"] == 1
        (replacement,) = pool.pids()
        assert len([p for p in _tree(replacement) if _processes()[p][0] == replacement]) == 2
        for prompt_id, group in again.items():
            assert group.completions == synced[prompt_id].completions
            torch.testing.assert_close(group.logprobs, synced[prompt_id].logprobs, atol=1e-5, rtol=0)
        left = {replacement: _processes()[replacement][2], **_tree(replacement)}
    finally:
        pool.close()
    assert not _wait_gone(left, 10.0), "the worker or its ranks outlived close"
    # vLLM's CPU build leaves its ranks' shared-memory all-reduce files behind when they are stopped (its own
    # engine shutdown does too, after its grace period): this test's, removed once every rank is gone
    for name in set(os.listdir("/dev/shm")) - shared_memory:
        if name.startswith("vllm_dist_") and "cpushm" in name:
            os.remove(f"/dev/shm/{name}")
    # the ranks' message queues bind ZeroMQ socket files, which a killed rank cannot remove: in the pool's
    # scratch directory, which close removes, not in the temporary directory
    sockets = [n for n in set(os.listdir(tempfile.gettempdir())) - temporary if _is_socket(tempfile.gettempdir(), n)]
    assert not sockets, f"vLLM's socket files were left in {tempfile.gettempdir()}: {sockets}"
    assert not [n for n in set(os.listdir("/dev/shm")) - shared_memory if n.startswith("lit_parl_vllm_")]


def _is_socket(directory: str, name: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(os.path.join(directory, name)).st_mode)
    except FileNotFoundError:
        return False


# -- the vLLM API the pool relies on ------------------------------------------------------------------
def test_the_vllm_functions_the_pool_calls_still_take_its_arguments():
    """Each vLLM function lit_parl.rollout.vllm_engine calls (its module docstring names them and their files in
    vLLM 0.32.0), bound to the arguments it is called with: a vLLM whose API moved fails here, not in a run."""
    import dataclasses
    import inspect

    from vllm.inputs import tokens_input
    from vllm.lora.request import LoRARequest
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import inplace, layerwise
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.outputs import CompletionOutput
    from vllm.platforms import current_platform
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    weights = iter(())
    calls = [  # (function, positional arguments, keyword arguments) as lit_parl calls it; None stands for self
        (LLMEngine.from_engine_args, (EngineArgs(model="unused"),), {}),
        (
            LLMEngine.add_request,
            (None, "0/0", tokens_input(prompt_token_ids=[4, 5]), VLLMSamplingParams()),
            {"lora_request": None},
        ),
        (LLMEngine.add_lora, (None, LoRARequest("lit_parl-v0", 1, "/adapter")), {}),
        (LLMEngine.remove_lora, (None, 1), {}),
        (LLMEngine.step, (None,), {}),
        (LLMEngine.has_unfinished_requests, (None,), {}),
        (LLMEngine.collective_rpc, (None, "lit_parl_load_weights"), {"args": ({}, 0)}),
        (LLMEngine.reset_prefix_cache, (None,), {}),
        (LLMEngine.set_weight_version, (None, "0"), {}),
        # Worker.reload_weights(*args, **kwargs) passes them on to the model runner's (V1; V2 on GPUs by default)
        (GPUModelRunner.reload_weights, (None,), {"weights_iterator": weights, "is_checkpoint_format": True}),
        (GPUModelRunnerV2.reload_weights, (None,), {"weights_iterator": weights, "is_checkpoint_format": True}),
        (
            inplace.reload_weights,
            (None, None),
            {"weights_iterator": weights, "weights_path": None, "is_checkpoint_format": True},
        ),
        (layerwise.initialize_layerwise_reload, (None,), {}),
        (layerwise.finalize_layerwise_processing, (None, None), {}),
        (Qwen2ForCausalLM.load_weights, (None,), {"weights": weights}),
        (QuantizeMethodBase.process_weights_after_loading, (None, None), {}),
        (LogitsProcessor.__init__, (None, 64), {"scale": 1.0}),
        (CPUAttentionBackend.get_supported_head_sizes, (), {}),
        (tokens_input, (), {"prompt_token_ids": [4, 5]}),
    ]
    for function, args, kwargs in calls:
        try:
            inspect.signature(function).bind(*args, **kwargs)
        except TypeError as error:
            raise AssertionError(
                f"{function.__qualname__}{inspect.signature(function)} no longer takes {args}, {kwargs}: {error}"
            ) from error

    assert "model_runner.reload_weights" in inspect.getsource(Worker.reload_weights)
    assert issubclass(CPUWorker, Worker) and CPUWorker.reload_weights is Worker.reload_weights
    source = inspect.getsource(inplace.reload_weights)
    steps = ("initialize_layerwise_reload(model)", "model.load_weights(", "finalize_layerwise_reload(")
    assert all(step in source for step in steps), "reload_weights loads otherwise"
    assert "self.scale" in inspect.getsource(LogitsProcessor.forward), (
        "the temperature is folded into LogitsProcessor.scale"
    )
    assert all(callable(getattr(current_platform, name)) for name in ("is_cpu", "is_cuda_alike"))

    # every EngineArgs the pool passes exists, and so does every SamplingParams field the engine sets
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    pool = VLLMRolloutPool(
        tensor_parallel_size=2, gpu_memory_utilization=0.5, max_model_len=64, max_num_seqs=4, lora="adapter"
    )
    args = pool.engine_args
    assert set(args) | {"model", "logprobs_mode"} <= fields, sorted(set(args) - fields)
    assert args["enable_lora"] and args["max_loras"] == 1
    VLLMSamplingParams(
        n=1,
        seed=1,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=4,
        stop_token_ids=[1],
        ignore_eos=True,
        stop=None,
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    read = {"token_ids", "logprobs", "finish_reason", "weight_versions"}
    assert read <= {f.name for f in dataclasses.fields(CompletionOutput)}


# -- training -----------------------------------------------------------------------------------------
def vllm_job(run_dir: Path, *overrides: str):
    """``(module, datamodule, trainer)`` of a 3-iteration CLI job through the vLLM pool (8 prompts), in ``run_dir``."""
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                "pool=vllm",
                "iterations=3",
                f"run_dir={run_dir}",
                "checkpoint_every=0",
                "trainer.max_time=00:00:10:00",
                "shape.prompts=8",
                "shape.micro_batch_size=16",
                f"pool.kv_cache_memory_bytes={KV_CACHE}",
                *overrides,
            ],
        )
    return build(cfg)


def logprob_mismatches(run_dir: Path) -> list[float]:
    """Each iteration's rollout-vs-trainer log-prob difference, from the run's ``metrics.csv``."""
    with open(run_dir / "metrics.csv") as f:
        column = "mismatch/logprob_abs_diff"
        return [float(row[column]) for row in csv.DictReader(f) if row.get(column)]


def test_three_iterations_of_the_default_job_through_the_cli_on_vllm(tmp_path):
    module, datamodule, trainer = vllm_job(tmp_path)
    assert isinstance(datamodule.pool, VLLMRolloutPool)
    initial = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
    seen, workers = [], {}
    generate = datamodule.pool.generate

    def recording(requests, sampling):  # what the pool returned, next to what it was asked for
        workers.update({p: _processes()[p][2] for p in datamodule.pool.pids()})
        asked = {r.version for r in requests}
        for group in generate(requests, sampling):
            seen.append((asked, group.version, group.prompt_id))
            yield group

    datamodule.pool.generate = recording
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.pool.close()

    assert [s.version for s in datamodule.history] == [0, 1, 2]
    assert [s.completions for s in datamodule.history] == [8 * 8] * 3
    assert len(seen) == 3 * 8
    for asked, version, _ in seen:
        assert asked == {version}, f"a group of version {version} answered requests for {asked}"
    for version in range(3):
        prompt_ids = [p for _, v, p in seen if v == version]
        assert sorted(prompt_ids) == list(range(8 * version, 8 * version + 8)), "each prompt exactly once"
    mismatch = logprob_mismatches(tmp_path)
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, f"rollout vs trainer log-probs: {mismatch}"
    moved = any(not torch.equal(initial[k], v) for k, v in module.policy.state_dict().items())
    assert moved, "training did not move the policy"
    assert not _wait_gone(workers, 10.0), "vLLM workers outlived the fit"


def test_the_gpu_checks_vllm_section_runs_its_sequence_on_the_cpu_build(tmp_path):
    """gpu_check/gpu_check_vllm.py (the GPU check's vLLM section) with vllm-cpu's settings: the preset built,
    two syncs, the versions, reproduced seeds and log-probs at the float32 bound, all in one record."""
    import json

    script = Path(__file__).resolve().parents[2] / "gpu_check" / "gpu_check_vllm.py"
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--cpu"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    assert record["status"] == "ok", record
    assert record["versions"] == [1] and record["seeds_reproduce"] and record["logprob_gap_mean"] < 1e-4
