"""JudgeLaunch: an SGLang server that the run starts for its LLM judge (``lit_parl.rewards.JudgeReward``), and stops
when the judge is closed.

The server is launched as ``pool=sglang`` launches its own (``lit_parl.rollout.sglang.commands.server_command``: on
a machine without a GPU, SGLang's CPU platform), in a session of its own that dies with the trainer, logging to a
work directory of its own; the run waits for ``/health`` and then judges through its OpenAI-compatible routes. Give
it a GPU of its own with ``gpu_ids`` (its ``CUDA_VISIBLE_DEVICES``), apart from the trainer's and the pool's.

Example (its address; starting it needs sglang)::

    >>> import tempfile
    >>> judge_model = tempfile.gettempdir()  # any directory: the model is read only when the server starts
    >>> launch = JudgeLaunch(model_path=judge_model, port=31000, device="cpu")
    >>> launch.url
    'http://127.0.0.1:31000'
"""

from __future__ import annotations

import os
import socket
import tempfile
import weakref
from dataclasses import dataclass, field

from lit_parl.extras import require_installed
from lit_parl.rollout.sglang.client import HTTPClient
from lit_parl.rollout.sglang.commands import launches_on_cpu, server_command, server_env
from lit_parl.rollout.sglang.servers import ServerFleet, stop_launched
from lit_parl.rollout.sglang.settings import LaunchSettings


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class JudgeLaunch:
    """The judge's own SGLang server.

    Args:
        model_path: the judge model's local directory (a Hugging Face checkpoint with its tokenizer and chat template).
        port: where it listens; ``None``: a free port.
        host: its address.
        device: ``cpu``, ``cuda`` or ``auto`` (the CPU where torch sees no GPU).
        gpu_ids: its ``CUDA_VISIBLE_DEVICES`` (e.g. ``"3"``); ``None``: the environment's.
        args: more ``sglang.launch_server`` arguments.
        start_timeout_s: how long it may take to answer ``/health``.
    """

    model_path: str
    port: int | None = None
    host: str = "127.0.0.1"
    device: str = "auto"
    gpu_ids: str | None = None
    args: list[str] = field(default_factory=list)
    start_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(
                f"judge launch.model_path={self.model_path!r} is not a directory: give the judge model's local "
                "Hugging Face directory (nothing is downloaded)"
            )
        if self.port is None:
            self.port = free_port(self.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _settings(self) -> LaunchSettings:
        return LaunchSettings(host=self.host, port=self.port, device=self.device, args=tuple(self.args))

    def command(self) -> list[str]:
        settings = self._settings()
        return server_command(settings, self.model_path, self.port, 1, False, cpu=launches_on_cpu(settings))

    def start(self) -> weakref.finalize:
        """Start the server and wait until it is healthy; the returned finalizer stops it (also at exit)."""
        require_installed("sglang", "sglang", "a judge server the run launches", hint="(or give reward.judge.url)")
        workdir = tempfile.mkdtemp(prefix="lit_parl_judge_")
        fleet = ServerFleet(workdir)
        stop = weakref.finalize(fleet, stop_launched, fleet.launched, workdir)
        cpu = launches_on_cpu(self._settings())
        env = server_env(cpu, workdir)  # as the pool's servers: on the CPU, its socket files in the work dir
        if self.gpu_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_ids)
        server = fleet.launch_server(self.command(), env, self.url, "judge_server.log", on_cpu=cpu)
        client = HTTPClient(30.0)
        try:
            fleet.wait_healthy(client, server, self.start_timeout_s)
        except BaseException:
            stop()
            raise
        finally:
            client.close()
        self._fleet = fleet  # the finalizer fires once the fleet is gone or when called
        return stop

    @property
    def processes(self) -> list:
        """The launched server's process (empty before ``start``)."""
        return list(self._fleet.launched) if hasattr(self, "_fleet") else []


def judge_launch(model_path: str | None = None, **fields) -> JudgeLaunch | None:
    """The config's ``reward.<name>.launch``: a ``JudgeLaunch`` of these fields, or ``None`` without a model path
    (the judge then asks a server one runs, ``reward.<name>.url``)."""
    return None if model_path is None else JudgeLaunch(model_path, **fields)
