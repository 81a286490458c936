"""SGLang's side of the contract, from the installed sglang wheel (pinned in requirements.txt): its HTTP route
table, its HTTP front end deciding on a request, its deserializer of tensor updates.

- ``require_sglang``: where sglang is not installed (the main environment's ``make test``), the calling test
  module is skipped; under ``make test-sglang`` (``LIT_PARL_SGLANG_CONTRACT=1``) that is an error.
- ``route_table``: ``{path: methods}`` of ``sglang.srt.entrypoints.http_server.app``, the server's FastAPI app.
- ``FrontEnd``: that app itself, driven in-process by starlette's ``TestClient``, with the tokenizer manager
  (which needs SGLang's scheduler, hence a GPU) replaced by ``StubTokenizerManager``. FastAPI decodes each
  body into SGLang's request class exactly as the server does (``GenerateReqInput`` through pydantic and the
  ``/generate`` contract gate of ``api_contract.py``; the weight-update structs through their msgspec schema);
  the stub then does what SGLang's tokenizer manager and TP workers do with the decoded request next, with
  SGLang's own functions (each cited at its line in 0.5.23). Its answer is the route's status code.
- ``ServerSide``: the front end in a process of its own (spawned), as a server is: the shared-memory files of
  a CPU tensor update are opened by another process, and SGLang's torch patch (``monkey_patch_torch_reductions``,
  which its TP workers apply before unpickling) is applied there, not in the pool's process.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import io
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONTRACT_ENV = "LIT_PARL_SGLANG_CONTRACT"  # set by `make test-sglang`
REQUIREMENTS = Path(__file__).with_name("requirements.txt")


def pinned_version(package: str = "sglang") -> str:
    """The version of ``package`` pinned in requirements.txt."""
    for line in REQUIREMENTS.read_text().splitlines():
        name, _, version = line.strip().partition("==")
        if name.lower() == package:
            return version
    raise LookupError(f"{package} is not pinned in {REQUIREMENTS}")


def require_sglang() -> None:
    """Skip the calling module without sglang, unless this is ``make test-sglang``; then import SGLang's server code."""
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get(CONTRACT_ENV):
            raise ImportError(
                f"{CONTRACT_ENV} is set (make test-sglang) but sglang is not installed in this environment: "
                f"rm -rf .venv-sglang and run make test-sglang again"
            )
        import pytest

        pytest.skip(
            "sglang is not installed here; `make test-sglang` installs it in .venv-sglang and runs these tests",
            allow_module_level=True,
        )
    import_sglang()


def import_sglang() -> None:
    """Import SGLang's server code, after torchvision is made importable as the CPU server does it
    (``lit_parl.rollout.sglang.cpu_torchvision``); raises if any of it does not import."""
    import warnings

    from lit_parl.rollout.sglang import cpu_torchvision

    cpu_torchvision.make_importable()
    with warnings.catch_warnings():  # its notices that kernels need a GPU: nothing here runs them
        warnings.filterwarnings("ignore", r"(Only CUDA|Triton is not supported)", UserWarning)
        import sglang.api.v1.api_types  # noqa: F401
        import sglang.srt.entrypoints.http_server  # noqa: F401
        import sglang.srt.managers.io_struct  # noqa: F401
        import sglang.srt.sampling.sampling_params  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
        import sglang.srt.utils.common  # noqa: F401


def route_table() -> dict[str, set[str]]:
    """``{path: HTTP methods}`` of every route of SGLang's HTTP server (``http_server.app``, included routers too)."""
    from sglang.srt.entrypoints.http_server import app

    table: dict[str, set[str]] = {}
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods and hasattr(route, "path"):
            table.setdefault(route.path, set()).update(methods)
    return table


@dataclass
class Verdict:
    """What SGLang's HTTP front end made of one request.

    Args:
        status: the route's HTTP status code (200: accepted).
        text: the answer's body, cut at 600 characters (the reason of a refusal).
        request_class: the class FastAPI decoded the body into (``None`` if decoding failed).
        fields: the decoded request's fields (``serialized_named_tensors`` left out: see ``ranks``).
        sampling: ``/generate``: the fields of SGLang's ``SamplingParams`` after ``normalize`` and ``verify``.
        ranks: ``/update_weights_from_tensor`` and ``/load_lora_adapter_from_tensors``: ``torch.save`` bytes of each TP
            rank's deserialized ``[(name, tensor)]``, or the deserializer's error for that rank.
    """

    status: int
    text: str
    request_class: str | None = None
    fields: dict | None = None
    sampling: dict | None = None
    ranks: list[bytes | str] = field(default_factory=list)

    @property
    def accepted(self) -> bool:
        return 200 <= self.status < 300

    def rank_tensors(self) -> list[list[tuple[str, Any]]]:
        """Each rank's ``[(name, tensor)]`` (raises with the deserializer's error if a rank failed)."""
        import torch

        out = []
        for rank, data in enumerate(self.ranks):
            if isinstance(data, str):
                raise AssertionError(f"TP rank {rank} could not deserialize its payload: {data}")
            out.append(torch.load(io.BytesIO(data), weights_only=True))
        return out


class StubTokenizerManager:
    """In place of SGLang's ``TokenizerManager``: what the route handlers call once FastAPI decoded the body.

    Each method records the decoded request and does the checks SGLang does next (cited), then answers as
    the tokenizer manager answers success. A route that calls anything else fails (HTTP 500): it is not modeled.
    """

    is_generation = True
    gracefully_exit = False

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.seen: tuple | None = None

    def generate_request(self, obj, request=None):
        from sglang.srt.sampling.sampling_params import SamplingParams

        async def answers():
            self.seen = (obj, None, [])
            obj.normalize_batch_and_arguments()  # tokenizer_manager.py:903 (TokenizerManager.generate_request)
            # tokenizer_manager.py:1549-1567 (_create_tokenized_object): the request's dict, then normalize and verify
            params = SamplingParams(**dict(obj.sampling_params))
            params.normalize(self.tokenizer)
            params.verify(self.vocab_size)
            self.seen = (obj, params, [])
            yield {"text": "", "meta_info": {}}

        return answers()

    async def update_weights_from_tensor(self, obj, request=None):
        import torch
        from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        ranks: list[bytes | str] = []
        self.seen = (obj, None, ranks)
        # tokenizer_control_mixin.py:576: the payloads normalized to raw serializer bytes
        payloads = normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors)
        for payload in payloads:
            # tp_worker.py:196-200 (TpModelWorker.deserialize_own_rank): each rank patches torch, then unpickles its own
            try:
                monkey_patch_torch_reductions()
                named = MultiprocessingSerializer.deserialize(payload)
                buffer = io.BytesIO()
                torch.save([(name, tensor.clone()) for name, tensor in named], buffer)
                ranks.append(buffer.getvalue())
            except Exception as error:  # noqa: BLE001 - SGLang's worker answers the failure; the verdict says which
                ranks.append(f"{type(error).__name__}: {error}")
        failed = [r for r in ranks if isinstance(r, str)]
        return (not failed, "ok" if not failed else f"deserialization failed: {failed[0]}")

    async def load_lora_adapter_from_tensors(self, obj, request=None):
        import torch
        from sglang.srt.lora.lora_config import LoRAConfig
        from sglang.srt.managers.io_struct import LoRAUpdateOutput
        from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        ranks: list[bytes | str] = []
        self.seen = (obj, None, ranks)
        LoRAConfig.from_dict(obj.config_dict)  # lora_config.py:35-45: reads target_modules, r and lora_alpha
        for payload in normalize_serialized_named_tensor_payloads(obj.serialized_named_tensors):
            # tp_worker.py:217-230 (TpModelWorker.load_lora_adapter_from_tensors): each rank deserializes its own
            # payload, a {name: tensor} dict, handed to the LoRA manager as such
            try:
                monkey_patch_torch_reductions()
                tensors = MultiprocessingSerializer.deserialize(payload)
                if not isinstance(tensors, dict):
                    raise TypeError(f"the payload is a {type(tensors).__name__}, not the {{name: tensor}} dict")
                buffer = io.BytesIO()
                torch.save([(name, tensor.clone()) for name, tensor in tensors.items()], buffer)
                ranks.append(buffer.getvalue())
            except Exception as error:  # noqa: BLE001 - the worker answers the failure; the verdict says which
                ranks.append(f"{type(error).__name__}: {error}")
        failed = [r for r in ranks if isinstance(r, str)]
        return LoRAUpdateOutput(success=not failed, error_message=failed[0] if failed else None, loaded_adapters={})

    async def unload_lora_adapter(self, obj, request=None):
        from sglang.srt.managers.io_struct import LoRAUpdateOutput

        self.seen = (obj, None, [])
        return LoRAUpdateOutput(success=True, loaded_adapters={})

    async def update_weight_version(self, obj):
        self.seen = (obj, None, [])

    async def update_weights_from_disk(self, obj, request=None):
        self.seen = (obj, None, [])
        return True, "ok", 0

    def _succeed(self, obj, request=None):
        self.seen = (obj, None, [])
        return True, "ok"

    async def init_weights_update_group(self, obj, request=None):
        return self._succeed(obj)

    async def update_weights_from_distributed(self, obj, request=None):
        return self._succeed(obj)

    async def destroy_weights_update_group(self, obj, request=None):
        return self._succeed(obj)

    async def begin_weight_update(self, obj, request=None):
        return self._succeed(obj)

    async def end_weight_update(self, obj, request=None):
        return self._succeed(obj)

    async def pause_generation(self, obj):
        self.seen = (obj, None, [])

    async def continue_generation(self, obj):
        self.seen = (obj, None, [])

    async def flush_cache(self, timeout_s: float = 0.0):
        from types import SimpleNamespace

        self.seen = (None, None, [])
        return SimpleNamespace(success=True, message="")

    async def freeze_gc(self):
        self.seen = (None, None, [])


class FrontEnd:
    """SGLang's HTTP server app over ``StubTokenizerManager``, in this process.

    Args:
        tokenizer_dir: the model directory whose tokenizer the stub normalizes stop strings with, and whose
            vocabulary size bounds ``verify`` (as a server started on that directory would).
    """

    def __init__(self, tokenizer_dir: str) -> None:
        import_sglang()
        from sglang.srt.entrypoints import http_server
        from starlette.testclient import TestClient
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.stub = StubTokenizerManager(tokenizer, AutoConfig.from_pretrained(tokenizer_dir).vocab_size)
        http_server.set_global_state(
            http_server._GlobalState(tokenizer_manager=self.stub, template_manager=None, scheduler_info={})
        )
        self.client = TestClient(
            http_server.app, raise_server_exceptions=False
        )  # no `with`: no lifespan, no server start

    def decide(self, method: str, path: str, body: Any) -> Verdict:
        import msgspec

        self.stub.seen = None
        response = self.client.request(method, path, json=body)
        verdict = Verdict(status=response.status_code, text=response.text[:600])
        if self.stub.seen is not None:
            obj, params, ranks = self.stub.seen
            if obj is not None:
                verdict.request_class = type(obj).__name__
                if isinstance(obj, msgspec.Struct):
                    verdict.fields = {
                        k: v for k, v in msgspec.structs.asdict(obj).items() if k != "serialized_named_tensors"
                    }
                else:  # GenerateReqInput is a dataclass
                    names = ("input_ids", "text", "return_logprob", "stream", "rid", "lora_path")
                    verdict.fields = {k: getattr(obj, k) for k in names}
            if params is not None:
                verdict.sampling = msgspec.structs.asdict(params)
            verdict.ranks = list(ranks)
        return verdict


_front_end: FrontEnd | None = None


def _decide_in_child(tokenizer_dir: str, method: str, path: str, body: Any) -> Verdict:
    global _front_end
    if _front_end is None:
        _front_end = FrontEnd(tokenizer_dir)
    return _front_end.decide(method, path, body)


class ServerSide:
    """``FrontEnd`` in a spawned process of its own: ``decide`` sends it a request and returns its ``Verdict``.

    Args:
        tokenizer_dir: as for ``FrontEnd``.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer_dir = str(tokenizer_dir)
        self._executor = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._started = self._executor.submit(_decide_in_child, self.tokenizer_dir, "GET", "/no-such-route", None)

    def decide(self, method: str, path: str, body: Any) -> Verdict:
        self._started.result(timeout=300)  # SGLang's import, once; its error, if any, surfaces here
        return self._executor.submit(_decide_in_child, self.tokenizer_dir, method, path, body).result(timeout=300)

    def close(self) -> None:
        self._executor.shutdown(cancel_futures=True)
