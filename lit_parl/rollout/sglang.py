"""The SGLang rollout pool: SGLang servers generate, the trainer trains (DESIGN.md section 4).

The pool launches ``python -m sglang.launch_server`` subprocesses (or attaches to running servers by URL)
and talks to them through SGLang's native HTTP API:

- generation: one ``POST /generate`` per sample, all of the iteration's samples in flight at once, each
  group handed to the trainer the moment its G samples are finished. Each sample has its own
  ``sampling_seed`` (one request with ``n=G`` would give every sample the same seed), ``return_logprob``
  for the sampled tokens' log-probs and ``no_stop_trim`` so the stop token stays in the completion.
  Single requests, not batches: ``sglang_router`` accepts only those, and a retry redoes one sample. Each answer's ``meta_info.weight_version`` stamps the group: the datamodule refuses any
  version other than the iteration's.
- weight sync, wrapped in ``/pause_generation`` → update → ``/flush_cache`` → ``/get_weight_version``
  (every server must report the new version) → ``/continue_generation``, by one of three methods:
  ``tensor`` (``/update_weights_from_tensor``: CUDA IPC handles, trainer and servers on one node),
  ``distributed`` (``/init_weights_update_group`` once, then ``/update_weights_from_distributed`` while the
  trainer broadcasts over NCCL: servers on other nodes), ``disk`` (a safetensors checkpoint in
  ``sync_dir``, which every server must see, and ``/update_weights_from_disk``).
- failures: a request that fails (connection refused or reset, timeout, 5xx, an aborted sample) is sent
  again to another live server, at most ``max_retries`` times; a server that fails its health check is
  dropped. A group is handed over once, whatever the retries. With no live server left, or a malformed
  answer, ``generate`` raises with the server's URL; nothing is silently lost.
- ``router=True`` launches ``sglang_router`` in front of the servers and sends generation through it;
  weight updates still go to every server directly, so each one's version is confirmed.
- ``close()`` stops exactly what the pool launched (servers, router, their process groups) and leaves
  attached servers running.

SGLang needs a GPU; on a CPU machine the tests run this pool against a stand-in server
(``tests/sglang_standin.py``) that implements the same endpoints over a tiny transformers model.

Example (on a GPU node with ``pip install lit-parl[sglang]``)::

    pool = SGLangRolloutPool(num_servers=2, tp_size=1, sync_method="tensor", mem_fraction_static=0.6)
    pool.start(policy, task, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, colocated=False)
    pool.sync_weights(policy.named_parameters(), version=0)
    for group in pool.generate(requests, SamplingParams(max_new_tokens=512)):
        ...
    pool.close()

or from the CLI: ``lit-parl rollout=sglang rollout.pool.num_servers=2``.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from lit_parl.rollout.base import RewardFunction, RolloutPool
from lit_parl.rollout.weight_transfer import (
    broadcast_from_trainer,
    init_weight_update_group,
    save_for_disk_update,
    serialize_named_tensors,
)
from lit_parl.trajectory import Group, GroupRequest, SamplingParams

SYNC_METHODS = ("tensor", "distributed", "disk")


class ServerError(RuntimeError):
    """A server answered with an error status or an aborted sample: worth retrying elsewhere."""


class MalformedResponse(RuntimeError):
    """A server answered something that is not SGLang's documented response: not retried."""


@dataclass
class _Server:
    url: str
    process: subprocess.Popen | None = None  # None: attached, not ours to stop
    log_path: Path | None = None
    alive: bool = True
    in_flight: int = 0
    busy_from: float | None = None
    busy_to: float | None = None
    failures: list[str] = field(default_factory=list)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop_launched(processes: list[subprocess.Popen], workdir: str | None) -> None:
    """SIGTERM each launched process group, SIGKILL what is left after 15 s, then remove the work dir."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 15.0
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # also the server's own children, if any survived
        except (ProcessLookupError, PermissionError):
            pass
        if process.poll() is None:
            process.wait(timeout=5.0)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


class SGLangRolloutPool(RolloutPool):
    """SGLang servers as the rollout pool. Launch ``num_servers`` servers (``urls=None``) or attach to ``urls``.

    ``model_path``: what the launched servers load (a local directory or hub name); ``None`` saves the
    trainer's policy into the pool's work directory first. ``gpu_ids`` lists the GPUs to hand out,
    ``tp_size`` per server in order (``None``: SGLang's default placement). ``server_args``: extra
    ``launch_server`` arguments. ``launch_command`` replaces ``[python, -m, sglang.launch_server]`` (tests
    point it at the stand-in).
    """

    def __init__(
        self,
        urls: list[str] | None = None,
        model_path: str | None = None,
        num_servers: int = 1,
        tp_size: int = 1,
        host: str = "127.0.0.1",
        port: int = 30000,
        mem_fraction_static: float | None = None,
        server_args: list[str] | tuple[str, ...] = (),
        gpu_ids: list[int] | None = None,
        router: bool = False,
        router_port: int = 30100,
        router_args: list[str] | tuple[str, ...] = (),
        sync_method: str = "tensor",
        sync_dir: str | None = None,
        dist_master_address: str = "127.0.0.1",
        dist_master_port: int = 29650,
        dist_backend: str = "nccl",
        group_name: str = "lit_parl_weight_update",
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        start_timeout_s: float = 900.0,
        attach_timeout_s: float = 10.0,
        max_concurrent_requests: int = 1024,
        launch_command: list[str] | None = None,
    ) -> None:
        if sync_method not in SYNC_METHODS:
            raise ValueError(f"rollout.pool.sync_method={sync_method!r}; choose one of {SYNC_METHODS}")
        if urls is not None and not urls:
            raise ValueError("rollout.pool.urls is empty: give at least one server URL, or null to launch servers")
        if urls is None and num_servers < 1:
            raise ValueError(f"rollout.pool.num_servers must be >= 1, got {num_servers}")
        if gpu_ids is not None and len(gpu_ids) < num_servers * tp_size:
            raise ValueError(f"rollout.pool.gpu_ids has {len(gpu_ids)} GPUs; {num_servers} servers x tp_size {tp_size} need {num_servers * tp_size}")
        if max_retries < 0:
            raise ValueError(f"rollout.pool.max_retries must be >= 0, got {max_retries}")
        self.urls = [u.rstrip("/") for u in urls] if urls else None
        self.model_path = model_path
        self.num_servers = len(urls) if urls else num_servers
        self.tp_size = tp_size
        self.host = host
        self.port = port
        self.mem_fraction_static = mem_fraction_static
        self.server_args = list(server_args)
        self.gpu_ids = list(gpu_ids) if gpu_ids is not None else None
        self.router = router
        self.router_port = router_port
        self.router_args = list(router_args)
        self.sync_method = sync_method
        self.sync_dir = sync_dir
        self.dist_master_address = dist_master_address
        self.dist_master_port = dist_master_port
        self.dist_backend = dist_backend
        self.group_name = group_name
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.start_timeout_s = start_timeout_s
        self.attach_timeout_s = attach_timeout_s
        self.max_concurrent_requests = max_concurrent_requests
        self.launch_command = list(launch_command) if launch_command else [sys.executable, "-m", "sglang.launch_server"]
        self.version = None
        self._servers: list[_Server] = []
        self._router: _Server | None = None
        self._workdir: str | None = None
        self._model_dir: str | None = None
        self._config_dir: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session = None
        self._update_group = None
        self._finalizer = None
        self._reward_fn: RewardFunction | None = None
        self._eos_id = self._pad_id = None

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self, policy: PreTrainedModel, reward_fn: RewardFunction, eos_id: int, pad_id: int, colocated: bool) -> None:
        if self._servers:
            raise RuntimeError("SGLangRolloutPool.start called twice")
        try:
            import aiohttp  # noqa: F401
        except ImportError as error:
            raise ImportError("the sglang rollout pool needs aiohttp: pip install 'lit-parl[sglang]'") from error
        self._reward_fn, self._eos_id, self._pad_id = reward_fn, eos_id, pad_id
        self._workdir = tempfile.mkdtemp(prefix="lit_parl_sglang_")
        self._model_dir = self.model_path
        if self._model_dir is None or not Path(self._model_dir).is_dir():
            # the servers start from the trainer's architecture; the first sync brings θ_0 anyway
            local = Path(self._workdir) / "initial_policy"
            policy.save_pretrained(local, safe_serialization=True)
            if self._model_dir is None:
                self._model_dir = str(local)
            self._config_dir = str(local)
        else:
            self._config_dir = self._model_dir
        self._start_loop()
        if self.urls is None:
            self._servers = [self._launch_server(i) for i in range(self.num_servers)]
        else:
            self._servers = [_Server(url=url) for url in self.urls]
        launched = [s.process for s in self._servers if s.process is not None]
        self._finalizer = weakref.finalize(self, _stop_launched, launched, self._workdir)
        try:
            for server in self._servers:
                self._wait_healthy(server)
            if self.router:
                self._router = self._launch_router()
                launched.insert(0, self._router.process)  # stopped first: it holds connections to the servers
                self._wait_healthy(self._router)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._update_group is not None:
            try:
                torch.distributed.destroy_process_group(self._update_group)
            except Exception:  # noqa: BLE001 - the servers may be gone already
                pass
            self._update_group = None
        if self._loop is not None:
            if self._session is not None:
                asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
        self._loop = self._thread = self._session = None
        if self._finalizer is not None:
            self._finalizer()
        self._servers, self._router, self.version = [], None, None

    def health(self) -> dict:
        return {
            "backend": "sglang",
            "workers": len(self._servers),
            "alive": sum(s.alive for s in self._servers),
            "version": self.version,
            "urls": [s.url for s in self._servers],
            "router": self._router.url if self._router else None,
        }

    def launched_pids(self) -> list[int]:
        """Process ids of what this pool launched (router included)."""
        servers = [s for s in [*self._servers, self._router] if s is not None and s.process is not None]
        return [s.process.pid for s in servers]

    # -- weights ---------------------------------------------------------------------------------------
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._require_started()
        tensors = [(name, t.detach()) for name, t in named_tensors]
        servers = [s for s in self._servers if s.alive]
        if not servers:
            raise RuntimeError(f"no live SGLang server to sync version {version} to; down: {[s.url for s in self._servers]}")
        if self.sync_method == "distributed" and self._update_group is not None and len(servers) < len(self._servers):
            # a broadcast to a group with a dead member would hang until the NCCL timeout
            down = [s.url for s in self._servers if not s.alive]
            raise RuntimeError(
                f"SGLang server(s) {down} left the weight-update group: the distributed sync cannot go on. Resume from the "
                "last checkpoint with the servers restarted, or use sync_method=disk, which tolerates losing a server"
            )
        self.version = None  # nothing may be generated until every server confirmed the new version
        self._run(self._sync(servers, tensors, version))
        self.version = version

    async def _sync(self, servers: list[_Server], tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        weight_version = str(version)
        await asyncio.gather(*(self._post(s.url, "/pause_generation", {}) for s in servers))
        if self.sync_method == "disk":
            root = Path(self.sync_dir) if self.sync_dir else Path(self._workdir) / "sync"
            out = await asyncio.to_thread(save_for_disk_update, tensors, self._config_dir, root / f"version_{version}")
            payload = {"model_path": str(out), "weight_version": weight_version, "flush_cache": True}
            await asyncio.gather(*(self._update(s, "/update_weights_from_disk", payload) for s in servers))
            for old in root.glob("version_*"):  # keep only the weights the servers now hold
                if old != out:
                    shutil.rmtree(old, ignore_errors=True)
        elif self.sync_method == "tensor":
            # CPU tensors travel as shared-memory files that close with their last reader: send fresh
            # copies, alive until every server has answered (CUDA tensors travel as IPC handles, uncopied)
            shared = [(name, t if t.is_cuda else t.clone()) for name, t in tensors]
            serialized = await asyncio.to_thread(serialize_named_tensors, shared)
            payload = {"serialized_named_tensors": [serialized] * self.tp_size, "weight_version": weight_version, "flush_cache": True}
            await asyncio.gather(*(self._update(s, "/update_weights_from_tensor", payload) for s in servers))
            del shared
        else:
            if self._update_group is None:
                await self._init_update_group(servers)
            payload = {
                "names": [name for name, _ in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors],
                "group_name": self.group_name,
                "weight_version": weight_version,
                "flush_cache": True,
            }
            updates = [self._update(s, "/update_weights_from_distributed", payload) for s in servers]
            await asyncio.gather(*updates, asyncio.to_thread(broadcast_from_trainer, self._update_group, [t for _, t in tensors]))
        await asyncio.gather(*(self._post(s.url, "/flush_cache", {}) for s in servers))
        reported = await asyncio.gather(*(self._get(s.url, "/get_weight_version") for s in servers))
        wrong = [(s.url, r.get("weight_version") if isinstance(r, dict) else r) for s, r in zip(servers, reported)]
        wrong = [(url, got) for url, got in wrong if got != weight_version]
        if wrong:
            raise RuntimeError(
                f"weight sync to version {version} was not confirmed: /get_weight_version answered {wrong} (url, version). "
                "Refusing to generate with unknown weights."
            )
        await asyncio.gather(*(self._post(s.url, "/continue_generation", {}) for s in servers))

    async def _init_update_group(self, servers: list[_Server]) -> None:
        world_size = 1 + self.tp_size * len(self._servers)
        requests = [
            self._update(
                s,
                "/init_weights_update_group",
                {
                    "master_address": self.dist_master_address,
                    "master_port": self.dist_master_port,
                    "rank_offset": 1 + self.tp_size * self._servers.index(s),
                    "world_size": world_size,
                    "group_name": self.group_name,
                    "backend": self.dist_backend,
                },
            )
            for s in servers
        ]
        joined = asyncio.to_thread(
            init_weight_update_group, self.dist_master_address, self.dist_master_port, 0, world_size, self.group_name, self.dist_backend
        )
        *_, self._update_group = await asyncio.gather(*requests, joined)

    async def _update(self, server: _Server, path: str, payload: dict) -> None:
        answer = await self._post(server.url, path, payload)
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise RuntimeError(f"{server.url}{path} failed: {answer}")

    # -- generation ------------------------------------------------------------------------------------
    def generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[Group]:
        self._require_started()
        self.check_requests(requests)
        for server in self._servers:
            server.busy_from = server.busy_to = None
        finished: queue.Queue = queue.Queue()
        future = asyncio.run_coroutine_threadsafe(self._generate_all(requests, sampling, finished), self._loop)
        try:
            for received in range(len(requests)):
                while True:
                    try:
                        item = finished.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if future.done() and finished.empty():  # the client loop ended without a word
                            cause = None if future.cancelled() else future.exception()
                            raise RuntimeError(f"the SGLang client stopped with {len(requests) - received} groups missing") from cause
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            future.cancel()  # the consumer stopped early (or failed): no request keeps running for nobody

    async def _generate_all(self, requests: list[GroupRequest], sampling: SamplingParams, finished: queue.Queue) -> None:
        limit = asyncio.Semaphore(self.max_concurrent_requests)
        tasks = [asyncio.ensure_future(self._generate_group(r, sampling, limit, finished)) for r in requests]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - hand it to the trainer's thread
            finished.put(error)
        finally:
            for task in tasks:
                task.cancel()

    async def _generate_group(self, request: GroupRequest, sampling: SamplingParams, limit: asyncio.Semaphore, finished: queue.Queue) -> None:
        async with limit:
            samples = await asyncio.gather(*(self._generate_sample(request, k, sampling) for k in range(request.group_size)))
        urls = sorted({url for url, _ in samples})
        finished.put(self._parse(request, [answer for _, answer in samples], ", ".join(urls)))

    async def _generate_sample(self, request: GroupRequest, index: int, sampling: SamplingParams) -> tuple[str, dict]:
        """One sample, one request: sglang_router accepts only single requests, and a retry redoes one sample."""
        payload = self._payload(request, index, sampling)
        errors: list[str] = []
        while True:
            server = self._pick_server()
            if server is None:
                raise RuntimeError(
                    f"prompt {request.prompt_id}: no live SGLang server left (all of {[s.url for s in self._servers]} failed); "
                    f"errors: {errors[-3:]}"
                )
            target = self._router or server  # with a router, it balances; `server` only keeps the books
            server.in_flight += 1
            server.busy_from = server.busy_from or time.monotonic()
            try:
                answer = await self._post(target.url, "/generate", payload, self.request_timeout_s)
                reason = answer.get("meta_info", {}).get("finish_reason") if isinstance(answer, dict) else None
                if isinstance(reason, dict) and reason.get("type") == "abort":
                    raise ServerError(f"sample {index} was aborted: {reason.get('message', reason)}")
            except (ServerError, OSError, asyncio.TimeoutError) as error:
                errors.append(f"{target.url}: {type(error).__name__}: {error}")
                if len(errors) > self.max_retries:
                    raise RuntimeError(f"prompt {request.prompt_id} sample {index}: /generate failed {len(errors)} times: {errors}") from error
                await self._check_alive(target)
                continue
            finally:
                server.in_flight -= 1
            server.busy_to = time.monotonic()
            return target.url, answer

    def _payload(self, request: GroupRequest, index: int, sampling: SamplingParams) -> dict:
        params = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "max_new_tokens": sampling.max_new_tokens,
            "stop_token_ids": sorted({self._eos_id, *sampling.stop_token_ids}),
            "skip_special_tokens": False,
            "no_stop_trim": True,  # keep the stop token: the trainer scores and trains on it
            "sampling_seed": request.seeds[index],  # its own seed: `n=G` would give every sample the same one
        }
        return {"input_ids": list(request.prompt_ids), "sampling_params": params, "return_logprob": True}

    def _parse(self, request: GroupRequest, answer, url: str) -> Group:
        G = request.group_size
        if not isinstance(answer, list) or len(answer) != G:
            got = f"a list of {len(answer)}" if isinstance(answer, list) else type(answer).__name__
            raise MalformedResponse(f"{url}/generate for prompt {request.prompt_id}: expected a list of {G} outputs, got {got}")
        completions, logprobs, reasons, versions = [], [], [], set()
        for k, output in enumerate(answer):
            meta = output.get("meta_info") if isinstance(output, dict) else None
            entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
            reason = meta.get("finish_reason") if isinstance(meta, dict) else None
            if not isinstance(entries, list) or not entries or not isinstance(reason, dict):
                raise MalformedResponse(
                    f"{url}/generate for prompt {request.prompt_id} sample {k}: meta_info lacks output_token_logprobs or finish_reason "
                    f"(is return_logprob honoured?): {str(output)[:300]}"
                )
            if reason.get("type") not in ("stop", "length"):
                raise MalformedResponse(f"{url}/generate for prompt {request.prompt_id} sample {k}: unknown finish_reason {reason}")
            try:
                tokens = [int(entry[1]) for entry in entries]
                values = [float(entry[0]) for entry in entries]
            except (TypeError, ValueError, IndexError) as error:
                raise MalformedResponse(f"{url}/generate for prompt {request.prompt_id} sample {k}: bad output_token_logprobs entry") from error
            if "output_ids" in output and list(output["output_ids"]) != tokens:
                raise MalformedResponse(f"{url}/generate for prompt {request.prompt_id} sample {k}: output_ids disagree with the log-prob tokens")
            completions.append(tokens)
            logprobs.append(values)
            reasons.append(reason["type"])
            versions.add(meta.get("weight_version", str(self.version)))
        if len(versions) != 1:
            raise MalformedResponse(f"{url}: the samples of prompt {request.prompt_id} report several weight versions {sorted(versions)}")
        reported = versions.pop()
        try:
            version = int(reported)
        except (TypeError, ValueError):
            raise MalformedResponse(f"{url} reports weight_version {reported!r}, not one this pool set") from None
        rewards = [self._reward_fn.reward(list(request.answer_ids), c, self._eos_id) for c in completions]
        return Group(
            prompt_id=request.prompt_id,
            version=version,  # what the server says it generated with, checked by the datamodule
            sample_indices=list(range(G)),
            completions=completions,
            logprobs=logprobs,
            rewards=rewards,
            finish_reasons=reasons,
        )

    def _pick_server(self) -> _Server | None:
        if self._router is not None and not self._router.alive:
            return None
        alive = [s for s in self._servers if s.alive]
        return min(alive, key=lambda s: s.in_flight) if alive else None

    async def _check_alive(self, server: _Server) -> None:
        dead = server.process is not None and server.process.poll() is not None
        if not dead:
            try:
                await self._get(server.url, "/health", timeout=5.0)
            except (ServerError, OSError, asyncio.TimeoutError):
                dead = True
        if dead and server.alive:
            server.alive = False
            warnings.warn(f"SGLang server {server.url} is down; its requests go to the other servers", RuntimeWarning, stacklevel=2)

    def busy_intervals(self) -> list[tuple[float, float]]:
        return [(s.busy_from, s.busy_to) for s in self._servers if s.busy_from is not None and s.busy_to is not None]

    # -- processes -------------------------------------------------------------------------------------
    def _launch_server(self, index: int) -> _Server:
        port = self.port + index
        command = [*self.launch_command, "--model-path", self._model_dir, "--host", self.host, "--port", str(port)]
        command += ["--tp-size", str(self.tp_size), "--skip-tokenizer-init"]
        if self.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(self.mem_fraction_static)]
        command += self.server_args
        env = dict(os.environ)
        if self.gpu_ids is not None:
            gpus = self.gpu_ids[index * self.tp_size : (index + 1) * self.tp_size]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        return self._spawn(command, env, f"http://{self.host}:{port}", f"server_{index}.log")

    def _launch_router(self) -> _Server:
        command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[s.url for s in self._servers]]
        command += ["--host", self.host, "--port", str(self.router_port), *self.router_args]
        return self._spawn(command, dict(os.environ), f"http://{self.host}:{self.router_port}", "router.log")

    def _spawn(self, command: list[str], env: dict, url: str, log_name: str) -> _Server:
        log_path = Path(self._workdir) / log_name
        with open(log_path, "wb") as log:
            # a session of its own: close() stops the server's whole process tree with one signal
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        return _Server(url=url, process=process, log_path=log_path)

    def _wait_healthy(self, server: _Server) -> None:
        timeout = self.start_timeout_s if server.process is not None else self.attach_timeout_s
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang server {server.url} exited with code {server.process.returncode} while starting. "
                    f"Last lines of {server.log_path}:\n{_log_tail(server.log_path)}"
                )
            try:
                self._run(self._get(server.url, "/health", timeout=5.0))
                return
            except (ServerError, OSError, asyncio.TimeoutError) as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(0.5)
        launched = f" Last lines of {server.log_path}:\n{_log_tail(server.log_path)}" if server.process is not None else ""
        raise RuntimeError(f"SGLang server {server.url} is not healthy after {timeout:.0f} s (GET /health: {last}).{launched}")

    # -- HTTP ------------------------------------------------------------------------------------------
    def _start_loop(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lit_parl-sglang-client", daemon=True)
        self._thread.start()

        async def open_session():
            import aiohttp

            # no connection cap: all of an iteration's groups are in flight at once
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        self._run(open_session())

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    async def _post(self, url: str, path: str, payload: dict, timeout: float | None = None):
        return await self._request("POST", url + path, payload, timeout or self.request_timeout_s)

    async def _get(self, url: str, path: str, timeout: float | None = None):
        return await self._request("GET", url + path, None, timeout or self.request_timeout_s)

    async def _request(self, method: str, url: str, payload: dict | None, timeout: float):
        import aiohttp

        try:
            async with self._session.request(method, url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                body = await response.read()
                if response.status >= 500:
                    raise ServerError(f"{method} {url}: HTTP {response.status}: {body[:200]!r}")
                if response.status >= 400:
                    raise RuntimeError(f"{method} {url}: HTTP {response.status}: {body[:300]!r}")
                if response.content_type == "application/json":
                    return await response.json()
                return body.decode(errors="replace")
        except aiohttp.ClientConnectionError as error:
            raise ConnectionError(f"{method} {url}: {error}") from error
        except aiohttp.ContentTypeError as error:
            raise MalformedResponse(f"{method} {url}: {error}") from error

    def _require_started(self) -> None:
        if not self._servers:
            raise RuntimeError("SGLangRolloutPool is not started (call start() first, or it was closed)")
