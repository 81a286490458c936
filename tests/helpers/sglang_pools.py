"""Stand-in SGLang servers and pools over them, for the SGLang pool's tests (tests/rollout/test_sglang_*.py).

The stand-in (``sglang_standin.py``) serves SGLang's endpoints over a tiny transformers model; a pool here either
launches stand-ins itself (``start_pool``) or attaches to ones a test started (``launch_standin``, ``attached``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from helpers.multi_process import free_port
from lit_parl.models import tiny_qwen2
from lit_parl.rollout import PoolSpec
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sglang import SGLangRolloutPool, SyncSettings
from lit_parl.tasks import CopyTask

STANDIN = [sys.executable, str(Path(__file__).resolve().parent / "sglang_standin.py")]
SAMPLING = SamplingParams(max_new_tokens=5, temperature=0.7)


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def requests_for(version: int, prompts: int = 4, group_size: int = 4, first: int = 0) -> list[GroupRequest]:
    task = CopyTask(seed=0)
    _, tokenizer = tiny_qwen2()
    out = []
    for prompt_id in range(first, first + prompts):
        text, answer = task.make(prompt_id)
        out.append(
            GroupRequest(
                prompt_id=prompt_id,
                prompt_tokens=tuple(tokenizer(text, add_special_tokens=False).input_ids),
                version=version,
                seeds=tuple(sample_seed(0, version, prompt_id, s) for s in range(group_size)),
            )
        )
    return out


def save_spec(model, tokenizer, directory: Path) -> PoolSpec:
    """What the datamodule hands a pool: the policy and its tokenizer saved as a model directory."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return PoolSpec(model_dir=directory, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def buckets(model, size: int = 5) -> list[list[tuple[str, torch.Tensor]]]:
    """The policy's parameters in buckets of ``size`` tensors, as WeightSync streams them."""
    named = list(model.named_parameters())
    return [named[i : i + size] for i in range(0, len(named), size)]


def sync_by(method: str = "distributed") -> SyncSettings:
    """Sync settings by ``method``; a ``distributed`` group over gloo (NCCL needs GPUs) on a free port."""
    return SyncSettings(method=method, backend="gloo", master_port=free_port())


def start_pool(spec: PoolSpec, launch: dict | None = None, **settings) -> SGLangRolloutPool:
    """A started pool that launched stand-in servers; ``launch`` overrides the stand-in's launch settings."""
    # float32: the exactness checks compare with the float32 trainer (the default dtype is bfloat16)
    launch = {"command": STANDIN, "dtype": "float32", "start_timeout_s": 120, **(launch or {})}
    launch.setdefault("port", free_port(launch.get("num_servers", 1)))
    pool = SGLangRolloutPool(launch=launch, **settings)
    pool.start(spec)
    return pool


def attached(urls: list[str], method: str = "tensor", requests: dict | None = None, **servers) -> SGLangRolloutPool:
    """A pool attached to ``urls`` that syncs by ``method``; ``servers`` are more of its server settings."""
    return SGLangRolloutPool(servers={"urls": urls, **servers}, sync=sync_by(method), requests=requests)


def launch_standin(model_dir: Path, *flags: str, deterministic: bool = True) -> tuple[subprocess.Popen, str]:
    """A stand-in server to attach to; ``deterministic``: started as the pool starts its own (seeds honoured)."""
    port = free_port()
    flags = (*flags, "--enable-deterministic-inference") if deterministic else flags
    process = subprocess.Popen(
        [*STANDIN, "--model-path", str(model_dir), "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return process, url
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("stand-in did not start")
