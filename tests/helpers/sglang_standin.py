"""A stand-in for an SGLang server, for tests on a machine without a GPU. It is not SGLang.

It accepts ``sglang.launch_server``'s arguments that the pool passes and implements the native HTTP
endpoints the pool uses, with SGLang's request and response shapes, over a transformers model loaded
from ``--model-path``:

``/health``, ``/health_generate``, ``/generate`` (single or batched ``input_ids``, ``sampling_params`` as
one dict or a list, ``n``, ``sampling_seed``, ``stop_token_ids``, ``stop``, ``return_logprob``; answers
with ``output_ids`` and ``meta_info.output_token_logprobs`` / ``finish_reason`` / ``weight_version``),
``/server_info`` (``enable_deterministic_inference``), ``/model_info`` (its ``weight_version``),
``/begin_weight_update``, ``/end_weight_update``, ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group``, ``/update_weights_from_distributed`` (gloo
here, NCCL in SGLang), ``/destroy_weights_update_group``, ``/pause_generation``, ``/continue_generation``,
``/flush_cache``, ``/freeze_gc``, and LoRA adapters (``--enable-lora``; ``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``, ``/update_weight_version``, ``/generate``'s ``lora_path``: ``sglang_standin_lora``).

The weight-update API of current SGLang (0.5.23): no ``/get_weight_version`` route; tensor and distributed
updates refused (HTTP 400, ``success: false``) outside a session opened by ``/begin_weight_update`` and
closed by ``/end_weight_update``; a second ``begin`` inside a session, or an ``end`` outside one, refused.
``--legacy-api`` is an SGLang from before sessions and ``/model_info``'s version: ``/get_weight_version``
instead, no session routes, updates taken as they come.

Log-probs as SGLang reports them: of the full softmax of logits / T, before top-k/top-p (the draw is from
the filtered one); with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` true, of the softmax before the temperature.

As strict as SGLang (``sampling_params.py``, ``schedule_batch.py``, ``server_args.py``): a launch flag it
does not know exits with code 2; ``sampling_seed`` is honoured only under ``--enable-deterministic-inference``
(a request without one then gets 42), and ignored otherwise; a sampling parameter SGLang does not
have is refused (HTTP 400); ``stop`` strings are refused under ``--skip-tokenizer-init`` (the
tokenizer decodes the completion to match them); temperature below 1e-6 becomes greedy as SGLang makes
it, T = 1 with ``top_k=1``; the length limit is checked before the stop conditions, so a sample whose
last allowed token is an end token or completes a stop string finishes ``{"type": "length"}``;
otherwise ``{"type": "stop", "matched": <the string>}`` (the first of ``stop`` in order that the
completion holds) or ``{"type": "stop", "matched": <the token>}``. Assumed, not SGLang's exactly: the
match runs on the whole completion's text with special tokens skipped (SGLang decodes a tail of
``stop``'s token length + 1 tokens, special tokens kept: the same on this character tokenizer's text).
As SGLang does: ``/generate`` while paused is held until ``/continue_generation``; ``/flush_cache`` is
refused (HTTP 400) while a request runs; ``/update_weights_from_tensor`` reads one payload per
tensor-parallel rank (``--tp-size``), each rank its own; ``--dtype`` sets the served precision.
Laxer than SGLang, known: a pause does not abort the request running (its default ``abort`` mode
does); with ``n`` > 1 sample ``k`` uses ``sampling_seed + k`` (the pool sends one request per sample).

Faults for the tests: ``--die-after-generates N`` exits abruptly while answering the (N+1)-th ``/generate`` (of
weight version V only, with ``--die-at-version V``); ``--die-at ROUTE:N`` exits abruptly on receiving the N-th
request to ROUTE (``/pause_generation:2``: a server that dies at the second push); ``--malformed`` drops
``meta_info`` from answers; ``--stale-version`` accepts updates but keeps its weight version; ``--exit-at-start``
exits with code 3 before serving; ``--refuse-distributed-updates`` answers ``/update_weights_from_distributed``
with a 400 without joining the broadcast. ``--journal FILE`` appends a JSON line per weight load (its version and
tensors) and per sample (the version it was drawn with, its prompt and seed): what tests count across servers and
clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_parl.rollout.records import GroupRequest, SamplingParams
from lit_parl.rollout.sampling import sample_groups

# run as a script (a server process), or loaded from its path by the contract tests: its sibling module by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sglang_requests import (  # noqa: E402, F401 - the contract tests read the set here
    SGLANG_SAMPLING_PARAMS,
    body_problem,
    generate_problem,
)
from sglang_standin_lora import Adapters, check_lora_args  # noqa: E402

from lit_parl.rollout.weight_transfer import (
    deserialize_named_tensors,
    init_weight_update_group,
)

# SGLang's --dtype choices (server_args.py)
DTYPES = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


class StandIn:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.set_num_threads(1)
        self.args = args
        dtype = "auto" if args.dtype == "auto" else DTYPES[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, attn_implementation="sdpa"
        ).eval()
        self.tokenizer = None if args.skip_tokenizer_init else AutoTokenizer.from_pretrained(args.model_path)
        self.weight_version = "default"
        # read as SGLang reads it: log-probs before the temperature
        self.original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "false").lower() in ("1", "true")
        self.resumed = asyncio.Event()  # cleared by /pause_generation: new requests wait for /continue_generation
        self.resumed.set()
        self.running = 0  # requests being sampled: /flush_cache is refused while there are any
        self.generates = 0
        self.group = None
        self.group_name = None
        self.in_session = False  # between /begin_weight_update and /end_weight_update
        self.lock = asyncio.Lock()  # one model call at a time, like a scheduler's batch
        self.adapters = Adapters(args)

    # -- generation ------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        problem = generate_problem(body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)  # SGLang's answer to a ValueError
        if self.args.die_at_version is None or self.weight_version == self.args.die_at_version:
            self.generates += 1
        if self.args.die_after_generates is not None and self.generates > self.args.die_after_generates:
            os._exit(1)  # a crash mid-request: the client sees the connection drop
        await self.resumed.wait()
        batched = isinstance(body["input_ids"][0], list)
        prompts = body["input_ids"] if batched else [body["input_ids"]]
        params = body.get("sampling_params", {})
        params = params if isinstance(params, list) else [params] * len(prompts)
        refused = self._refused(params)
        adapter = body.get("lora_path")
        if isinstance(adapter, list):  # one per prompt: the pool sends one prompt per request
            adapter = adapter[0]
        if adapter is not None and adapter not in self.adapters.loaded:
            refused = f"LoRA adapter {adapter} is not loaded"
        if refused:
            return web.json_response({"error": {"message": refused}}, status=400)  # SGLang's answer to a ValueError
        model = self.model if adapter is None else self.adapters.model(self.model, adapter)
        outputs = []
        async with self.lock:
            self.running += 1
            try:
                for prompt, p in zip(prompts, params):
                    n = int(p.get("n", 1))
                    # SGLang honours sampling_seed only under --enable-deterministic-inference (then 42 when unset)
                    seed = (
                        (p.get("sampling_seed") if p.get("sampling_seed") is not None else 42)
                        if self.args.enable_deterministic_inference
                        else None
                    )
                    seeds = [seed + k if seed is not None else int(torch.randint(0, 2**62, ())) for k in range(n)]
                    self._journal(
                        event="generate", version=self.weight_version, prompt=prompt, seeds=seeds, adapter=adapter
                    )
                    logprobs = bool(body.get("return_logprob"))
                    outputs += await asyncio.to_thread(self._sample, model, prompt, p, seeds, logprobs)
            finally:
                self.running -= 1
        return web.json_response(outputs if batched or len(outputs) > 1 else outputs[0])

    def _refused(self, params: list[dict]) -> str | None:
        """What SGLang refuses in these sampling parameters beyond their fields (``sglang_requests``): stop strings
        without a tokenizer (its ``normalize``)."""
        for p in params:
            if p.get("stop") and self.tokenizer is None:
                return (
                    f"stop={p['stop']!r} is unavailable when skip_tokenizer_init=True "
                    "(requires tokenizer to decode tokens to text for matching)."
                )
        return None

    def _sample(self, model, prompt: list[int], p: dict, seeds: list[int], return_logprob: bool) -> list[dict]:
        stops = list(p.get("stop_token_ids") or [])
        strings = p.get("stop") or []
        strings = [strings] if isinstance(strings, str) else list(strings)
        temperature, top_k = float(p.get("temperature", 1.0)), int(p.get("top_k", -1))
        if 0 <= temperature < 1e-6:  # SGLang's greedy: T = 1, the top token only
            temperature, top_k = 1.0, 1
        max_new_tokens = int(p.get("max_new_tokens", 128))
        if max_new_tokens == 0:  # SGLang allows it: nothing generated, finished by length
            meta = {
                "finish_reason": {"type": "length", "length": 0},
                "prompt_tokens": len(prompt),
                "completion_tokens": 0,
                "weight_version": self.weight_version,
                **({"output_token_logprobs": []} if return_logprob else {}),
            }
            return [{"output_ids": [], "meta_info": meta} for _ in seeds]
        sampling = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=float(p.get("top_p", 1.0)),
            top_k=max(0, top_k),
            stop_token_ids=tuple(stops[1:]),
            stop=tuple(strings),
        )
        eos = stops[0] if stops else model.config.eos_token_id
        request = GroupRequest(prompt_id=0, prompt_tokens=tuple(prompt), version=0, seeds=tuple(seeds))
        (sampled,) = list(sample_groups(model, [request], sampling, eos, eos, self.tokenizer))
        outputs = []
        for tokens, logprobs in zip(sampled.completions, sampled.logprobs):
            if self.original_logprob:
                logprobs = self._logprobs_before_temperature(model, prompt, tokens)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True) if strings else ""
            matched = next(
                (s for s in strings if s in text), tokens[-1]
            )  # a string the last token completed, or the token
            meta = {
                "finish_reason": {"type": "length", "length": max_new_tokens}
                if len(tokens) >= max_new_tokens
                else {"type": "stop", "matched": matched},
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "weight_version": self.weight_version,
            }
            if return_logprob:
                meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
            output = {"output_ids": tokens, "meta_info": meta}
            if self.args.malformed:
                output = {"output_ids": tokens}
            outputs.append(output)
        return outputs

    @torch.no_grad()
    def _logprobs_before_temperature(self, model, prompt: list[int], tokens: list[int]) -> list[float]:
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()

    # -- weights ---------------------------------------------------------------------------------------
    def _journal(self, **event) -> None:
        """One line of what the server did (``--journal``), for tests that count loads and requests."""
        if self.args.journal:
            with open(self.args.journal, "a") as journal:
                journal.write(json.dumps({"port": self.args.port, **event}) + "\n")

    def _load(self, named: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        self._journal(event="load", version=version, tensors=[[name, list(t.shape)] for name, t in named])
        parameters = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named:
                parameters[name].copy_(tensor)
        self.adapters.base_changed()
        if version is not None and not self.args.stale_version:
            self.weight_version = version

    async def update_from_disk(self, request: web.Request) -> web.Response:
        body = await request.json()
        from safetensors.torch import load_file

        # a sharded checkpoint: the shards its index names (SGLang's loader reads them the same way)
        with open(os.path.join(body["model_path"], "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        named = [item for shard in shards for item in load_file(os.path.join(body["model_path"], shard)).items()]
        self._load(named, body.get("weight_version"))
        return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})

    def _outside_session(self, what: str) -> web.Response | None:
        """SGLang's refusal of an update outside a weight-update session (none with --legacy-api)."""
        if self.args.legacy_api or self.in_session:
            return None
        message = f"{what} must run between begin_weight_update() and end_weight_update()"
        return web.json_response({"success": False, "message": message}, status=400)

    async def begin_update(self, request: web.Request) -> web.Response:
        if self.in_session:
            return web.json_response(
                {"success": False, "message": "a weight update session is already open"}, status=400
            )
        self.in_session = True
        return web.json_response({"success": True, "message": "ok"})

    async def end_update(self, request: web.Request) -> web.Response:
        if not self.in_session:
            return web.json_response({"success": False, "message": "no weight update session is open"}, status=400)
        self.in_session = False
        return web.json_response({"success": True, "message": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.args.model_path,
                "tp_size": self.args.tp_size,
                "enable_deterministic_inference": self.args.enable_deterministic_inference,
                "dtype": self.args.dtype,
                "enable_lora": self.args.enable_lora,
                "max_lora_rank": self.args.max_lora_rank,
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"model_path": self.args.model_path, "is_generation": True, "weight_version": self.weight_version}
        )

    async def update_from_tensor(self, request: web.Request) -> web.Response:
        refused = self._outside_session("update_weights_from_tensor")
        if refused is not None:
            return refused
        body = await request.json()
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:  # SGLang's rank r reads payloads[r]: a short list fails a rank
            message = f"serialized_named_tensors has {len(payloads)} payloads for tp_size {self.args.tp_size}"
            return web.json_response({"success": False, "message": message}, status=400)
        shares = [deserialize_named_tensors(payload) for payload in payloads]  # each rank unpickles its own
        for share in shares[1:]:
            if [n for n, _ in share] != [n for n, _ in shares[0]] or not all(
                torch.equal(a, b) for (_, a), (_, b) in zip(share, shares[0])
            ):
                return web.json_response(
                    {"success": False, "message": "tensor-parallel ranks got different weights"}, status=400
                )
        self._load(shares[0], body.get("weight_version"))
        return web.json_response({"success": True, "message": "ok"})

    async def init_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.group_name = body["group_name"]
        self.group = await asyncio.to_thread(
            init_weight_update_group,
            body["master_address"],
            body["master_port"],
            body["rank_offset"],
            body["world_size"],
            body["group_name"],
            "gloo",
        )
        return web.json_response({"success": True, "message": "ok"})

    async def destroy_group(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.group is None or body.get("group_name", "weight_update_group") != self.group_name:
            return web.json_response(
                {"success": False, "message": "The group to be destroyed does not exist."}, status=400
            )
        torch.distributed.destroy_process_group(self.group)
        self.group = None
        return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})

    async def update_from_distributed(self, request: web.Request) -> web.Response:
        refused = self._outside_session("update_weights_from_distributed")
        if refused is not None:
            return refused
        body = await request.json()
        if self.group is None or self.args.refuse_distributed_updates:
            return web.json_response({"success": False, "message": "no weight update group"}, status=400)

        def receive():
            named = []
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(tensor, src=0, group=self.group)
                named.append((name, tensor))
            return named

        self._load(await asyncio.to_thread(receive), body.get("weight_version"))
        return web.json_response({"success": True, "message": "ok"})

    # -- LoRA adapters (SGLang answers with LoRAUpdateOutput) -------------------------------------------
    def _lora_answer(self, refused: str | None) -> web.Response:
        loaded = {name: "__tensor__" for name in self.adapters.loaded}
        body = {"success": refused is None, "error_message": refused, "loaded_adapters": loaded}
        return web.json_response(body, status=400 if refused else 200)

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        refused = self.adapters.load(body)
        if refused is None:
            _, tensors = self.adapters.loaded[body["lora_name"]]
            shapes = [[n, list(t.shape)] for n, t in tensors.items()]
            self._journal(event="load_adapter", name=body["lora_name"], tensors=shapes)
        return self._lora_answer(refused)

    async def unload_adapter(self, request: web.Request) -> web.Response:
        return self._lora_answer(self.adapters.unload((await request.json())["lora_name"]))

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        if not self.args.stale_version:
            self.weight_version = body["new_version"]
        return web.json_response({"success": True, "message": "ok", "new_version": body["new_version"]})

    async def get_weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.weight_version})

    async def pause(self, request: web.Request) -> web.Response:
        self.resumed.clear()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.resumed.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.running:  # SGLang's scheduler flushes only when idle (requests held by a pause do not count)
            return web.Response(
                text=f"Cache not flushed because there are pending requests. #running-req: {self.running}\n", status=400
            )
        return web.Response(text="Cache flushed.\n")

    async def freeze_gc(self, request: web.Request) -> web.Response:
        return web.Response(text="Garbage collection frozen.\n")  # SGLang's processes gc.freeze(); nothing here

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


@web.middleware
async def refuse_what_sglang_refuses(request: web.Request, handler):
    """A control route's body that SGLang's request struct would not decode: HTTP 400, before the handler."""
    if request.method == "POST" and request.path != "/generate" and request.can_read_body:
        try:
            body = await request.json()  # aiohttp keeps the body: the handler reads it again
        except json.JSONDecodeError:
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        problem = body_problem(request.path, body)
        if problem:
            return web.json_response({"error": {"message": problem}}, status=400)
    return await handler(request)


def die_at(route: str, count: int):
    """A middleware that exits the process, unanswered, on the ``count``-th request to ``route``."""
    seen = 0

    @web.middleware
    async def middleware(request: web.Request, handler):
        nonlocal seen
        if request.path == route:
            seen += 1
            if seen == count:
                os._exit(1)  # the client sees the connection drop
        return await handler(request)

    return middleware


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES])
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=None)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-loaded-loras", type=int, default=None)
    parser.add_argument("--die-after-generates", type=int, default=None)
    parser.add_argument("--die-at-version", default=None, help="count only /generate calls at this weight version")
    parser.add_argument("--die-at", default=None, help="ROUTE:N, exit on the N-th request to ROUTE")
    parser.add_argument("--malformed", action="store_true")
    parser.add_argument("--stale-version", action="store_true")
    parser.add_argument("--exit-at-start", action="store_true")
    parser.add_argument("--refuse-distributed-updates", action="store_true")
    parser.add_argument("--journal", default=None, help="a file: one JSON line per weight load and per sample")
    parser.add_argument(
        "--legacy-api", action="store_true", help="an SGLang before weight-update sessions and /model_info's version"
    )
    args = parser.parse_args()  # an unknown flag exits with code 2, as SGLang's own parser makes it
    refused = check_lora_args(args)
    if refused:
        sys.exit(f"stand-in: {refused}")  # SGLang's ServerArgs check: the server does not start
    if args.exit_at_start:
        print("stand-in: exiting at start as asked", flush=True)
        sys.exit(3)
    server = StandIn(args)
    middlewares = [refuse_what_sglang_refuses]
    if args.die_at:
        route, count = args.die_at.rsplit(":", 1)
        middlewares.insert(0, die_at(route, int(count)))
    app = web.Application(client_max_size=1 << 30, middlewares=middlewares)
    app.router.add_get("/health", server.health)
    app.router.add_get("/health_generate", server.health)
    app.router.add_post("/generate", server.generate)
    if args.legacy_api:
        app.router.add_get("/get_weight_version", server.get_weight_version)
    else:
        app.router.add_get("/model_info", server.model_info)
        app.router.add_get("/server_info", server.server_info)
        app.router.add_post("/begin_weight_update", server.begin_update)
        app.router.add_post("/end_weight_update", server.end_update)
    app.router.add_post("/update_weights_from_disk", server.update_from_disk)
    app.router.add_post("/update_weights_from_tensor", server.update_from_tensor)
    app.router.add_post("/init_weights_update_group", server.init_group)
    app.router.add_post("/update_weights_from_distributed", server.update_from_distributed)
    app.router.add_post("/destroy_weights_update_group", server.destroy_group)
    app.router.add_post("/pause_generation", server.pause)
    app.router.add_post("/continue_generation", server.resume)
    app.router.add_post("/flush_cache", server.flush_cache)
    app.router.add_post("/freeze_gc", server.freeze_gc)
    app.router.add_post("/load_lora_adapter_from_tensors", server.load_adapter)
    app.router.add_post("/unload_lora_adapter", server.unload_adapter)
    app.router.add_post("/update_weight_version", server.update_weight_version)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
