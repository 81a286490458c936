"""The SGLang servers (and router) a pool drives: launching or attaching them, their health, stopping them.

A launched server is ``launch_command --model-path ... --port ...`` in a session of its own, logging to
the pool's work directory, and dies with the trainer (``PR_SET_PDEATHSIG``). On a machine without a GPU it
is SGLang's CPU platform (the command lines: ``commands``). An attached server is
only a URL: it is used, health-checked and dropped when down, but never stopped. ``stop_launched``
stops exactly what was launched, with each process group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lit_parl.errors import PoolStartError
from lit_parl.rollout.processes import dying_with_parent
from lit_parl.rollout.sglang.client import RETRYABLE, HTTPClient, RouteNotFound


@dataclass
class Server:
    """One server (or the router) as the pool sees it.

    Args:
        url: ``http://host:port``.
        process: the launched process; ``None`` for an attached server, which is not ours to stop.
        log_path: the launched process's log.
        alive: passed its last health check.
        in_flight: requests sent to it (or, with a router, on its account) and not answered yet.
        busy_from: when the current ``generate`` first sent it a request.
        busy_to: when it last answered one.
        capacity: its share of the requests, relative to the others' (``ServerFleet.pick``).
        on_cpu: launched on SGLang's CPU platform (``freeze_start_heap`` once it is healthy).
    """

    url: str
    process: subprocess.Popen | None = None
    log_path: Path | None = None
    alive: bool = True
    in_flight: int = 0
    busy_from: float | None = None
    busy_to: float | None = None
    capacity: float = 1.0
    on_cpu: bool = False


class ServerFleet:
    """The servers a pool drives and the router in front of them, if any.

    Args:
        workdir: where the logs of launched processes go.
    """

    def __init__(self, workdir: str | Path) -> None:
        self.workdir = Path(workdir)
        self.servers: list[Server] = []
        self.router: Server | None = None
        self.launched: list[subprocess.Popen] = []  # what stop_launched stops, the router first
        # (version, prompt id, sample) of an episode -> the server of its latest turn (its prefix is cached there)
        self.episodes: dict[tuple[int, int, int], str] = {}

    def attach(self, urls: list[str], capacities: list[float] | None = None) -> None:
        capacities = capacities or [1.0] * len(urls)
        self.servers += [Server(url=url, capacity=capacity) for url, capacity in zip(urls, capacities, strict=True)]

    def drop(self, server: Server) -> None:
        """Take ``server`` out of the fleet (between iterations); stop it if it was launched here."""
        self.servers.remove(server)
        if server.process is not None:
            self.launched.remove(server.process)
            stop_launched([server.process], None)

    def follow(self, urls: list[str], capacities: list[float]) -> None:
        """Drive exactly the servers at ``urls`` (those another rank's pool drives; none of them launched here)."""
        known = {server.url: server for server in self.servers}
        self.servers = [known.get(url) or Server(url=url) for url in urls]
        for server, capacity in zip(self.servers, capacities, strict=True):
            server.alive, server.capacity = True, capacity  # the pushing rank's push reached it

    def attach_router(self, url: str) -> None:
        self.router = Server(url=url)  # another process's router: never stopped from here

    def launch_server(self, command: list[str], env: dict, url: str, log_name: str, on_cpu: bool = False) -> Server:
        server = self._spawn(command, env, url, log_name)
        server.on_cpu = on_cpu
        self.launched.append(server.process)
        self.servers.append(server)
        return server

    def launch_router(self, command: list[str], url: str) -> Server:
        self.router = self._spawn(command, dict(os.environ), url, "router.log")
        self.launched.insert(0, self.router.process)  # stopped first: it holds connections to the servers
        return self.router

    def _spawn(self, command: list[str], env: dict, url: str, log_name: str) -> Server:
        log_path = self.workdir / log_name
        with open(log_path, "wb") as log:
            # a session of its own: stop_launched stops the server's whole process tree with one signal
            process = LaunchedProcess(
                dying_with_parent(command), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return Server(url=url, process=process, log_path=log_path)

    def wait_healthy(self, client: HTTPClient, server: Server, timeout_s: float) -> None:
        """Return once ``GET /health`` answers; raise with the URL (and a launched server's log) if it does not."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if server.process is not None and server.process.poll() is not None:
                raise PoolStartError(
                    f"SGLang server {server.url} exited with code {server.process.returncode} while starting. "
                    f"Last lines of {server.log_path}:\n{log_tail(server.log_path)}"
                )
            try:
                client.run(client.get(server.url, "/health", timeout=5.0))
                if server.process is not None:  # what it holds now, for stop_launched even if it crashes later
                    server.process.shm_files = sglang_shm_files([server.process.pid])
                if server.on_cpu:
                    freeze_start_heap(client, server)
                return
            except RETRYABLE as error:
                last = f"{type(error).__name__}: {error}"
            time.sleep(0.5)
        launched = " Check pool.servers.urls, and that the server runs."
        if server.process is not None:
            launched = f" Last lines of {server.log_path}:\n{log_tail(server.log_path)}"
        raise PoolStartError(
            f"SGLang server {server.url} is not healthy after {timeout_s:.0f} s (GET /health: {last}).{launched}"
        )

    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def pick(self, episode: tuple[int, int, int] | None = None) -> Server | None:
        """The live server of ``episode``'s latest turn, else the live server with the fewest requests in flight per
        unit of capacity; ``None`` if none is left (or the router is down)."""
        if self.router is not None and not self.router.alive:
            return None
        alive = self.live()
        same = [s for s in alive if s.url == self.episodes.get(episode)] if episode is not None else []
        if same:
            return same[0]
        return min(alive, key=lambda s: s.in_flight / s.capacity) if alive else None

    async def check_alive(self, client: HTTPClient, server: Server) -> None:
        """Mark ``server`` down if its process exited or ``/health`` fails; warn once when it goes."""
        dead = server.process is not None and server.process.poll() is not None
        if not dead:
            try:
                await client.get(server.url, "/health", timeout=5.0)
            except RETRYABLE:
                dead = True
        if dead and server.alive:
            server.alive = False
            message = f"SGLang server {server.url} is down; its requests go to the other servers"
            warnings.warn(message, RuntimeWarning, stacklevel=2)

    def pids(self) -> list[int]:
        """Process ids of what was launched (router included)."""
        return [p.pid for p in self.launched]


def answers_health(client: HTTPClient, url: str) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` now (one try, five seconds)."""
    try:
        client.run(client.get(url, "/health", timeout=5.0))
        return True
    except RETRYABLE:
        return False


def freeze_start_heap(client: HTTPClient, server: Server) -> None:
    """Freeze a launched CPU server's start-up objects out of its garbage collector, as SGLang means to do itself.

    On the CPU platform every ``/flush_cache`` runs a full ``gc.collect()`` in the scheduler (the one that ends each
    weight sync among them). SGLang asks its processes to ``gc.freeze()`` what they hold once the server is up
    (``POST /freeze_gc``, after the warm-up), so that a collection walks only what came later; but with
    ``--skip-server-warmup`` (the CPU launch's) it asks before its HTTP server listens, the request is refused
    (``post-warmup freeze_gc failed`` in the server's log), and every flush then walks the whole heap: about 0.4 s of
    a 0.41 s sync of the default job's model on a 2-core CPU, 3 ms after the freeze
    (``benchmarks/sglang/request_cost.py``).
    The fleet asks once a server it launched ``on_cpu`` answers ``/health`` (``ServerFleet.wait_healthy``), a flush
    first so that the start's garbage is collected rather than frozen. An SGLang without the route (HTTP 404) keeps
    its collector as it is.
    """
    try:
        client.run(client.post(server.url, "/flush_cache", {}))
        client.run(client.post(server.url, "/freeze_gc", {}))
    except RouteNotFound:
        pass


def warn_unseeded(client: HTTPClient, servers: list[Server]) -> None:
    """Name the attached servers that ignore per-sample seeds (``/server_info``, or the older route)."""
    unseeded = []
    for server in servers:
        info = None
        for path in ("/server_info", "/get_server_info"):
            try:
                info = client.run(client.get(server.url, path))
                break
            except RouteNotFound:
                continue
        if not (isinstance(info, dict) and info.get("enable_deterministic_inference")):
            unseeded.append(server.url)
    if unseeded:
        warnings.warn(
            f"SGLang server(s) {unseeded} do not report --enable-deterministic-inference in their server info, "
            "and without it SGLang ignores each sample's sampling_seed: a retried sample, or an iteration "
            "regenerated after a resume, is drawn anew (still on-policy, not the same). Restart them with the "
            "flag, or set servers.deterministic_inference=false to accept this.",
            stacklevel=3,
        )


def reachable_url(url: str, host: str) -> str:
    """``url`` with a wildcard listening address (``0.0.0.0``, ``[::]``) replaced by ``host``, a name the other
    machines resolve: what a server listening everywhere is reached at from another trainer node.

    >>> reachable_url("http://0.0.0.0:30100", "train-0"), reachable_url("http://infer1:30000", "train-0")
    ('http://train-0:30100', 'http://infer1:30000')
    """
    scheme, rest = url.split("://", 1)
    for wildcard in ("0.0.0.0", "[::]"):
        if rest.startswith(wildcard + ":") or rest == wildcard:
            return f"{scheme}://{host}{rest[len(wildcard) :]}"
    return url


def log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _session_of(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])
    except (OSError, IndexError, ValueError):
        return None


def sglang_shm_files(sessions: Sequence[int]) -> set[Path]:
    """The ``/dev/shm/sglang_*`` files that the processes of ``sessions`` hold open or mapped: SGLang's load
    snapshots (``sglang/srt/managers/load_snapshot.py``), which a server stopped by SIGTERM leaves behind."""
    found: set[Path] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit() and _session_of(p) in sessions):
        try:
            names = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            names += [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        found.update(Path(name) for name in names if name.startswith("/dev/shm/sglang_"))
    return found


class LaunchedProcess(subprocess.Popen):
    """A launched server's process, with the ``/dev/shm/sglang_*`` files it held when it became healthy: a server
    that crashed holds nothing any more, but its files stay (as SIGTERM leaves them: SGLang never removes them)."""

    shm_files: frozenset[Path] | set[Path] = frozenset()


def stop_launched(processes: list[subprocess.Popen], workdir: str | None) -> None:
    """SIGTERM each launched process group, SIGKILL what is left after 15 s, then remove the work dir and the
    shared-memory files the servers hold, or held when they became healthy (``sglang_shm_files``)."""
    leftovers = sglang_shm_files([p.pid for p in processes if p.poll() is None]) if os.path.isdir("/proc") else set()
    for process in processes:
        leftovers |= set(getattr(process, "shm_files", ()))
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
    for path in leftovers:
        path.unlink(missing_ok=True)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)
