"""Real SGLang servers on the CPU, started by a test rather than by a pool: the tests attach pools to them, read
their logs and kill them. Each runs as ``pool=sglang`` launches one on a machine without a GPU
(``commands.server_command`` with the CPU flags), in a session of its own, logging to a file.

uvicorn's access log (on at SGLang's default log level) names every request a server answered, in order: what the
tests count (``answered``) to see what a real server received, not what the pool believes it sent.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lit_parl.rollout.processes import dying_with_parent
from lit_parl.rollout.sglang.commands import server_command
from lit_parl.rollout.sglang.servers import stop_launched
from lit_parl.rollout.sglang.settings import LaunchSettings


@dataclass
class RealServer:
    url: str
    process: subprocess.Popen
    log: Path

    def mark(self) -> int:
        """Where the log ends now: ``answered(since=...)`` reads only what follows."""
        return self.log.stat().st_size

    def answered(self, since: int = 0) -> list[str]:
        """The routes of the requests answered since ``since``, in order (``POST /generate``, ...)."""
        with open(self.log, "rb") as log:
            log.seek(since)
            lines = log.read().decode(errors="replace").splitlines()
        return [line.split('"')[1].rsplit(" ", 1)[0] for line in lines if '" 200' in line and 'HTTP/1.1"' in line]


def start_servers(model_dir: Path, ports: list[int], logs: Path, timeout_s: float = 600.0) -> list[RealServer]:
    """One real CPU server per port, each healthy when this returns (their imports take about a minute)."""
    launch = LaunchSettings()
    started = []
    for port in ports:
        command = server_command(launch, str(model_dir), port, 1, False, cpu=True)
        log = logs / f"server_{port}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                dying_with_parent(command), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        started.append(RealServer(f"http://{launch.host}:{port}", process, log))
    deadline = time.monotonic() + timeout_s
    for server in started:
        while not _healthy(server.url):
            if server.process.poll() is not None or time.monotonic() > deadline:
                stop_servers(started)
                raise RuntimeError(f"{server.url} did not start: {server.log.read_text()[-3000:]}")
            time.sleep(1.0)
    return started


def stop_servers(servers: list[RealServer]) -> None:
    """Stop each server's session (SIGTERM, then SIGKILL) and remove the shared-memory files it held."""
    stop_launched([s.process for s in servers], None)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5.0) as answer:
            return answer.status == 200
    except OSError:
        return False
