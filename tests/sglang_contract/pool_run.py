"""Every request lit_parl's SGLang pool sends in a scripted run against the stand-in, each decided on by SGLang.

``run_pools`` drives ``SGLangRolloutPool`` as a training run does, against the stand-in server
(``tests/helpers/sglang_standin.py``): a launched server (``tp_size=2``) synced by ``tensor`` twice and generating
with every kind of sampling the pool supports (temperature > 0, greedy, top-k / top-p with stop tokens and
stop strings), then two pools attached to it, synced by ``disk`` and by ``distributed`` (gloo here: NCCL
needs GPUs), then a launched server (``tp_size=2``) that takes LoRA adapters (``sync.lora=adapter``): the base
once, then two versions' adapters alone, each generating. The pool's ``HTTPClient._request`` is wrapped, in this
process only and for this run only:
each request is recorded as sent, and each ``POST`` is handed to SGLang's own HTTP front end
(``sglang_side.ServerSide``) before it goes to the stand-in, while the tensors a tensor update points to
are still alive. Nothing of lit_parl or the stand-in is modified.
"""

from __future__ import annotations

import asyncio
import copy
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import torch

from helpers.episode_envs import DIGIT_STOPS, TurnTaker
from lit_parl.callbacks.full_tensors import lora_adapter_config, lora_adapter_tensors
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.episodes import EpisodeRunner, EpisodeSettings
from lit_parl.models import tiny_qwen2
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.models.lora import LoRASettings, add_lora
from lit_parl.rollout import PoolSpec
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sglang import SGLangRolloutPool, SyncSettings
from lit_parl.rollout.sglang.client import HTTPClient
from lit_parl.tasks import CopyTask
from sglang_contract.sglang_side import ServerSide, Verdict

STANDIN = [sys.executable, str(Path(__file__).resolve().parents[1] / "helpers" / "sglang_standin.py")]
TP_SIZE = 2  # of the launched server: a tensor update carries one payload per rank
GROUP_SIZE = 2
STOP_TOKEN = 7
STOP_STRING = "ab"

# the sampling settings of the run, by phase name
SAMPLINGS = {
    "sampled": SamplingParams(max_new_tokens=5, temperature=0.7),
    "greedy": SamplingParams(max_new_tokens=5, temperature=0.0),
    "filtered": SamplingParams(
        max_new_tokens=6, temperature=1.0, top_k=5, top_p=0.9, stop_token_ids=(STOP_TOKEN,), stop=(STOP_STRING,)
    ),
}


@dataclass
class Sent:
    """One HTTP request of the pool.

    Args:
        method, path, body: as sent (``body``: the JSON payload, ``None`` for a GET).
        phase: what the run was doing (``start``, ``sync:<method>:<version>``, ``generate:<sampling>:<version>``).
        verdict: SGLang's front end's decision on it (``POST`` only).
        answer: the stand-in's answer (``None`` if it failed: see ``error``).
    """

    method: str
    path: str
    body: Any
    phase: str
    verdict: Verdict | None = None
    answer: Any = None
    error: str | None = None


@dataclass
class Run:
    """What ``run_pools`` did: the requests in order, and what they were meant to carry."""

    sent: list[Sent] = field(default_factory=list)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # version -> the parameters synced
    adapters: dict[int, tuple[dict, dict[str, torch.Tensor]]] = field(default_factory=dict)  # version -> config, A/B
    sync_methods: dict[int, str] = field(default_factory=dict)  # version -> method
    requests: dict[str, list[GroupRequest]] = field(default_factory=dict)  # generate phase -> its requests
    episodes: list[tuple[GroupRequest, Any]] = field(default_factory=list)  # (first turn's request, its group)
    eos_id: int = -1
    group_name: str = ""
    model_dir: str = ""
    phase: str = "start"  # what the run is doing now: each request is stamped with it

    def where(self, method: str | None = None, path: str | None = None, phase: str | None = None) -> list[Sent]:
        return [
            s
            for s in self.sent
            if (method is None or s.method == method)
            and (path is None or s.path == path)
            and (phase is None or s.phase == phase or s.phase.startswith(phase + ":"))
        ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_model_dir(directory: Path) -> PoolSpec:
    """The tiny policy and its tokenizer saved as the model directory a pool is started with."""
    model, tokenizer = tiny_qwen2(seed=0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return PoolSpec(model_dir=directory, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)


def group_requests(version: int, prompts: int = 3) -> list[GroupRequest]:
    """Requests with the trainer's 63-bit seeds (``sample_seed``), as the datamodule makes them."""
    return [
        GroupRequest(
            prompt_id=i,
            prompt_tokens=tuple(range(5 + i, 12 + i)),
            version=version,
            seeds=tuple(sample_seed(0, version, i, k) for k in range(GROUP_SIZE)),
        )
        for i in range(prompts)
    ]


@contextmanager
def recording(run: Run, server_side: ServerSide):
    """Record every request of every pool's ``HTTPClient`` into ``run``, stamped with ``run.phase``."""
    original = HTTPClient._request

    async def _request(self, method: str, url: str, payload: dict | None, timeout: float):
        sent = Sent(method, urlsplit(url).path, copy.deepcopy(payload), run.phase)
        run.sent.append(sent)
        if method == "POST":  # decided on before the stand-in answers: a tensor update's tensors are alive until then
            sent.verdict = await asyncio.to_thread(server_side.decide, method, sent.path, payload)
        try:
            sent.answer = await original(self, method, url, payload, timeout)
        except BaseException as error:
            sent.error = f"{type(error).__name__}: {error}"
            raise
        return sent.answer

    with mock.patch.object(HTTPClient, "_request", _request):
        yield


def run_pools(spec: PoolSpec, server_side: ServerSide) -> Run:
    """The scripted run (see the module docstring); returns every request with SGLang's verdict on it."""
    run = Run(eos_id=spec.eos_id, model_dir=str(spec.model_dir))

    def sync(pool: SGLangRolloutPool, version: int) -> None:
        model, _ = tiny_qwen2(seed=10 + version)  # other weights at each version
        named = list(model.named_parameters())
        run.weights[version] = {name: t.detach().clone() for name, t in named}
        run.sync_methods[version] = pool.sync.method
        run.phase = f"sync:{pool.sync.method}:{version}"
        pool.sync_weights([named[i : i + 5] for i in range(0, len(named), 5)], version=version)
        assert pool.version == version

    def sync_adapter(pool: SGLangRolloutPool, version: int) -> None:
        """An adapter built as the trainer builds one (peft's layers on the tiny model), its B drawn (B = 0 at the
        start), sent as ``WeightSync`` sends it: peft's names and config."""
        model, _ = tiny_qwen2(seed=0)
        add_lora(model, LoRASettings(rank=4, alpha=8.0))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ".lora_B." in name:
                    parameter.normal_(std=0.1, generator=torch.Generator().manual_seed(version))
        tensors = {name: t.clone() for name, t in lora_adapter_tensors(model)}
        run.adapters[version] = (lora_adapter_config(model), tensors)
        run.phase = f"adapter:{version}"
        pool.sync_adapter([list(tensors.items())], lora_adapter_config(model), version=version)
        assert pool.version == version

    def generate(pool: SGLangRolloutPool, name: str) -> None:
        phase = f"generate:{name}:{pool.version}"
        requests = group_requests(pool.version)
        run.requests[phase] = requests
        run.phase = phase
        groups = list(pool.generate(requests, SAMPLINGS[name]))
        assert sorted(g.prompt_id for g in groups) == [r.prompt_id for r in requests]

    def play_episodes(pool: SGLangRolloutPool) -> None:
        """Multi-turn episodes (the episode tests' environment) over the pool: their continuations are requests."""
        tokenizer = build_char_tokenizer()
        drawn = PromptSchedule(CopyTask(seed=0), tokenizer, group_size=GROUP_SIZE).draw(list(range(4)), pool.version)
        runner = EpisodeRunner(EpisodeSettings(TurnTaker, max_turns=4, max_episode_tokens=40), tokenizer)
        run.phase = f"episodes:{pool.version}"
        sampling = SamplingParams(max_new_tokens=6, stop_token_ids=DIGIT_STOPS)
        for group in runner.generate(pool, [d.request for d in drawn.values()], sampling, drawn):
            run.episodes.append((drawn[group.prompt_id].request, group))

    with recording(run, server_side):
        launched = SGLangRolloutPool(
            servers={"tp_size": TP_SIZE},
            launch={"command": STANDIN, "port": free_port(), "mem_fraction_static": 0.5, "start_timeout_s": 180},
            sync={"method": "tensor"},
        )
        run.group_name = launched.sync.group_name
        launched.start(spec)
        try:
            sync(launched, 0)
            for name in SAMPLINGS:
                generate(launched, name)
            sync(launched, 1)
            generate(launched, "sampled")
            play_episodes(launched)
            url = launched.health().details["urls"][0]
            # attached pools (GET /server_info at start). The distributed one counts one rank per server
            # (tp_size=1): the stand-in joins the group with one rank whatever its --tp-size
            for method, version, tp_size in (("disk", 2, TP_SIZE), ("distributed", 3, 1)):
                run.phase = "start"
                sync_settings = SyncSettings(method=method, backend="gloo", master_port=free_port())
                attached = SGLangRolloutPool(servers={"urls": [url], "tp_size": tp_size}, sync=sync_settings)
                attached.start(spec)
                try:
                    sync(attached, version)
                    generate(attached, "sampled")
                finally:
                    run.phase = "close"
                    attached.close()
        finally:
            run.phase = "close"
            launched.close()
        run.phase = "start"
        adapted = SGLangRolloutPool(
            servers={"tp_size": TP_SIZE},
            launch={"command": STANDIN, "port": free_port(), "start_timeout_s": 180},
            sync={"method": "tensor", "lora": "adapter", "max_lora_rank": 8},
        )
        adapted.start(spec)
        try:
            sync(adapted, 4)  # the base
            for version in (5, 6):
                sync_adapter(adapted, version)
                generate(adapted, "sampled")
        finally:
            run.phase = "close"
            adapted.close()
    return run
