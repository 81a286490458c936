"""The command lines of what a pool launches: SGLang servers (on a GPU, or SGLang's CPU platform through
``cpu_server`` with ``CPU_ARGS``) and the router, and the checks made before launching them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_parl.rollout.sglang.settings import LaunchSettings


# SGLang reports each sampled token's log-prob in the full softmax of logits / T, before top-k/top-p, as
# the trainer computes it; with this variable true ("1"/"true"), in the softmax before the temperature
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def check_server_env(env: dict[str, str]) -> None:
    """Refuse an environment in which launched servers would report log-probs the trainer does not compute."""
    value = env.get(ORIGINAL_LOGPROB_ENV)
    if value is not None and value.lower() in ("1", "true"):  # how SGLang reads it
        raise ValueError(
            f"{ORIGINAL_LOGPROB_ENV}={value} is set: the SGLang servers would report log-probs of the softmax before "
            f"temperature, but the trainer's are of logits / T. Unset {ORIGINAL_LOGPROB_ENV} for this run."
        )


# SGLang's CPU platform: its PyTorch attention and sampling (the others are GPU kernels), no CUDA graphs, no
# warm-up request, float32 (the CPU trainer's precision), a KV cache and batch sized for a CPU, and a scheduler
# that sleeps when idle (it would otherwise spin about 65% of a core)
CPU_ARGS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--disable-cuda-graph": None,
    "--skip-server-warmup": None,
    "--dtype": "float32",
    "--max-total-tokens": "16384",
    "--max-running-requests": "64",
    "--mem-fraction-static": "0.05",
    "--sleep-on-idle": None,
}
CPU_SERVER = Path(__file__).with_name("cpu_server.py")  # run by path: see its docstring


def launches_on_cpu(launch: LaunchSettings) -> bool:
    """Whether launched servers run on SGLang's CPU platform (``cpu_server`` and ``CPU_ARGS``): ``device=cpu``, or
    ``auto`` with the default command where torch sees no GPU (a command of one's own brings its own flags)."""
    if launch.device == "auto":
        import torch

        return launch.command is None and not torch.cuda.is_available()
    return launch.device == "cpu"


def launch_command(launch: LaunchSettings, cpu: bool) -> list[str]:
    """What runs a server, before its arguments: ``launch.command``, else SGLang's launcher with this Python (on
    the CPU through ``cpu_server``). Raises, naming the fix, where that launcher cannot run."""
    if launch.command is not None:
        return list(launch.command)
    if importlib.util.find_spec("sglang") is None:
        raise ImportError(
            f"pool=sglang launches SGLang servers with {sys.executable}, where sglang is not installed: on a CPU "
            "machine build the pinned environment with `make .venv-sglang/.installed` and run with "
            ".venv-sglang/bin/python (on a GPU: pip install sglang), or attach to running servers with "
            "pool.servers.urls"
        )
    return [sys.executable, str(CPU_SERVER)] if cpu else [sys.executable, "-m", "sglang.launch_server"]


def server_command(
    launch: LaunchSettings,
    model_path: str,
    port: int,
    tp_size: int,
    deterministic_inference: bool,
    extra: Sequence[str] = (),
    cpu: bool = False,
) -> list[str]:
    """``sglang.launch_server``'s command line for the server at ``port`` (``extra``: the pool's own flags, such as
    ``adapters.lora_launch_args``; the user's ``launch.args`` come last).

    Prompts and completions are token ids, but the server loads the model directory's tokenizer: SGLang
    matches stop strings in decoded text and refuses them under ``--skip-tokenizer-init``. SGLang honours a
    request's ``sampling_seed`` only under ``--enable-deterministic-inference``, which it refuses on the CPU
    (``deterministic_on_cpu_warning``). ``cpu``: ``CPU_ARGS`` (``launch.dtype`` is the GPU's; ``launch.args``
    override any of them), ``launch.mem_fraction_static`` if set.
    """
    command = [*launch_command(launch, cpu), "--model-path", model_path, "--host", launch.host, "--port", str(port)]
    command += ["--tp-size", str(tp_size)]
    if launch.mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(launch.mem_fraction_static)]
    if cpu:
        for flag, value in CPU_ARGS.items():
            if flag not in launch.args and flag not in command:
                command += [flag] if value is None else [flag, value]
    elif launch.dtype is not None and "--dtype" not in launch.args:
        command += ["--dtype", launch.dtype]
    if deterministic_inference and not cpu and "--enable-deterministic-inference" not in launch.args:
        command.append("--enable-deterministic-inference")
    return command + list(extra) + list(launch.args)


def server_env(cpu: bool, workdir: str | Path) -> dict[str, str]:
    """A launched server's environment: this process's, and on the CPU ``TMPDIR`` in the pool's work dir. SGLang
    names its processes' ZeroMQ sockets with ``tempfile`` and a stopped server leaves them (and empty files beside
    them) in ``/tmp``; in the work dir they go when the pool removes it at close."""
    env = dict(os.environ)
    if cpu:
        env["TMPDIR"] = str(Path(workdir) / "tmp")
        Path(env["TMPDIR"]).mkdir(exist_ok=True)
    return env


def warn_unseeded_on_cpu() -> None:
    warnings.warn(
        "SGLang servers on the CPU cannot honour each sample's sampling_seed: SGLang allows "
        "--enable-deterministic-inference only with GPU attention backends (sglang/srt/arg_groups/overrides.py), "
        "and the CPU's is torch_native. A retried sample, or an iteration regenerated after a resume, is drawn anew "
        "(still on-policy, not the same). Set pool.servers.deterministic_inference=false to accept this.",
        stacklevel=3,
    )


def router_command(urls: list[str], host: str, port: int, router_args: Sequence[str]) -> list[str]:
    launcher = [sys.executable, "-m", "sglang_router.launch_router"]
    return [*launcher, "--worker-urls", *urls, "--host", host, "--port", str(port), *router_args]
