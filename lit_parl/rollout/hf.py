"""The embedded rollout pool: spawned worker processes sampling with a transformers model.

Weights travel through shared memory: the trainer copies the policy into shared tensors, each worker
copies them into its own model and confirms the version. The iteration's requests go out at once, in
chunks of ``prompts_per_request`` prompts spread round-robin over the workers. A worker emits each
group as soon as it is finished and goes straight on with its next chunk while the trainer trains.
Workers score their groups, so scoring overlaps training too.

Example::

    >>> from lit_parl.model import tiny_qwen2
    >>> from lit_parl.tasks import CopyTask
    >>> from lit_parl.trajectory import GroupRequest, SamplingParams
    >>> model, tok = tiny_qwen2()
    >>> pool = HFRolloutPool(num_workers=1)
    >>> pool.start(model, CopyTask(), eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, colocated=False)
    >>> pool.sync_weights(model.named_parameters(), version=0)
    >>> request = GroupRequest(prompt_id=0, prompt_ids=(4, 5, 41), answer_ids=(4, 5), version=0, seeds=(1, 2))
    >>> [g.prompt_id for g in pool.generate([request], SamplingParams(max_new_tokens=4))]
    [0]
    >>> pool.close()
"""

from __future__ import annotations

import os
import signal
import time
import traceback
import weakref
from collections.abc import Iterator

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lit_parl.rollout.base import RewardFunction
from lit_parl.rollout.sampling import sample_groups
from lit_parl.rollout.workers import SpawnedWorkerPool, die_with_parent, inbox_messages, stop_processes
from lit_parl.trajectory import Group, GroupRequest, SamplingParams


def _worker_main(worker_id, config, reward_fn, eos_id, pad_id, threads, inbox, results, parent_pid) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    try:
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        shared: dict[str, torch.Tensor] = {}
        version = None
        results.put(("ready", worker_id, os.getpid()))
        for message in inbox_messages(inbox, parent_pid):
            kind = message[0]
            if kind == "attach":
                shared = message[1]
            elif kind == "sync":
                with torch.no_grad():
                    for name, parameter in model.named_parameters():
                        parameter.copy_(shared[name])
                version = message[1]
                results.put(("synced", worker_id, version))
            elif kind == "generate":
                requests, sampling = message[1], message[2]
                stale = sorted({r.version for r in requests if r.version != version})
                if stale:
                    raise RuntimeError(f"worker {worker_id} holds policy version {version} but got requests for {stale}")
                start = time.monotonic()
                for sampled in sample_groups(model, requests, sampling, eos_id, pad_id):
                    r = sampled.request
                    rewards = [reward_fn.reward(list(r.answer_ids), c, eos_id) for c in sampled.completions]
                    group = Group(
                        prompt_id=r.prompt_id,
                        version=version,  # the version this worker held, not the one it was asked for
                        sample_indices=list(range(r.group_size)),
                        completions=sampled.completions,
                        logprobs=sampled.logprobs,
                        rewards=rewards,
                        finish_reasons=sampled.finish_reasons,
                    )
                    results.put(("group", worker_id, group))
                results.put(("done", worker_id, start, time.monotonic()))
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        results.put(("error", worker_id, traceback.format_exc()))


class HFRolloutPool(SpawnedWorkerPool):
    """Workers that each hold a transformers model and sample chunks of ``prompts_per_request`` prompts.

    Owns the model's construction in the workers and how the requests are split; the processes, the
    weights and the messages are ``SpawnedWorkerPool``'s.
    """

    backend = "hf"
    worker_label = "rollout worker"

    def __init__(
        self,
        num_workers: int = 1,
        threads_per_worker: int = 1,
        prompts_per_request: int = 8,
        colocated_threads: int | None = None,
        start_timeout_s: float = 120.0,
        response_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(num_workers, threads_per_worker, colocated_threads, start_timeout_s, response_timeout_s)
        if prompts_per_request < 1:
            raise ValueError(f"rollout.pool.prompts_per_request must be >= 1, got {prompts_per_request}")
        self.prompts_per_request = prompts_per_request

    def start(self, policy: PreTrainedModel, reward_fn: RewardFunction, eos_id: int, pad_id: int, colocated: bool) -> None:
        self._open_queues()
        # close the workers even if the owner forgets to (garbage collection or interpreter exit)
        self._finalizer = weakref.finalize(self, stop_processes, self._processes, self._inboxes)
        threads = self._worker_threads(colocated)
        self._spawn(_worker_main, (policy.config, reward_fn, eos_id, pad_id, threads), name="lit_parl-rollout", daemon=True)

    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[Group]:
        self._require_started()
        self.check_requests(requests)
        chunks = [requests[i : i + self.prompts_per_request] for i in range(0, len(requests), self.prompts_per_request)]
        # Hand every chunk out now, round-robin: a worker must not wait for the trainer to ask for the next
        # group (the caller trains between two groups, and the workers keep generating meanwhile).
        for i, chunk in enumerate(chunks):
            self._inboxes[i % self.num_workers].put(("generate", chunk, sampling))
        yield from self._collect(requests, busy=len(chunks))
