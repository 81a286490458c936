"""The stand-in server of the main tests (``tests/helpers/sglang_standin.py``) against SGLang's own code (sglang 0.5.23,
as pinned in requirements.txt): the pool's tests against the stand-in are worth what the stand-in's
agreement with SGLang is worth.

* Every route the stand-in serves is a route of SGLang's HTTP server, with that method.
* The sampling parameters it accepts are SGLang's (those both the ``/generate`` contract gate,
  ``api/v1/api_types.py``, and ``SamplingParams``, ``srt/sampling/sampling_params.py``, accept).
* Probes: malformed and borderline requests sent to a running stand-in and to SGLang's HTTP front end
  (``sglang_side``); both must answer alike: accepted (2xx), refused (4xx: the pool does not retry) or failed
  (5xx: the pool retries on another server). Each probe that SGLang refuses names the SGLang line that
  refuses it; the stand-in's checks are in ``tests/helpers/sglang_requests.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from unittest import mock

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

from sglang.api.v1.api_types import SamplingParams as ContractSamplingParams  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams  # noqa: E402

from lit_parl.rollout.weight_transfer import serialize_named_tensors  # noqa: E402
from sglang_contract.pool_run import STANDIN  # noqa: E402
from sglang_contract.sglang_side import route_table  # noqa: E402

STANDIN_FILE = Path(STANDIN[1])


def load_standin_module():
    spec = importlib.util.spec_from_file_location("lit_parl_sglang_standin", STANDIN_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def standin_routes(model_dir: str) -> set[tuple[str, str]]:
    """``(method, path)`` of the stand-in's aiohttp app, built by its own ``main`` (``run_app`` intercepted)."""
    module = load_standin_module()
    built = {}
    with (
        mock.patch.object(module.web, "run_app", lambda app, **kwargs: built.setdefault("app", app)),
        mock.patch.object(sys, "argv", ["sglang_standin.py", "--model-path", model_dir]),
    ):
        module.main()
    return {
        (route.method, route.resource.canonical) for route in built["app"].router.routes() if route.method != "HEAD"
    }


def test_every_route_the_standin_serves_is_sglangs(spec):
    table = route_table()
    routes = standin_routes(str(spec.model_dir))
    assert ("POST", "/generate") in routes and len(routes) > 10
    missing = sorted((method, path) for method, path in routes if method not in table.get(path, set()))
    assert not missing, f"the stand-in serves routes SGLang does not: {missing}"


def sglang_accepted_sampling_params() -> set[str]:
    """The keys of ``sampling_params`` SGLang takes: its contract gate's (unknown keys refused) and its
    ``SamplingParams``' (the gate lets ``choice`` through, which ``SamplingParams(**...)`` does not take)."""
    return set(ContractSamplingParams.__struct_fields__) & set(SGLangSamplingParams.__struct_fields__)


def test_the_standin_accepts_no_sampling_param_that_sglang_refuses():
    standin = load_standin_module().SGLANG_SAMPLING_PARAMS
    assert not standin - sglang_accepted_sampling_params(), (
        "sampling parameters the stand-in accepts and SGLang refuses"
    )


def test_the_standin_accepts_every_sampling_param_sglang_accepts():
    assert load_standin_module().SGLANG_SAMPLING_PARAMS == sglang_accepted_sampling_params()


# ------------------------------------------------------------------------------------------------------
# probes: the same request to the stand-in and to SGLang's front end
# ------------------------------------------------------------------------------------------------------
GENERATE = {
    "input_ids": [5, 6, 7],
    "sampling_params": {"max_new_tokens": 3, "temperature": 0.7, "sampling_seed": 1},
    "return_logprob": True,
}


def generate(**params) -> dict:
    return {**GENERATE, "sampling_params": {**GENERATE["sampling_params"], **params}}


TENSOR = "@tensor"  # replaced by a real serialized payload (built when the probe runs)
BEGIN, END, CONTINUE = ("/begin_weight_update", {}), ("/end_weight_update", {}), ("/continue_generation", {})


def refused(why: str) -> str:
    return f"SGLang refuses it: {why}"


def accepted(why: str) -> str:
    return f"SGLang accepts it: {why}"


GATE = "SGLang's /generate contract gate (api/v1/api_types.py decode_SamplingParams, :1259) refuses"
VERIFY = "SGLang's SamplingParams.verify (srt/sampling/sampling_params.py) refuses"
STRUCT = (
    "SGLang decodes the body into its msgspec struct (srt/managers/io_struct.py) and answers 400 (http_server.py:636)"
)


def probe(path: str, body, probe_id: str, before=(), after=(), why: str = ""):
    """A request sent to both; ``before`` / ``after``: requests to the stand-in that set up and undo its state;
    ``why``: what SGLang does with it and where (shown when the two disagree)."""
    return pytest.param(path, body, list(before), list(after), why, id=probe_id)


PROBES = [
    probe("/generate", GENERATE, "generate-valid"),
    probe(
        "/generate",
        {**GENERATE, "lora_path": 5},
        "generate-lora-path-a-number",
        why=refused("GenerateReqInput.lora_path is Optional[Union[List[Optional[str]], str]] (io_struct.py:277)"),
    ),
    probe(
        "/load_lora_adapter_from_tensors",
        {"config_dict": {}, "serialized_named_tensors": []},
        "load-adapter-without-a-name",
        why=refused(STRUCT),
    ),
    probe("/unload_lora_adapter", {}, "unload-adapter-without-a-name", why=refused(STRUCT)),
    probe("/update_weight_version", {"new_version": 3}, "weight-version-a-number", why=refused(STRUCT)),
    probe(
        "/update_weight_version",
        {"new_version": "3", "abort_all_requests": False},
        "weight-version-valid",
        after=[("/update_weight_version", {"new_version": "default"})],
        why=accepted("http_server.py:1527, update_weight_version"),
    ),
    probe("/generate", {**GENERATE, "foo": 1}, "generate-unknown-top-level-key"),
    probe("/generate", generate(stop="x"), "generate-stop-as-a-string"),
    probe("/generate", generate(seed=1), "generate-unknown-sampling-param"),
    probe("/generate", generate(temperature="0.7"), "generate-temperature-a-string", why=refused(f"{GATE} a string")),
    probe(
        "/generate", generate(max_new_tokens="3"), "generate-max-new-tokens-a-string", why=refused(f"{GATE} a string")
    ),
    probe(
        "/generate",
        {**GENERATE, "return_logprob": "yes"},
        "generate-return-logprob-a-string",
        why=refused("SGLang's contract gate refuses a string for return_logprob (api_types.py:1428)"),
    ),
    probe("/generate", generate(top_k=0), "generate-top-k-0", why=refused(f"{VERIFY} top_k=0 (:265)")),
    probe(
        "/generate",
        generate(min_p=2.0),
        "generate-min-p-above-1",
        why=refused(f"{VERIFY} min_p > 1 (:262); the stand-in ignores min_p"),
    ),
    probe("/generate", generate(top_p=1.5), "generate-top-p-above-1", why=refused(f"{VERIFY} top_p > 1 (:260)")),
    probe(
        "/generate",
        generate(temperature=-1.0),
        "generate-negative-temperature",
        why=refused(f"{VERIFY} a negative temperature (:257)"),
    ),
    probe("/generate", generate(sampling_seed=1.5), "generate-fractional-seed", why=refused(f"{GATE} a float seed")),
    probe(
        "/generate",
        generate(stop_token_ids=["2"]),
        "generate-stop-token-a-string",
        why=refused(f"{GATE} a string token id"),
    ),
    probe(
        "/generate",
        {"sampling_params": GENERATE["sampling_params"]},
        "generate-no-input",
        why=refused(
            "GenerateReqInput.normalize_batch_and_arguments raises 'Either text, input_ids or "
            "input_embeds should be provided.' (io_struct.py:454), a 400"
        ),
    ),
    probe(
        "/generate",
        generate(max_new_tokens=0),
        "generate-max-new-tokens-0",
        why=accepted(
            "SGLang's verify allows max_new_tokens=0 (the pool never sends it: lit_parl's SamplingParams needs >= 1)"
        ),
    ),
    probe("/pause_generation", {}, "pause", after=[CONTINUE]),
    probe(
        "/pause_generation",
        {"mode": "bogus"},
        "pause-unknown-mode",
        after=[CONTINUE],
        why=refused(f"mode is Literal['abort', 'retract', 'in_place'] (io_struct.py:1946); {STRUCT}"),
    ),
    probe("/continue_generation", {}, "continue"),
    probe("/flush_cache", None, "flush-cache"),
    probe("/freeze_gc", None, "freeze-gc"),
    probe(
        "/begin_weight_update",
        {"selector": "bogus"},
        "begin-unknown-selector",
        after=[END],
        why=refused(f"selector is Literal['target', 'draft', 'all'] (io_struct.py:2200); {STRUCT}"),
    ),
    probe("/update_weights_from_disk", {"model_path": "@checkpoint", "weight_version": "3"}, "disk-valid"),
    probe(
        "/update_weights_from_disk",
        {"model_path": "@checkpoint", "weight_version": 3},
        "disk-version-an-int",
        why=refused(
            f"weight_version is Optional[str] (io_struct.py:1978); {STRUCT}; the stand-in then reports an int version"
        ),
    ),
    probe(
        "/update_weights_from_disk",
        {"weight_version": "3"},
        "disk-no-model-path",
        why=refused(f"model_path is required (io_struct.py:1972); {STRUCT}"),
    ),
    probe(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [TENSOR], "weight_version": "4"},
        "tensor-valid",
        before=[BEGIN],
        after=[END],
    ),
    probe(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [TENSOR], "weight_version": 4},
        "tensor-version-an-int",
        before=[BEGIN],
        after=[END],
        why=refused(f"weight_version is Optional[str] (io_struct.py:2043); {STRUCT}"),
    ),
    probe(
        "/update_weights_from_tensor",
        {"serialized_named_tensors": ["@@@"]},
        "tensor-payload-not-base64",
        before=[BEGIN],
        after=[END],
        why=refused(f"each payload is Base64Bytes (io_struct.py:2035); {STRUCT}"),
    ),
    probe(
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2},
        "init-group-no-rank-offset",
        why=refused(f"rank_offset is required (io_struct.py:2132); {STRUCT}"),
    ),
]


def outcome(status: int) -> str:
    return "accepted" if status < 300 else "refused (4xx)" if status < 500 else "failed (5xx)"


def post(url: str, path: str, body) -> int:
    data = b"" if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def prepared(body, checkpoint: str, spec):
    """``body`` as sent: ``@checkpoint`` replaced by the checkpoint's path, ``@tensor`` by a payload of the model's
    first two tensors. Returns the body and those tensors, which must stay alive until the servers have answered."""
    keep = []
    if isinstance(body, dict):
        body = json.loads(json.dumps(body).replace('"@checkpoint"', json.dumps(checkpoint)))
        if body.get("serialized_named_tensors") == [TENSOR]:
            from transformers import AutoModelForCausalLM

            keep = [
                (name, t.detach().clone())
                for name, t in AutoModelForCausalLM.from_pretrained(spec.model_dir).named_parameters()
            ][:2]
            body["serialized_named_tensors"] = [serialize_named_tensors(keep)]
    return body, keep


def send(url: str, path: str, body, before=(), after=()) -> int:
    """``before``'s requests (each must succeed), the probe, then ``after``'s (whatever they answer): the probe's
    status."""
    for setup_path, setup_body in before:
        assert post(url, setup_path, setup_body) == 200, setup_path
    try:
        return post(url, path, body)
    finally:
        for cleanup_path, cleanup_body in after:
            post(url, cleanup_path, cleanup_body)


@pytest.mark.parametrize("path, body, before, after, why", PROBES)
def test_the_standin_answers_a_probe_as_sglang_does(
    path, body, before, after, why, standin, checkpoint, server_side, spec
):
    body, keep = prepared(body, checkpoint, spec)
    sglang = server_side.decide("POST", path, body)
    got = send(standin, path, body, before, after)
    del keep
    assert outcome(got) == outcome(sglang.status), (
        f"the stand-in {outcome(got)} (HTTP {got}), "
        f"SGLang {outcome(sglang.status)} (HTTP {sglang.status}: {sglang.text[:300]}). {why}"
    )
