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

import ctypes
import os
import queue
import signal
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, PreTrainedModel

from lit_parl.rollout.base import RewardFunction, RolloutPool
from lit_parl.rollout.sampling import sample_groups
from lit_parl.trajectory import Group, GroupRequest, SamplingParams


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its parent dies, however the parent dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not Linux: the worker still exits when it sees its parent gone


def _worker_main(worker_id, config, reward_fn, eos_id, pad_id, threads, inbox, results, parent_pid) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the trainer, which closes the pool
    try:
        torch.set_num_threads(threads)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        shared: dict[str, torch.Tensor] = {}
        version = None
        results.put(("ready", worker_id, os.getpid()))
        while True:
            try:
                message = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:
                    return
                continue
            kind = message[0]
            if kind == "stop":
                return
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
                results.put(("chunk_done", worker_id, start, time.monotonic()))
    except BaseException:  # noqa: BLE001 - report everything to the trainer, then exit
        results.put(("error", worker_id, traceback.format_exc()))


class HFRolloutPool(RolloutPool):
    """``num_workers`` spawned processes of ``threads_per_worker`` CPU threads each.

    Colocated (sync mode: generation and training take turns), each worker gets ``colocated_threads``,
    by default all cores divided between the workers.
    """

    def __init__(
        self,
        num_workers: int = 1,
        threads_per_worker: int = 1,
        prompts_per_request: int = 8,
        colocated_threads: int | None = None,
        start_timeout_s: float = 120.0,
        response_timeout_s: float = 600.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"rollout.pool.num_workers must be >= 1, got {num_workers}")
        if threads_per_worker < 1:
            raise ValueError(f"rollout.pool.threads_per_worker must be >= 1, got {threads_per_worker}")
        if prompts_per_request < 1:
            raise ValueError(f"rollout.pool.prompts_per_request must be >= 1, got {prompts_per_request}")
        self.num_workers = num_workers
        self.threads_per_worker = threads_per_worker
        self.prompts_per_request = prompts_per_request
        self.colocated_threads = colocated_threads  # None: all cores split between the workers
        self.start_timeout_s = start_timeout_s
        self.response_timeout_s = response_timeout_s
        self.version = None
        self._processes: list[mp.Process] = []
        self._inboxes: list = []
        self._results = None
        self._shared: dict[str, torch.Tensor] | None = None
        self._intervals: list[tuple[float, float]] = []
        self._finalizer = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, policy: PreTrainedModel, reward_fn: RewardFunction, eos_id: int, pad_id: int, colocated: bool) -> None:
        if self._processes:
            raise RuntimeError("HFRolloutPool.start called twice")
        if colocated:
            threads = self.colocated_threads or max(1, (os.cpu_count() or 1) // self.num_workers)
        else:
            threads = self.threads_per_worker
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._inboxes = [context.Queue() for _ in range(self.num_workers)]
        for worker_id in range(self.num_workers):
            process = context.Process(
                target=_worker_main,
                args=(worker_id, policy.config, reward_fn, eos_id, pad_id, threads, self._inboxes[worker_id], self._results, os.getpid()),
                name=f"lit_parl-rollout-{worker_id}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        # close the workers even if the owner forgets to (garbage collection or interpreter exit)
        self._finalizer = weakref.finalize(self, _stop_processes, list(self._processes), list(self._inboxes))
        ready = set()
        while len(ready) < self.num_workers:
            kind, worker_id, *_ = self._receive(self.start_timeout_s, "starting")
            if kind != "ready":
                raise RuntimeError(f"rollout worker {worker_id} sent {kind!r} while starting")
            ready.add(worker_id)

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._processes, self._inboxes, self.version = [], [], None

    def health(self) -> dict:
        return {
            "backend": "hf",
            "workers": len(self._processes),
            "alive": sum(p.is_alive() for p in self._processes),
            "version": self.version,
        }

    def reserved_cpus(self, colocated: bool) -> int:
        return 0 if colocated else self.num_workers * self.threads_per_worker

    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    # -- weights ---------------------------------------------------------------------------------------
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._require_started()
        tensors = {name: t.detach() for name, t in named_tensors}
        if self._shared is None:
            self._shared = {name: t.to("cpu", copy=True).share_memory_() for name, t in tensors.items()}
            for inbox in self._inboxes:
                inbox.put(("attach", self._shared))
        else:
            missing = set(self._shared) ^ set(tensors)
            if missing:
                raise ValueError(f"sync_weights got a different set of tensors than before: {sorted(missing)[:5]}")
            with torch.no_grad():
                for name, t in tensors.items():
                    self._shared[name].copy_(t)
        self.version = None  # nothing may be generated until every worker confirmed the new version
        for inbox in self._inboxes:
            inbox.put(("sync", version))
        confirmed = set()
        while len(confirmed) < self.num_workers:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, f"syncing version {version}")
            if kind != "synced" or rest[0] != version:
                raise RuntimeError(f"rollout worker {worker_id} answered {kind!r} {rest} while syncing version {version}")
            confirmed.add(worker_id)
        self.version = version

    # -- generation ------------------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[Group]:
        self._require_started()
        self.check_requests(requests)
        self._intervals = []
        chunks = [requests[i : i + self.prompts_per_request] for i in range(0, len(requests), self.prompts_per_request)]
        # Hand every chunk out now, round-robin: a worker must not wait for the trainer to ask for the next
        # group (the caller trains between two groups, and the workers keep generating meanwhile).
        for i, chunk in enumerate(chunks):
            self._inboxes[i % self.num_workers].put(("generate", chunk, sampling))
        busy = len(chunks)
        waiting = {r.prompt_id for r in requests}
        while waiting:
            kind, worker_id, *rest = self._receive(self.response_timeout_s, "generating")
            if kind == "group":
                group = rest[0]
                if group.prompt_id not in waiting:
                    raise RuntimeError(f"rollout worker {worker_id} returned prompt_id {group.prompt_id}, which was not requested or already returned")
                waiting.discard(group.prompt_id)
                yield group
            elif kind == "chunk_done":
                self._intervals.append((rest[0], rest[1]))
                busy -= 1
            else:
                raise RuntimeError(f"rollout worker {worker_id} sent unexpected {kind!r} while generating")
        while busy:  # collect the last chunk_done so the next call starts clean
            kind, worker_id, *rest = self._receive(self.response_timeout_s, "finishing")
            if kind != "chunk_done":
                raise RuntimeError(f"rollout worker {worker_id} sent unexpected {kind!r} after its groups")
            self._intervals.append((rest[0], rest[1]))
            busy -= 1

    def busy_intervals(self) -> list[tuple[float, float]]:
        return list(self._intervals)

    # -- internals -------------------------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._processes:
            raise RuntimeError("HFRolloutPool is not started (call start() first, or it was closed)")

    def _receive(self, timeout_s: float, doing: str) -> tuple:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                message = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [(p.name, p.exitcode) for p in self._processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"rollout worker(s) died while {doing}: {dead} (name, exit code)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer from the rollout workers for {timeout_s:.0f} s while {doing}") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"rollout worker {message[1]} failed while {doing}:\n{message[2]}")
            return message


def _stop_processes(processes: list, inboxes: list) -> None:
    for inbox in inboxes:
        try:
            inbox.put(("stop",))
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 5.0
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=5.0)
