"""``SGLangRolloutPool``: the rollout protocol over SGLang servers, from start to close.

It checks its settings, launches or attaches the servers (``servers``), hands weight syncs to the
``WeightUpdater`` (``weights``), and turns an iteration's requests into one ``/generate`` per sample on
the client's loop (``client``, ``messages``), handing each group to the trainer's thread as soon as its
samples are in.
"""

from __future__ import annotations

import asyncio
import functools
import os
import queue
import sys
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

from lit_parl.rollout.rollout_pool import PoolSpec, RolloutPool, WeightBucket
from lit_parl.rollout.gpu_placement import split_gpu_ids, visible_devices
from lit_parl.rollout.sglang.client import HTTPClient, RouteNotFound, post_with_retries
from lit_parl.rollout.sglang.messages import Ends, abort_reason, parse_group, sample_payload
from lit_parl.rollout.sglang.servers import SERVER_DTYPES, ServerFleet, check_server_env, router_command, server_command, stop_launched
from lit_parl.rollout.sglang.weights import SYNC_METHODS, WeightUpdater
from lit_parl.rollout.stop_strings import load_tokenizer
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


class SGLangRolloutPool(RolloutPool):
    """SGLang servers as the rollout pool: launch ``num_servers`` servers (``urls=None``) or attach to ``urls``.

    Log-probs: SGLang reports each sampled token's in the full softmax of logits / T, before top-k and
    top-p, which is the trainer's. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` would make it the softmax before
    temperature: the pool refuses to launch servers with it, and attached servers must run without it.

    Args:
        urls: running servers to attach to (never stopped by the pool); ``None``: launch servers.
        model_path: what launched servers load (a local directory or hub name); ``None``: the
            ``PoolSpec``'s model directory. The first sync brings the trainer's weights either way.
        num_servers: servers to launch; server ``i`` listens on ``port + i``.
        tp_size: tensor-parallel GPUs per server.
        host, port: where launched servers listen.
        mem_fraction_static: SGLang's ``--mem-fraction-static`` (lower it when the trainer shares the GPU).
        dtype: launched servers' ``--dtype``: ``bfloat16``, the trainer's compute precision under
            ``bf16-mixed``. SGLang's own default, ``auto``, serves a float32 checkpoint (the trainer saves
            one) in float16. ``None``: no flag.
        server_args: more ``sglang.launch_server`` arguments.
        gpu_ids: each launched server's GPUs, set as its ``CUDA_VISIBLE_DEVICES``: a list per server or a flat
            list handed out ``tp_size`` at a time, exactly ``num_servers * tp_size`` ids, an integer being a GPU
            as the trainer numbers them (``lit_parl.rollout.gpu_placement``, as the vLLM pool reads them);
            ``None``: SGLang's default placement. A ``tensor`` sync needs the trainer's GPU visible to the server.
        router: launch ``sglang_router`` in front of the servers; generation goes through it, weight
            updates still go to every server, so each one's version is confirmed.
        router_port, router_args: the router's port and more of its arguments.
        sync_method: ``tensor``, ``distributed`` or ``disk`` (``lit_parl.rollout.sglang.weights``).
        sync_dir: ``disk``: a directory every server can read; ``None``: the pool's work directory.
        dist_master_address, dist_master_port, dist_backend, group_name: ``distributed``: the
            weight-update group's rendezvous (the trainer's address as the servers reach it) and backend.
        deterministic_inference: each sample carries its own ``sampling_seed``, which SGLang honours only
            when the server runs with ``--enable-deterministic-inference`` (slower kernels): launched servers
            get the flag, and an attached server without it is named in a warning, since its samples then do
            not follow their seeds (a retried sample, or an iteration regenerated after a resume, differs).
            ``False``: no flag, no warning.
        request_timeout_s: the timeout of one HTTP request.
        max_retries: how often a failed ``/generate`` is sent again to another live server.
        start_timeout_s: how long a launched server may take to answer ``/health``.
        attach_timeout_s: the same for an attached server.
        max_concurrent_requests: groups in flight at once.
        launch_command: replaces ``[python, -m, sglang.launch_server]`` (the tests use a stand-in).
    """

    backend = "sglang"
    shared_across_ranks = True

    def __init__(
        self,
        urls: list[str] | None = None,
        model_path: str | None = None,
        num_servers: int = 1,
        tp_size: int = 1,
        host: str = "127.0.0.1",
        port: int = 30000,
        mem_fraction_static: float | None = None,
        dtype: str | None = "bfloat16",
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
        deterministic_inference: bool = True,
        request_timeout_s: float = 600.0,
        max_retries: int = 3,
        start_timeout_s: float = 900.0,
        attach_timeout_s: float = 10.0,
        max_concurrent_requests: int = 1024,
        launch_command: list[str] | None = None,
    ) -> None:
        super().__init__()
        if sync_method not in SYNC_METHODS:
            raise ValueError(f"SGLangRolloutPool(sync_method={sync_method!r}): choose one of {SYNC_METHODS}")
        if urls is not None and not urls:
            raise ValueError("SGLangRolloutPool(urls=[]): give at least one server URL, or None to launch servers")
        if urls is None and num_servers < 1:
            raise ValueError(f"SGLangRolloutPool(num_servers={num_servers}): at least one server is needed")
        if dtype is not None and dtype not in SERVER_DTYPES:
            raise ValueError(f"SGLangRolloutPool(dtype={dtype!r}): SGLang serves one of {SERVER_DTYPES}")
        if max_retries < 0:
            raise ValueError(f"SGLangRolloutPool(max_retries={max_retries}): must be >= 0")
        self.urls = [u.rstrip("/") for u in urls] if urls else None
        self.model_path = model_path
        self.num_servers = len(urls) if urls else num_servers
        self.tp_size = tp_size
        self.host = host
        self.port = port
        self.mem_fraction_static = mem_fraction_static
        self.dtype = dtype
        self.server_args = list(server_args)
        # each launched server's GPUs (as lit_parl.rollout.gpu_placement reads gpu_ids); attached servers have their own
        self.gpu_ids = split_gpu_ids(gpu_ids, num_servers, tp_size, "SGLangRolloutPool", ("num_servers", "tp_size")) if urls is None else None
        self.router = router
        self.router_port = router_port
        self.router_args = list(router_args)
        self.sync_method = sync_method
        self.sync_dir = sync_dir
        self.dist_master_address = dist_master_address
        self.dist_master_port = dist_master_port
        self.dist_backend = dist_backend
        self.group_name = group_name
        self.deterministic_inference = deterministic_inference
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.start_timeout_s = start_timeout_s
        self.attach_timeout_s = attach_timeout_s
        self.max_concurrent_requests = max_concurrent_requests
        self.launch_command = list(launch_command) if launch_command else [sys.executable, "-m", "sglang.launch_server"]
        self._fleet: ServerFleet | None = None
        self._client: HTTPClient | None = None
        self._weights: WeightUpdater | None = None
        self._finalizer = None
        self._eos_id: int | None = None
        self._model_dir: str | Path | None = None
        self._tokenizer = None  # the model directory's, loaded for the first call with stop strings

    # -- RolloutPool -----------------------------------------------------------------------------------
    def _start(self, spec: PoolSpec) -> None:
        if self.urls is None:
            check_server_env(os.environ)  # an attached server's environment is its own (see the class docstring)
        self._eos_id, self._model_dir = spec.eos_id, spec.model_dir
        workdir = tempfile.mkdtemp(prefix="lit_parl_sglang_")
        self._fleet = fleet = ServerFleet(workdir)
        # stop what was launched and remove the work dir even if the owner forgets to close the pool
        self._finalizer = weakref.finalize(self, stop_launched, fleet.launched, workdir)
        self._client = HTTPClient(self.request_timeout_s)
        sync_dir = self.sync_dir or Path(workdir) / "sync"
        self._weights = WeightUpdater(
            self._client,
            model_dir=spec.model_dir,
            sync_dir=sync_dir,
            tp_size=self.tp_size,
            dist_master_address=self.dist_master_address,
            dist_master_port=self.dist_master_port,
            dist_backend=self.dist_backend,
            group_name=self.group_name,
        )
        if self.urls is None:
            model_path = str(self.model_path or spec.model_dir)
            visible = visible_devices(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"), "SGLangRolloutPool") if self.gpu_ids else None
            for index in range(self.num_servers):
                port = self.port + index
                command = server_command(
                    self.launch_command, model_path, self.host, port, self.tp_size, self.mem_fraction_static, self.server_args,
                    self.deterministic_inference, self.dtype,
                )
                env = dict(os.environ)
                if self.gpu_ids is not None:
                    env["CUDA_VISIBLE_DEVICES"] = visible[index]
                fleet.launch_server(command, env, f"http://{self.host}:{port}", f"server_{index}.log")
        else:
            fleet.attach(self.urls)
        for server in fleet.servers:
            fleet.wait_healthy(self._client, server, self.start_timeout_s if server.process else self.attach_timeout_s)
        if self.urls is not None and self.deterministic_inference:
            self._warn_unseeded(fleet.servers)
        if self.router:
            command = router_command([s.url for s in fleet.servers], self.host, self.router_port, self.router_args)
            fleet.wait_healthy(self._client, fleet.launch_router(command, f"http://{self.host}:{self.router_port}"), self.start_timeout_s)

    def _warn_unseeded(self, servers) -> None:
        """Name the attached servers that ignore per-sample seeds (``/server_info``, or the older route)."""
        unseeded = []
        for server in servers:
            info = None
            for path in ("/server_info", "/get_server_info"):
                try:
                    info = self._client.run(self._client.get(server.url, path))
                    break
                except RouteNotFound:
                    continue
            if not (isinstance(info, dict) and info.get("enable_deterministic_inference")):
                unseeded.append(server.url)
        if unseeded:
            warnings.warn(
                f"SGLang server(s) {unseeded} do not report --enable-deterministic-inference in their server info, and "
                "without it SGLang ignores each sample's sampling_seed: a retried sample, or an iteration regenerated "
                "after a resume, is drawn anew (still on-policy, not the same). Restart them with the flag, or set "
                "deterministic_inference=false to accept this.",
                stacklevel=3,
            )

    def _sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        self._weights.sync(self.sync_method, self._fleet.live(), self._fleet.servers, buckets, version)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        for server in self._fleet.servers:
            server.busy_from = server.busy_to = None
        decode = None
        if sampling.stop:  # to tell a stop string met by the last allowed token (SGLang says "length")
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._model_dir, sampling.stop)
            decode = functools.partial(self._tokenizer.decode, skip_special_tokens=True)
        ends = Ends.of(sampling, self._eos_id, decode)
        finished: queue.Queue = queue.Queue()
        client = self._client
        future = client.submit(self._generate_all(requests, sampling, ends, finished))
        try:
            for received in range(len(requests)):
                while True:
                    try:
                        item = finished.get(timeout=1.0)
                        break
                    except queue.Empty:
                        if client.closed:  # closed from another thread (the trainer failed): stop waiting
                            raise RuntimeError("the SGLang pool was closed while generating") from None
                        if future.done() and finished.empty():  # the client loop ended without a word
                            cause = None if future.cancelled() else future.exception()
                            raise RuntimeError(f"the SGLang client stopped with {len(requests) - received} groups missing") from cause
                if isinstance(item, BaseException):
                    if client.closed:  # the requests failed because the pool was closed under them
                        raise RuntimeError("the SGLang pool was closed while generating") from item
                    raise item
                yield item
        finally:
            future.cancel()  # the consumer stopped early (or failed): no request keeps running for nobody

    async def _generate_all(self, requests: list[GroupRequest], sampling: SamplingParams, ends: Ends, finished: queue.Queue) -> None:
        limit = asyncio.Semaphore(self.max_concurrent_requests)
        tasks = [asyncio.ensure_future(self._generate_group(r, sampling, ends, limit, finished)) for r in requests]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - hand it to the trainer's thread
            finished.put(error)
        finally:
            for task in tasks:
                task.cancel()

    async def _generate_group(
        self, request: GroupRequest, sampling: SamplingParams, ends: Ends, limit: asyncio.Semaphore, finished: queue.Queue
    ) -> None:
        # one request per sample: sglang_router accepts only single requests, and a retry redoes one sample
        async with limit:
            samples = await asyncio.gather(*(self._generate_sample(request, k, sampling) for k in range(request.group_size)))
        urls = ", ".join(sorted({url for url, _ in samples}))
        finished.put(parse_group(request, [answer for _, answer in samples], urls, ends))

    async def _generate_sample(self, request: GroupRequest, index: int, sampling: SamplingParams) -> tuple[str, dict]:
        payload = sample_payload(request, index, sampling, self._eos_id)
        what = f"prompt {request.prompt_id} sample {index}"
        return await post_with_retries(self._client, self._fleet, "/generate", payload, self.max_retries, what, check=abort_reason)

    def _worker_counts(self) -> tuple[int, int]:
        fleet = self._fleet
        return (len(fleet.servers), len(fleet.live())) if fleet else (0, 0)

    def _details(self) -> dict:
        fleet = self._fleet
        if fleet is None:
            return {}
        return {"urls": [s.url for s in fleet.servers], "router": fleet.router.url if fleet.router else None, "pids": fleet.pids()}

    def _busy_intervals(self) -> list[tuple[float, float]]:
        servers = self._fleet.servers if self._fleet else []
        return [(s.busy_from, s.busy_to) for s in servers if s.busy_from is not None and s.busy_to is not None]

    def _close(self) -> None:
        try:
            if self._weights is not None:
                self._weights.close(self._fleet.live() if self._fleet else [])
            if self._client is not None:
                self._client.close()
        finally:
            if self._finalizer is not None:
                self._finalizer()
            self._fleet = self._client = self._weights = self._finalizer = None

    def launched_pids(self) -> list[int]:
        """Process ids of what this pool launched (router included)."""
        return self._fleet.pids() if self._fleet else []
