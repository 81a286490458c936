"""Every request lit_parl's SGLang pool sends, checked against SGLang's own code (the sglang wheel pinned in
requirements.txt, 0.5.23).

The requests are those of a scripted run of ``SGLangRolloutPool`` against the stand-in server (``pool_run``):
health checks, server info, generation of every kind, and syncs by ``tensor`` (``tp_size=2``), ``disk`` and
``distributed``. Each is checked against:

* the route table of SGLang's HTTP server (``sglang.srt.entrypoints.http_server.app``): path and method;
* SGLang's HTTP front end itself (that app, its tokenizer manager stubbed: ``sglang_side``): the body decodes
  into the route's own request class (``GenerateReqInput`` and the ``/generate`` contract gate; the msgspec
  weight-update structs of ``managers/io_struct.py``), and ``/generate``'s ``sampling_params`` pass SGLang's
  ``SamplingParams`` with its ``normalize`` and ``verify``, meaning what the pool means;
* SGLang's deserializer (``MultiprocessingSerializer`` with its ``SafeUnpickler``, in another process, as a TP
  worker runs it): each tensor update carries one payload per TP rank, each giving exactly the synced tensors;
  each LoRA adapter (``sync.lora=adapter``) too, as the ``{name: tensor}`` dict its LoRA manager takes.
"""

from __future__ import annotations

import torch

from sglang_contract.sglang_side import pinned_version, require_sglang

require_sglang()

from sglang.srt.sampling.sampling_params import TOP_K_ALL  # noqa: E402
from sglang.version import __version__ as SGLANG_VERSION  # noqa: E402

from sglang_contract.pool_run import GROUP_SIZE, SAMPLINGS, STOP_STRING, STOP_TOKEN, TP_SIZE  # noqa: E402

# every route the run uses, and the class SGLang's handler decodes a POST body into (http_server.py)
ROUTES = {
    ("GET", "/health"): None,
    ("GET", "/server_info"): None,
    ("GET", "/model_info"): None,
    ("POST", "/generate"): "GenerateReqInput",
    ("POST", "/pause_generation"): "PauseGenerationReqInput",
    ("POST", "/continue_generation"): "ContinueGenerationReqInput",
    ("POST", "/flush_cache"): None,  # no body: http_server.py's flush_cache takes only a `timeout` query parameter
    ("POST", "/begin_weight_update"): "BeginWeightUpdateReqInput",
    ("POST", "/end_weight_update"): "EndWeightUpdateReqInput",
    ("POST", "/update_weights_from_tensor"): "UpdateWeightsFromTensorReqInput",
    ("POST", "/update_weights_from_disk"): "UpdateWeightFromDiskReqInput",
    ("POST", "/init_weights_update_group"): "InitWeightsUpdateGroupReqInput",
    ("POST", "/update_weights_from_distributed"): "UpdateWeightsFromDistributedReqInput",
    ("POST", "/destroy_weights_update_group"): "DestroyWeightsUpdateGroupReqInput",
    ("POST", "/load_lora_adapter_from_tensors"): "LoadLoRAAdapterFromTensorsReqInput",
    ("POST", "/unload_lora_adapter"): "UnloadLoRAAdapterReqInput",
    ("POST", "/update_weight_version"): "UpdateWeightVersionReqInput",
}


def test_the_installed_sglang_is_the_pinned_one():
    assert SGLANG_VERSION == pinned_version("sglang"), (
        "the checks of this directory are of the pinned SGLang; update them with the pin"
    )


def test_every_route_the_pool_uses_is_in_sglangs_route_table(run):
    from sglang_contract.sglang_side import route_table

    table = route_table()
    used = {(s.method, s.path) for s in run.sent}
    assert used == set(ROUTES), f"the run used {sorted(used ^ set(ROUTES))} unexpectedly (or not at all): update ROUTES"
    missing = sorted((method, path) for method, path in used if method not in table.get(path, set()))
    assert not missing, f"routes the pool uses that SGLang {SGLANG_VERSION} does not serve: {missing}"
    assert all(s.body is None for s in run.sent if s.method == "GET")
    assert all(s.error is None for s in run.sent if s.path != "/health"), [s.error for s in run.sent if s.error]


def test_every_request_body_is_accepted_by_sglangs_http_front_end_as_its_request_class(run):
    refused = []
    for sent in run.where("POST"):
        verdict = sent.verdict
        expected = ROUTES[("POST", sent.path)]
        if not verdict.accepted or verdict.request_class != expected:
            refused.append(
                f"{sent.phase} POST {sent.path} {str(sent.body)[:200]}: HTTP {verdict.status} "
                f"as {verdict.request_class} (expected {expected}): {verdict.text}"
            )
    assert not refused, "SGLang refuses requests of the pool:\n" + "\n".join(refused)


def test_generate_requests_mean_in_sglangs_sampling_params_what_the_pool_means(run):
    """Each sample's own seed, the end and stop tokens, stop strings, greedy as SGLang makes it (T = 1, top-k 1),
    top-k and top-p, log-probs requested, the stop token kept: read from SGLang's ``SamplingParams`` after its
    ``__post_init__``, ``normalize`` and ``verify``."""
    assert set(run.requests) == {f"generate:{name}:0" for name in SAMPLINGS} | {
        f"generate:sampled:{v}" for v in (1, 2, 3, 5, 6)
    }
    for phase, requests in run.requests.items():
        sampling = SAMPLINGS[phase.split(":")[1]]
        sent = run.where("POST", "/generate", phase)
        assert len(sent) == len(requests) * GROUP_SIZE, phase  # one request per sample
        prompts = {r.prompt_tokens for r in requests}
        seeds = sorted(seed for r in requests for seed in r.seeds)
        assert sorted(s.verdict.sampling["sampling_seed"] for s in sent) == seeds, phase  # each sample its own seed
        for s in sent:
            fields, params = s.verdict.fields, s.verdict.sampling
            assert tuple(fields["input_ids"]) in prompts and fields["return_logprob"] is True and not fields["stream"]
            assert params["n"] == 1 and params["max_new_tokens"] == sampling.max_new_tokens
            assert params["stop_token_ids"] == {run.eos_id, *sampling.stop_token_ids}
            assert params["no_stop_trim"] is True and params["skip_special_tokens"] is False
            if sampling.temperature == 0:  # SGLang's greedy: sampling_params.py, SamplingParams.__post_init__
                assert (params["temperature"], params["top_k"]) == (1.0, 1)
            else:
                assert params["temperature"] == sampling.temperature and params["top_p"] == sampling.top_p
                assert params["top_k"] == (sampling.top_k if sampling.top_k > 0 else TOP_K_ALL)
            assert params["stop_strs"] == list(sampling.stop) and params["is_normalized"]
    filtered = run.where("POST", "/generate", "generate:filtered")[0].verdict.sampling
    assert filtered["stop_token_ids"] == {run.eos_id, STOP_TOKEN} and filtered["stop_strs"] == [STOP_STRING]
    assert (filtered["top_k"], filtered["top_p"]) == (5, 0.9)


def test_weight_updates_decode_into_sglangs_structs_with_the_intended_fields(run):
    """``weight_version`` a string (``Optional[str]`` in io_struct.py: SGLang reports it back verbatim), the cache
    flushed once per sync, the distributed group's ranks, names, dtypes and shapes as SGLang reads them."""
    for version, method in run.sync_methods.items():
        path = {
            "tensor": "/update_weights_from_tensor",
            "disk": "/update_weights_from_disk",
            "distributed": "/update_weights_from_distributed",
        }[method]
        updates = run.where("POST", path, f"sync:{method}:{version}")
        assert updates, (method, version)
        for sent in updates:
            fields = sent.verdict.fields
            assert fields["weight_version"] == str(version) and isinstance(fields["weight_version"], str)
            assert fields["flush_cache"] is (
                method == "disk"
            )  # tensor and distributed: /flush_cache after the last bucket
            assert fields["abort_all_requests"] is False
    # every sync pauses in SGLang's default mode, abort: a sample still running is ended and retried elsewhere
    # (none runs between iterations; the stand-in does not abort)
    pauses = [s.verdict.fields for s in run.where("POST", "/pause_generation")]
    assert pauses and all(p["mode"] == "abort" for p in pauses)
    disk = run.where("POST", "/update_weights_from_disk")[0].verdict.fields
    assert disk["model_path"].endswith("version_2") and disk["load_format"] is None

    init = [s.verdict.fields for s in run.where("POST", "/init_weights_update_group")]
    destroyed = [s.verdict.fields for s in run.where("POST", "/destroy_weights_update_group")]
    assert len(init) == 1 and [d["group_name"] for d in destroyed] == [run.group_name]  # left when the pool closes
    assert (init[0]["rank_offset"], init[0]["world_size"], init[0]["group_name"]) == (1, 2, run.group_name)
    assert isinstance(init[0]["master_port"], int) and init[0]["backend"] == "gloo"
    names, dtypes, shapes = [], [], []
    for sent in run.where("POST", "/update_weights_from_distributed"):
        fields = sent.verdict.fields
        assert fields["group_name"] == run.group_name
        names += fields["names"]
        dtypes += fields["dtypes"]
        shapes += fields["shapes"]
    synced = run.weights[3]
    assert names == list(synced)
    # SGLang reads a dtype as getattr(torch, dtype) (model_runner_components/weight_updater.py:282-285)
    assert [getattr(torch, d) for d in dtypes] == [t.dtype for t in synced.values()]
    assert shapes == [list(t.shape) for t in synced.values()]


def test_tensor_updates_carry_one_payload_per_tp_rank_that_sglang_deserializes_to_the_synced_tensors(run):
    for version in (0, 1):
        updates = run.where("POST", "/update_weights_from_tensor", f"sync:tensor:{version}")
        received: list[list[tuple[str, torch.Tensor]]] = [[] for _ in range(TP_SIZE)]
        for sent in updates:
            assert len(sent.body["serialized_named_tensors"]) == TP_SIZE  # TpModelWorker: payloads[tp_rank]
            ranks = sent.verdict.rank_tensors()
            assert len(ranks) == TP_SIZE
            for rank, named in enumerate(ranks):
                received[rank] += named
        synced = run.weights[version]
        for rank, named in enumerate(received):
            assert [name for name, _ in named] == list(synced), f"TP rank {rank} of version {version}"
            for name, tensor in named:
                assert tensor.dtype == synced[name].dtype and torch.equal(tensor, synced[name]), (
                    f"{name} at TP rank {rank}"
                )


def test_syncs_follow_sglangs_session_protocol(run):
    """Tensor and distributed updates only inside ``/begin_weight_update`` ... ``/end_weight_update`` (SGLang refuses
    them outside: scheduler_components/weight_updater.py:195 and :237), generation paused around every sync, the
    cache flushed and the version read back before generation continues."""
    for version, method in run.sync_methods.items():
        order = [s.path for s in run.where(phase=f"sync:{method}:{version}")]
        update = {
            "tensor": "/update_weights_from_tensor",
            "disk": "/update_weights_from_disk",
            "distributed": "/update_weights_from_distributed",
        }[method]
        updates = [p for p in order if p == update]
        if method == "disk":
            expected = ["/pause_generation", update, "/flush_cache", "/model_info", "/continue_generation"]
        else:
            first = (
                ["/pause_generation", "/init_weights_update_group"]
                if method == "distributed"
                else ["/pause_generation"]
            )
            expected = [
                *first,
                "/begin_weight_update",
                *updates,
                "/end_weight_update",
                "/flush_cache",
                "/model_info",
                "/continue_generation",
            ]
        assert order == expected, (method, version)


def test_the_trainer_applies_sglangs_own_cuda_ipc_patch_before_pickling_cuda_weights():
    """``weight_transfer.send_cuda_devices_by_uuid`` (called before CUDA tensors are pickled) installs SGLang's
    ``monkey_patch_torch_reductions`` in the trainer's process: torch's tensor reduction is then SGLang's, which
    writes the device's UUID where torch writes its index (``srt/utils/patch_torch.py``). In a process of its
    own: the patch is process-wide, and SGLang's reduction no longer pickles CPU tensors. A real CUDA handle
    crossing processes is the GPU check's (gpu_check/gpu_check_sglang.py)."""
    import subprocess
    import sys
    from pathlib import Path

    check = (
        "from sglang_contract.sglang_side import import_sglang; import_sglang()\n"
        "from torch.multiprocessing import reductions\n"
        "from sglang.srt.utils import patch_torch\n"
        "from lit_parl.rollout.weight_transfer import send_cuda_devices_by_uuid\n"
        "assert reductions.reduce_tensor is not patch_torch._reduce_tensor_modified\n"
        "send_cuda_devices_by_uuid()\n"
        "assert reductions.reduce_tensor is patch_torch._reduce_tensor_modified\n"
        "assert reductions.rebuild_cuda_tensor is patch_torch._rebuild_cuda_tensor_modified\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_adapter_syncs_load_each_versions_adapter_as_sglang_reads_one(run):
    """``sync.lora=adapter``: per version, ``/load_lora_adapter_from_tensors`` under the version's own name, with
    peft's config as SGLang's ``LoRAConfig`` reads it (rank, alpha, the target modules it normalizes to), one
    payload per TP rank that SGLang's deserializer turns into exactly the adapter's tensors, each named where
    SGLang places it (a layer index, ``lora_A``/``lora_B``); then the previous version's adapter unloaded, the
    version set (loading an adapter leaves it) and read back; every ``/generate`` of that version names the
    adapter in ``lora_path``."""
    from sglang.srt.layers.utils.common import get_layer_id
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules

    load, unload = "/load_lora_adapter_from_tensors", "/unload_lora_adapter"
    for version in (5, 6):
        phase = f"adapter:{version}"
        order = [s.path for s in run.where(phase=phase)]
        assert order == [load, *([unload] if version == 6 else []), "/update_weight_version", "/model_info"]
        name = f"lit_parl-v{version}"
        (sent,) = run.where("POST", load, phase)
        fields = sent.verdict.fields
        assert fields["lora_name"] == name and not fields["pinned"] and fields["load_format"] is None
        config = LoRAConfig.from_dict(fields["config_dict"])
        assert (config.r, config.lora_alpha, config.use_dora) == (4, 8.0, False)
        normalized = get_normalized_target_modules(config.target_modules)
        assert normalized == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}  # every linear layer of Qwen2
        expected = run.adapters[version][1]
        ranks = sent.verdict.rank_tensors()
        assert len(sent.body["serialized_named_tensors"]) == TP_SIZE == len(ranks)
        for rank, named in enumerate(ranks):
            assert [n for n, _ in named] == list(expected), f"TP rank {rank}"
            assert all(torch.equal(t, expected[n]) for n, t in named), f"TP rank {rank}"
        for tensor_name in expected:
            assert get_layer_id(tensor_name) is not None and ("lora_A" in tensor_name) != ("lora_B" in tensor_name)
        if version == 6:
            assert run.where("POST", unload, phase)[0].verdict.fields["lora_name"] == "lit_parl-v5"
        (stamp,) = run.where("POST", "/update_weight_version", phase)
        fields = stamp.verdict.fields
        assert (fields["new_version"], fields["abort_all_requests"]) == (str(version), False)
        generates = run.where("POST", "/generate", f"generate:sampled:{version}")
        assert generates and all(s.verdict.fields["lora_path"] == name for s in generates)
    assert all(s.verdict.fields["lora_path"] is None for s in run.where("POST", "/generate", "generate:sampled:4"))


def test_episode_continuations_are_generate_requests_sglang_reads_as_the_episode_so_far(run):
    """Multi-turn episodes' later turns: each ``/generate`` body decodes into SGLang's ``GenerateReqInput`` with the
    episode's tokens as sampled so far (the prompt, the model's turns and the observations) and the turn's seed."""
    from lit_parl.episodes.episode import turn_seed

    sent = run.where("POST", "/generate", "episodes")
    assert run.episodes and len(sent) > len(run.episodes) * GROUP_SIZE, "no episode had a second turn"
    assert all(s.verdict.accepted and s.verdict.request_class == "GenerateReqInput" for s in sent)
    turns = 0
    for request, group in run.episodes:
        for sample, tokens, episode in zip(group.sample_indices, group.completions, group.episodes):
            whole = [*request.prompt_tokens, *tokens]
            seeds = [turn_seed(request.seeds[sample], t) for t in range(4)]
            mine = [s for s in sent if s.verdict.sampling["sampling_seed"] in seeds]
            model_turns = sum(1 for role, _ in episode.turns if role == "assistant")
            assert len(mine) == model_turns
            for s in mine:
                context = list(s.verdict.fields["input_ids"])
                assert whole[: len(context)] == context and len(context) >= len(request.prompt_tokens)
                assert s.verdict.sampling["n"] == 1
            turns += model_turns
    assert turns == len(sent)
