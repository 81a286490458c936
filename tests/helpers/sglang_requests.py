"""What SGLang 0.5.23 accepts, for the stand-in server (tests/helpers/sglang_standin.py) to refuse what SGLang refuses.

- ``sampling_problem``: ``/generate``'s ``sampling_params``, as SGLang's contract gate decodes them (known keys
  of the right JSON types, ``api/v1/api_types.py``) and as ``SamplingParams.verify`` checks their ranges
  (``srt/sampling/sampling_params.py``).
- ``body_problem``: the control routes' bodies, as SGLang decodes them into its msgspec structs
  (``srt/managers/io_struct.py``): a missing required field, a wrong type or a value outside a ``Literal`` is
  an HTTP 400 (``entrypoints/http_server.py``); unknown keys are ignored.

``tests/sglang_contract`` sends the same probes to the stand-in and to SGLang's own front end.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Callable

Check = Callable[[object], bool]


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _float(v) -> bool:  # a JSON number (msgspec's float takes an int too)
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _str(v) -> bool:
    return isinstance(v, str)


def _bool(v) -> bool:
    return isinstance(v, bool)


def _optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _list(check: Check) -> Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _one_of(*values) -> Check:
    return lambda v: v in values


def _base64(v) -> bool:
    if not isinstance(v, str):
        return False
    try:
        base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


# the fields of SGLang's SamplingParams that its /generate gate takes, with their JSON types
SAMPLING_PARAMS: dict[str, Check] = {
    "max_new_tokens": _optional(_int),
    "stop": lambda v: v is None or _str(v) or _list(_str)(v),
    "stop_token_ids": _optional(_list(_int)),
    "stop_regex": lambda v: v is None or _str(v) or _list(_str)(v),
    "temperature": _float,
    "top_p": _float,
    "top_k": _int,
    "min_p": _float,
    "frequency_penalty": _float,
    "presence_penalty": _float,
    "repetition_penalty": _float,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _optional(_str),
    "regex": _optional(_str),
    "ebnf": _optional(_str),
    "structural_tag": _optional(_str),
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "custom_params": _optional(lambda v: isinstance(v, dict)),
    "stream_interval": _optional(_int),
    "logit_bias": _optional(lambda v: isinstance(v, dict)),
    "sampling_seed": _optional(_int),
    "beam_width": _optional(_int),
    "watermark": lambda v: True,
}
SGLANG_SAMPLING_PARAMS = set(SAMPLING_PARAMS)


def sampling_problem(p: dict) -> str | None:
    """Why SGLang refuses these sampling parameters (HTTP 400), or ``None``."""
    unknown = sorted(set(p) - SGLANG_SAMPLING_PARAMS)
    if unknown:
        return f"unknown field(s) {unknown} in sampling_params"
    wrong = sorted(k for k, v in p.items() if not SAMPLING_PARAMS[k](v))
    if wrong:
        return f"invalid type for sampling_params {wrong}"
    temperature, top_p, min_p = p.get("temperature", 1.0), p.get("top_p", 1.0), p.get("min_p", 0.0)
    if not math.isfinite(temperature) or temperature < 0:
        return f"temperature must be non-negative, got {temperature}."
    if not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}."
    if not 0.0 <= min_p <= 1.0:
        return f"min_p must be in [0, 1], got {min_p}."
    if p.get("top_k", -1) != -1 and p["top_k"] < 1:
        return f"top_k must be -1 (disable), or at least 1, got {p['top_k']}."
    if p.get("max_new_tokens") is not None and p["max_new_tokens"] < 0:
        return f"max_new_tokens must be at least 0, got {p['max_new_tokens']}."
    if p.get("beam_width") is not None and p["beam_width"] < 1:
        return f"beam_width must be at least 1, got {p['beam_width']}."
    if p.get("sampling_seed") is not None and not -(2**63) <= p["sampling_seed"] <= 2**63 - 1:
        return f"sampling_seed must fit in 64 bits, got {p['sampling_seed']}."
    return None


SELECTOR = _one_of("target", "draft", "all")
# route -> {field: (check, required)}
BODIES: dict[str, dict[str, tuple[Check, bool]]] = {
    "/update_weights_from_disk": {
        "model_path": (_str, True),
        "weight_version": (_optional(_str), False),
        "flush_cache": (_bool, False),
        "abort_all_requests": (_bool, False),
    },
    "/update_weights_from_tensor": {
        "serialized_named_tensors": (_list(_base64), True),
        "weight_version": (_optional(_str), False),
        "flush_cache": (_bool, False),
        "selector": (SELECTOR, False),
        "load_format": (_optional(_str), False),
    },
    "/init_weights_update_group": {
        "master_address": (_str, True),
        "master_port": (_int, True),
        "rank_offset": (_int, True),
        "world_size": (_int, True),
        "group_name": (_str, False),
        "backend": (_str, False),
    },
    "/update_weights_from_distributed": {
        "names": (_list(_str), True),
        "dtypes": (_list(_str), True),
        "shapes": (_list(_list(_int)), True),
        "group_name": (_str, False),
        "flush_cache": (_bool, False),
        "weight_version": (_optional(_str), False),
        "selector": (SELECTOR, False),
    },
    "/destroy_weights_update_group": {"group_name": (_str, False)},
    "/load_lora_adapter_from_tensors": {
        "lora_name": (_str, True),
        "config_dict": (lambda v: isinstance(v, dict), True),
        "serialized_named_tensors": (_list(_base64), True),
        "pinned": (_bool, False),
        "added_tokens_config": (_optional(lambda v: isinstance(v, dict)), False),
        "lora_id": (_optional(_str), False),
        "load_format": (_optional(_str), False),
        "expected_checksums": (_optional(lambda v: isinstance(v, dict)), False),
    },
    "/unload_lora_adapter": {"lora_name": (_str, True), "lora_id": (_optional(_str), False)},
    "/update_weight_version": {"new_version": (_str, True), "abort_all_requests": (_bool, False)},
    "/pause_generation": {"mode": (_one_of("abort", "retract", "in_place"), False)},
    "/begin_weight_update": {"selector": (SELECTOR, False)},
}


def body_problem(path: str, body) -> str | None:
    """Why SGLang refuses ``body`` at ``path`` (HTTP 400), or ``None`` (also for a route not listed)."""
    fields = BODIES.get(path)
    if fields is None:
        return None
    if not isinstance(body, dict):
        return f"{path}: the body must be a JSON object"
    missing = sorted(name for name, (_, required) in fields.items() if required and name not in body)
    if missing:
        return f"{path}: missing required field(s) {missing}"
    wrong = sorted(name for name, (check, _) in fields.items() if name in body and not check(body[name]))
    return f"{path}: invalid value for {wrong}" if wrong else None


def generate_problem(body) -> str | None:
    """Why SGLang refuses a ``/generate`` body (HTTP 400), or ``None``."""
    if not isinstance(body, dict) or body.get("input_ids") is None and body.get("text") is None:
        return "Either text, input_ids or input_embeds should be provided."
    if "return_logprob" in body and not (_bool(body["return_logprob"]) or _list(_bool)(body["return_logprob"])):
        return "return_logprob must be a boolean"
    lora = body.get("lora_path")
    if not (lora is None or _str(lora) or _list(_optional(_str))(lora)):
        return "lora_path must be a string, a list of strings (or nulls), or null"
    params = body.get("sampling_params") or {}
    for p in params if isinstance(params, list) else [params]:
        problem = sampling_problem(p)
        if problem:
            return problem
    return None
