"""``SGLangRolloutPool``: the rollout protocol over SGLang servers, from start to close.

It checks its settings, launches or attaches the servers (``servers``), lets servers join and leave at each
push (``membership``), hands weight syncs to the ``WeightUpdater`` (``weights``), and turns an iteration's
requests into one ``/generate`` per sample on the client's loop (``client``, ``messages``), handing each group
to the trainer's thread as soon as its samples are in.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import tempfile
import warnings
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

from lit_parl.extras import require_installed
from lit_parl.rollout.adapter_pool import AdapterPool
from lit_parl.rollout.gpu_placement import split_gpu_ids, visible_devices
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE, PoolSpec, WeightBucket
from lit_parl.rollout.sglang.adapters import AdapterLoader, check_adapters_servable, lora_launch_args
from lit_parl.rollout.sglang.client import HTTPClient
from lit_parl.rollout.sglang.commands import (
    check_server_env,
    launches_on_cpu,
    router_command,
    server_command,
    server_env,
    warn_unseeded_on_cpu,
)
from lit_parl.rollout.sglang.fanout import leaves_push
from lit_parl.rollout.sglang.generation import stream_groups
from lit_parl.rollout.sglang.membership import Membership, why_fixed
from lit_parl.rollout.sglang.messages import Ends, sample_payload
from lit_parl.rollout.sglang.servers import (
    Server,
    ServerFleet,
    answers_health,
    reachable_url,
    stop_launched,
    warn_unseeded,
)
from lit_parl.rollout.sglang.settings import (
    LaunchSettings,
    RequestSettings,
    RouterSettings,
    ServerSettings,
    SyncSettings,
)
from lit_parl.rollout.sglang.weights import WeightUpdater
from lit_parl.rollout.shared_pool import SharedRolloutPool
from lit_parl.rollout.stop_strings import load_tokenizer
from lit_parl.settings import as_settings

log = logging.getLogger("lit_parl")


class SGLangRolloutPool(SharedRolloutPool, AdapterPool):
    """SGLang servers as the rollout pool: launch them (``servers.urls`` unset) or attach to ``servers.urls``.

    Log-probs: SGLang reports each sampled token's in the full softmax of logits / T, before top-k and
    top-p, which is the trainer's. ``SGLANG_RETURN_ORIGINAL_LOGPROB`` would make it the softmax before
    temperature: the pool refuses to launch servers with it, and attached servers must run without it.

    Each argument is its settings object, a dict of its fields (as Hydra gives them), or ``None`` (the defaults):

    Args:
        servers: which servers generate and what the pool relies on of them (``ServerSettings``).
        launch: how the pool launches its servers and the router (``LaunchSettings``).
        router: ``sglang_router`` in front of the servers (``RouterSettings``).
        sync: how the weights reach the servers (``SyncSettings``; ``lora``: a LoRA policy as merged weights, or
            as its adapter alone, ``lit_parl.rollout.sglang.adapters``).
        requests: HTTP timeouts, retries and how many groups generate at once (``RequestSettings``).

    Building the pool starts nothing; ``start`` launches or attaches:

    >>> pool = SGLangRolloutPool(servers={"urls": ["http://infer1:30000"], "tp_size": 8}, sync={"method": "disk"})
    >>> pool.servers.urls, pool.sync.method, pool.launch.num_servers
    (('http://infer1:30000',), 'disk', 1)
    """

    backend = "sglang"

    def __init__(
        self,
        servers: ServerSettings | dict | None = None,
        launch: LaunchSettings | dict | None = None,
        router: RouterSettings | dict | None = None,
        sync: SyncSettings | dict | None = None,
        requests: RequestSettings | dict | None = None,
    ) -> None:
        super().__init__()
        self.servers = as_settings(ServerSettings, servers)
        self.launch = as_settings(LaunchSettings, launch)
        self.router = as_settings(RouterSettings, router)
        # its method is read at each sync (it may change between syncs); the group's rendezvous is fixed at start
        self.sync = as_settings(SyncSettings, sync)
        self.requests = as_settings(RequestSettings, requests)
        # each launched server's GPUs (as lit_parl.rollout.gpu_placement reads them); attached servers have their own
        self._gpus = None
        if self.servers.urls is None:
            names = ("launch.num_servers", "servers.tp_size")
            self._gpus = split_gpu_ids(
                self.launch.gpu_ids, self.launch.num_servers, self.servers.tp_size, "SGLangRolloutPool", names
            )
        self._fleet: ServerFleet | None = None
        self._client: HTTPClient | None = None
        self._weights: WeightUpdater | None = None
        self._adapters: AdapterLoader | None = None
        self._adapter: str | None = None  # the LoRA adapter this iteration's requests name (sync.lora=adapter)
        self._finalizer = None
        self._eos_id: int | None = None
        self._model_dir: str | Path | None = None
        self._tokenizer = None  # the model directory's, loaded for the first call with stop strings
        self.membership = Membership(self.servers.membership_file)  # servers joining and leaving, at each push

    # -- RolloutPool -----------------------------------------------------------------------------------
    def _start(self, spec: PoolSpec) -> None:
        servers, launch = self.servers, self.launch
        check_adapters_servable(self.takes_lora_adapters and servers.urls is None and launches_on_cpu(launch))
        if servers.urls is None:
            check_server_env(os.environ)  # an attached server's environment is its own (see the class docstring)
            if launch.command is None:  # the default command runs this Python's sglang
                require_installed("sglang", "sglang", "launching SGLang servers", hint="(or attach: pool.servers.urls)")
        if self.router.enabled:
            require_installed("sglang_router", "sglang", "pool.router.enabled=true")
        fleet = self._open(spec)
        if servers.urls is None:
            self._launch_servers(str(launch.model_path or spec.model_dir))
        else:
            fleet.attach(servers.urls)
        for server in fleet.servers:
            timeout_s = launch.start_timeout_s if server.process else servers.attach_timeout_s
            fleet.wait_healthy(self._client, server, timeout_s)
        if servers.urls is not None and servers.deterministic_inference:
            warn_unseeded(self._client, fleet.servers)
        if self.router.enabled:
            urls = [s.url for s in fleet.servers]
            command = router_command(urls, launch.host, self.router.port, self.router.args)
            router = fleet.launch_router(command, f"http://{launch.host}:{self.router.port}")
            fleet.wait_healthy(self._client, router, launch.start_timeout_s)

    def _open(self, spec: PoolSpec) -> ServerFleet:
        """The fleet (empty), the HTTP client and the weight updater, whether this rank starts or joins."""
        self._eos_id, self._model_dir = spec.eos_id, spec.model_dir
        workdir = tempfile.mkdtemp(prefix="lit_parl_sglang_")
        self._fleet = fleet = ServerFleet(workdir)
        # stop what was launched and remove the work dir even if the owner forgets to close the pool
        self._finalizer = weakref.finalize(self, stop_launched, fleet.launched, workdir)
        self._client = HTTPClient(self.requests.timeout_s)
        sync_dir = self.sync.dir or Path(workdir) / "sync"
        self._weights = WeightUpdater(self._client, spec.model_dir, sync_dir, self.servers.tp_size, self.sync)
        self._weights.fanout.lose = self._lose_in_push
        self._adapters, self._adapter = AdapterLoader(self._weights, self.sync.max_lora_rank), None
        return fleet

    # -- SharedRolloutPool: every rank's pool object reaches the same servers --------------------------
    def _address(self) -> dict:
        fleet, here = self._fleet, socket.getfqdn()  # a server listening on 0.0.0.0 is reached at this host's name
        urls, capacities = [reachable_url(s.url, here) for s in fleet.live()], [s.capacity for s in fleet.live()]
        router = reachable_url(fleet.router.url, here) if fleet.router else None
        return {"urls": urls, "capacities": capacities, "router": router, "adapter": self._adapter}

    def _join(self, spec: PoolSpec, address: dict) -> None:
        fleet = self._open(spec)
        fleet.attach(address["urls"], address["capacities"])
        if address.get("router"):
            fleet.attach_router(address["router"])
        for server in [*fleet.servers, *([fleet.router] if fleet.router else [])]:
            fleet.wait_healthy(self._client, server, self.servers.attach_timeout_s)

    def _adopt_version(self, version: int, address: dict | None) -> None:
        if address is not None:  # the servers the pushing rank's pool drove this push, joiners included
            self._fleet.follow(address["urls"], address["capacities"])
            self._adapter = address.get("adapter")
        self._weights.check_reported(self._fleet.live(), version)

    # -- elastic membership: servers join and leave at a push, between iterations ----------------------
    def add_server(self, url: str, capacity: float = 1.0) -> None:
        """``url``, an SGLang server started elsewhere, joins at the next push (it gets θ_k there and confirms
        version k before its first request); ``capacity``: its share of the requests, relative to the others'."""
        self.membership.add(url, capacity)

    def remove_server(self, url: str) -> None:
        """``url`` leaves at the next push: no request of the next iteration goes to it; stopped if launched here."""
        self.membership.remove(url)

    def failed_engines(self) -> list[str]:
        """The servers this pool's requests saw fail (and not dropped yet), as the other ranks name them."""
        here = socket.getfqdn()
        return [reachable_url(s.url, here) for s in self._fleet.servers if not s.alive] if self._fleet else []

    def mark_failed(self, engines: list[str]) -> None:
        """Servers another rank saw fail are down here too: this push leaves them out, as this rank's own failures."""
        here = socket.getfqdn()
        for server in self._fleet.servers if self._fleet else []:
            if server.alive and reachable_url(server.url, here) in engines:
                server.alive = False
                warnings.warn(
                    f"SGLang server {server.url} failed another rank's requests: it leaves the pool at this push",
                    RuntimeWarning,
                    stacklevel=2,
                )

    async def _lose_in_push(self, server: Server, error: BaseException) -> bool:
        # not under the distributed sync: its group cannot lose a member
        return self.sync.method != "distributed" and await leaves_push(self._client, server, error)

    def _change_membership(self, version: int) -> None:
        fleet, client, distributed = self._fleet, self._client, self.sync.method == "distributed"
        fixed = why_fixed(self.router.enabled, distributed, self.takes_lora_adapters)
        # a distributed sync refuses to go on without a member of its group: a failed server is not dropped there
        change = self.membership.apply(fleet, functools.partial(answers_health, client), fixed, not distributed)
        if change.joined and self.servers.deterministic_inference:
            warn_unseeded(client, [s for s in fleet.servers if s.url in change.joined])
        log.info("SGLang pool, version %d: %s", version, change.describe(fleet.servers))

    def _launch_servers(self, model_path: str) -> None:
        launch, tp_size = self.launch, self.servers.tp_size
        visible = None
        if self._gpus:
            visible = visible_devices(self._gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), "SGLangRolloutPool")
        cpu, seeded = launches_on_cpu(launch), self.servers.deterministic_inference
        if cpu and seeded:
            warn_unseeded_on_cpu()
        for index in range(launch.num_servers):
            port = launch.port + index
            extra = lora_launch_args(self.sync.max_lora_rank) if self.takes_lora_adapters else []
            command = server_command(launch, model_path, port, tp_size, seeded, extra, cpu)
            env = server_env(cpu, self._fleet.workdir)
            if self._gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible[index]
            self._fleet.launch_server(command, env, f"http://{launch.host}:{port}", f"server_{index}.log", on_cpu=cpu)

    def _sync_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        self._change_membership(version)
        self._adapter = None  # the full weights alone, until an adapter is loaded beside them
        self._weights.sync(self.sync.method, self._fleet.live(), self._fleet.servers, buckets, version)

    # -- AdapterPool: a LoRA policy as base + its adapter ---------------------------------------------
    @property
    def takes_lora_adapters(self) -> bool:
        return self.sync.lora == "adapter"

    def _load_adapter(self, buckets: Iterable[WeightBucket], version: int, config: dict) -> None:
        self._adapter = None
        self._adapter = self._adapters.load(self._fleet.live(), buckets, config, version)

    def _generate(self, requests: list[GroupRequest], sampling: SamplingParams) -> Iterator[GroupCompletions]:
        for server in self._fleet.servers:
            server.busy_from = server.busy_to = None
        decode = None
        if sampling.stop:  # to tell a stop string met by the last allowed token (SGLang says "length")
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._model_dir, sampling.stop)
            decode = functools.partial(self._tokenizer.decode, skip_special_tokens=True)
        ends = Ends.of(sampling, self._eos_id, decode)
        payload = functools.partial(sample_payload, sampling=sampling, eos_id=self._eos_id, adapter=self._adapter)
        yield from stream_groups(self._client, self._fleet, requests, payload, ends, self.requests)

    def logprob_tolerance(self) -> float | None:
        # launched on the CPU, the servers compute in float32, as a CPU trainer does (commands.CPU_ARGS)
        cpu = self.servers.urls is None and launches_on_cpu(self.launch) and "--dtype" not in self.launch.args
        return FP32_LOGPROB_TOLERANCE if cpu else super().logprob_tolerance()

    def _worker_counts(self) -> tuple[int, int]:
        fleet = self._fleet
        return (len(fleet.servers), len(fleet.live())) if fleet else (0, 0)

    def _details(self) -> dict:
        fleet = self._fleet
        if fleet is None:
            return {}
        router = fleet.router.url if fleet.router else None
        return {"urls": [s.url for s in fleet.servers], "router": router, "pids": fleet.pids()}

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
