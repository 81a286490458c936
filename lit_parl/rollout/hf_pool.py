"""The embedded rollout pool: spawned worker processes sampling with a transformers model.

Each worker builds the policy's architecture from ``PoolSpec.model_dir``'s config (no weights are read
there: the first sync brings them). Weights travel through shared memory: the pool copies each bucket
into shared tensors as it arrives; at the first sync each worker makes its model's parameters those
shared tensors (a copy only where the dtype differs), so later syncs are the pool's one copy, and each
worker confirms the version once it handled the sync message.
The iteration's requests go out at once, in chunks of ``prompts_per_request`` prompts spread
round-robin over the workers. A worker emits each group as soon as it is finished and goes straight on
with its next chunk while the trainer trains.

Example::

    >>> import shutil, tempfile
    >>> from lit_parl.models import tiny_qwen2
    >>> from lit_parl.rollout import PoolSpec
    >>> from lit_parl.rollout.records import GroupRequest, SamplingParams
    >>> model, tok = tiny_qwen2()
    >>> model_dir = tempfile.mkdtemp()
    >>> model.save_pretrained(model_dir); _ = tok.save_pretrained(model_dir)
    >>> pool = HFRolloutPool(num_workers=1)
    >>> pool.start(PoolSpec(model_dir, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id))
    >>> pool.sync_weights([list(model.named_parameters())], version=0)  # one bucket: the whole model
    >>> request = GroupRequest(prompt_id=0, prompt_tokens=(4, 5, 41), version=0, seeds=(1, 2))
    >>> groups = pool.generate([request], SamplingParams(max_new_tokens=4))
    >>> [(g.prompt_id, g.version, len(g.completions)) for g in groups]
    [(0, 0, 2)]
    >>> pool.close(); shutil.rmtree(model_dir)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_parl.rollout.pool_records import PoolSpec
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE
from lit_parl.rollout.sampling import sample_groups
from lit_parl.rollout.spawned_worker_pool import SpawnedWorkerPool
from lit_parl.rollout.stop_strings import load_tokenizer


class HFEngine:
    """A transformers model inside one ``hf`` worker (built there, see ``lit_parl.rollout.worker_loop.serve``).

    Args:
        model_dir: the directory whose ``config.json`` gives the architecture; its weights are not read.
            Its tokenizer is loaded on the first request with stop strings (they are matched in text).
        eos_id: the end token (kept in completions).
        pad_id: the token left-padding a batch of prompts.
        threads: CPU threads this worker's torch uses.
    """

    def __init__(self, model_dir: str, eos_id: int, pad_id: int, threads: int) -> None:
        torch.set_num_threads(threads)
        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        self.model_dir, self.eos_id, self.pad_id = model_dir, eos_id, pad_id
        self.tokenizer = None

    def load(self, shared: dict[str, torch.Tensor], version: int) -> None:
        parameters = dict(self.model.named_parameters())
        if set(parameters) != set(shared):
            missing, extra = sorted(set(parameters) - set(shared)), sorted(set(shared) - set(parameters))
            raise ValueError(
                f"version {version}'s tensors do not fit the model: missing {missing[:5]}, unknown {extra[:5]}"
            )
        with torch.no_grad():
            for name, parameter in parameters.items():
                source = shared[name]
                if parameter.data_ptr() == source.data_ptr():
                    continue  # already the shared tensor: the pool's copy into it was the whole sync
                if (parameter.dtype, parameter.shape, parameter.device) == (source.dtype, source.shape, source.device):
                    # Zero-copy: the parameter becomes the shared tensor (a tied head is the same Parameter and
                    # follows). Safe because the pool writes the shared tensors only in sync_weights, between
                    # generate calls, and this worker confirms the version only once this message is handled.
                    parameter.data = source
                else:  # another dtype than the engine's (a bfloat16 policy into a float32 engine): a copy
                    parameter.copy_(source)

    def sample(
        self, requests: list[GroupRequest], sampling: SamplingParams, version: int
    ) -> Iterator[GroupCompletions]:
        if sampling.stop and self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.model_dir, sampling.stop)
        for sampled in sample_groups(self.model, requests, sampling, self.eos_id, self.pad_id, self.tokenizer):
            r = sampled.request
            yield GroupCompletions(
                prompt_id=r.prompt_id,
                version=version,  # the version this worker holds, not the one it was asked for
                sample_indices=list(range(r.group_size)),
                completions=sampled.completions,
                logprobs=sampled.logprobs,
                finish_reasons=sampled.finish_reasons,
            )


class HFRolloutPool(SpawnedWorkerPool):
    """Workers that each hold a transformers model and sample chunks of ``prompts_per_request`` prompts.

    Owns how the engine is built and how requests are split; the processes, the weights and the messages
    are ``SpawnedWorkerPool``'s.

    Args:
        num_workers: worker processes.
        threads_per_worker: CPU threads of each worker while the trainer runs beside it.
        prompts_per_request: prompts per generation batch; groups stream back chunk by chunk.
        colocated_threads: CPU threads of each worker when generation and training take turns;
            ``None``: all cores divided between the workers.
        start_timeout_s: how long the workers may take to build their models.
        response_timeout_s: how long a worker that owes an answer (a group, the end of its work, a sync
            confirmation) may stay silent before it is taken for hung, killed and replaced.
        max_restarts: dead or hung workers replaced within one ``generate`` or ``sync_weights`` call (their
            unfinished requests re-issued with the same seeds); the next failure stops the run.
        cores: CPU cores the workers are pinned to, split between them in order; ``None``: not pinned
            (``SpawnedWorkerPool``).
    """

    backend = "hf"
    worker_label = "rollout worker"
    process_name = "lit_parl-rollout"

    def __init__(
        self,
        num_workers: int = 1,
        threads_per_worker: int = 1,
        prompts_per_request: int = 8,
        colocated_threads: int | None = None,
        start_timeout_s: float = 120.0,
        response_timeout_s: float = 600.0,
        max_restarts: int = 3,
        cores: Sequence[int] | None = None,
    ) -> None:
        super().__init__(
            num_workers, threads_per_worker, colocated_threads, start_timeout_s, response_timeout_s, max_restarts, cores
        )
        if prompts_per_request < 1:
            raise ValueError(
                f"HFRolloutPool(prompts_per_request={prompts_per_request}): at least one prompt per request"
            )
        self.prompts_per_request = prompts_per_request

    def logprob_tolerance(self) -> float | None:
        return FP32_LOGPROB_TOLERANCE  # the engine's model is float32 (built from the config, weights copied in)

    def _engine(self, spec: PoolSpec, threads: int):
        return functools.partial(HFEngine, str(spec.model_dir), spec.eos_id, spec.pad_id, threads)

    def _assign(self, requests: list[GroupRequest]) -> list[tuple[int, list[GroupRequest]]]:
        size = self.prompts_per_request
        chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
        return [(i % self.num_workers, chunk) for i, chunk in enumerate(chunks)]
