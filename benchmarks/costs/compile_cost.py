"""Per-call overheads on the CPU: torch.compile (inductor), a static KV cache and a leaner decode loop, against eager.

Two measurements, each over variants run in interleaved rounds (A B C, C B A, A B C, ...), in one process:

- decode: the rollout of an iteration's prompts (32 copy-task prompts x G = 8, 6 new tokens by default), in chunks of
  ``prompts_per_request`` (8) prompts, each chunk one ``sample_groups`` call: what the ``hf`` pool's worker does;
- train: each micro-batch (64 completions, the ones the eager decode sampled, collated as the trainer does:
  ``packing=auto``) through ``completion_logprobs`` with entropy, a GRPO-shaped loss and its backward.

Decode variants:
  eager           lit_parl's ``sample_groups`` on the model (today's code)
  compile         ``sample_groups`` on ``torch.compile(model, backend="inductor", dynamic=True)`` (prefill and decode
                  compiled; the DynamicCache and the dropped rows are dynamic shapes)
  compile-autotune  the same with ``mode="max-autotune-no-cudagraphs"`` (inductor's CPU GEMM templates, autotuned)
  static          a copy of the loop with a transformers ``StaticCache``: the prefill as eager (DynamicCache, once per
                  prompt), its keys/values repeated G times into a static cache of every row; rows are never dropped
                  (a static cache has a fixed batch): a finished group is handed out at once, as in the original, and
                  its rows keep decoding, ignored. Eager model.
  static-compile  ``static`` with the decode step on ``torch.compile(model, dynamic=False)``: fixed shapes (rows,
                  one token, a full-length mask, a cache of the longest prompt of all chunks + max_new_tokens), the
                  prefill eager
  lean            a copy of ``sample_groups`` with fewer ops and round trips per step, the same arithmetic: Gumbel
                  transform once per noise block, the attention mask built once and each step's prefix passed as
                  the 4D mask transformers would build (or None where it would: no padded row), which it takes as
                  is (no per-step mask construction, no torch.cat; models with sliding-window layers get the 2D
                  prefix), ``==`` instead of ``isin`` for one stop token, one ``all()`` instead of a ``tolist()`` per
                  step, no ``/ T`` at T = 1
  lean-compile    ``lean`` on ``torch.compile(model, dynamic=True)``

Train variants:
  eager           ``lit_parl.kernels.forward.completion_logprobs`` as the trainer calls it
  compile         the same with the backbone (``model.get_decoder()``) compiled in place (``nn.Module.compile``,
                  inductor, dynamic=True); the LM head's chunked log-prob kernel stays eager. The shared-prompt
                  attention's boolean indexing breaks the graph unless ``--capture-dynamic-shapes``; its loop over
                  the layout's buckets is unrolled, so a micro-batch with another bucket count may recompile (the
                  timed rounds reuse one iteration's micro-batches; the first round's graph count shows it)
  compile-autotune  the backbone with ``mode="max-autotune-no-cudagraphs"``
  compile-full    ``torch.compile(completion_logprobs, dynamic=True)``: backbone, shared-prompt attention and the
                  LM-head kernel (an autograd.Function) in one compiled function

``mode="reduce-overhead"`` is not a variant: it means CUDA graphs, which inductor skips for CPU tensors (it then
compiles as the default mode). Each variant gets its own copy of the model (same weights).

Reported per variant: the first round's seconds (compile included: the compile cost, cold inductor cache unless
``--inductor-cache warm``), graphs compiled during the timed rounds (recompiles: should be 0), the median of the timed
rounds, their min-max, and the median of per-round ratios variant/eager with their min-max. Correctness: the
sampled tokens and finish reasons must be identical to eager's at the same seeds, log-probs are compared (the
largest |difference|), on the timed configuration and on a stress one (``--check-new-tokens`` tokens, top-k 20,
top-p 0.9, the 12 tokens eager sampled most as extra stop tokens, so that groups finish and are dropped at many
steps and the noise blocks refill). For training: the largest |difference| of the log-probs, entropies and
gradients against eager's.

    .venv/bin/python benchmarks/costs/compile_cost.py                           # the default job's model (minutes)
    .venv/bin/python benchmarks/costs/compile_cost.py --capture-dynamic-shapes  # the attention in one graph
    .venv/bin/python benchmarks/costs/compile_cost.py --repeats 30 --threads 1  # a pool worker's one thread
    .venv/bin/python benchmarks/costs/compile_cost.py \\
        --model-dir ~/.cache/lit_parl/gguf/SmolLM2-135M-Instruct.Q4_1-35aaab34dd99 --chat --repeats 10
    .venv/bin/python benchmarks/costs/compile_cost.py --decode-variants eager,lean --train-variants eager \\
        --prompts 8 --repeats 2                                                 # a quick smoke run
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache, StaticCache

from lit_parl.data.micro_batch import Trajectory, collate
from lit_parl.kernels.backends import resolve_backend
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.models import pretrained, tiny_qwen2
from lit_parl.prompts.prompt_format import PromptFormat
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sampling import (
    _FIRST_NOISE_BLOCK,
    _NOISE_BLOCK_ELEMENTS,
    SampledGroup,
    _cache_keyword,
    filter_logits,
    sample_groups,
)
from lit_parl.tasks import CopyTask

DECODE_VARIANTS = ("eager", "compile", "compile-autotune", "static", "static-compile", "lean", "lean-compile")
TRAIN_VARIANTS = ("eager", "compile", "compile-autotune", "compile-full")
AUTOTUNE = "max-autotune-no-cudagraphs"


# -- the decode loop with a static cache (rows kept; finished ones ignored) ------------------------------------------
def _noise(generators, step, noise, noise_step, block, max_new_tokens, vocab):
    """The original's CPU noise blocks: the same draws from each row's generator."""
    if noise is None or step - noise_step == noise.shape[1]:
        steps = min(block, max_new_tokens - step, max(1, _NOISE_BLOCK_ELEMENTS // vocab))
        noise = torch.stack([torch.rand((steps, vocab), generator=g) for g in generators])
        noise_step, block = step, 2 * block
    return noise, noise_step, block


def _prefill(model, requests, pad_id, device):
    """Left-padded prompts through ``model`` once, as in ``sample_groups``: (logits, attention, positions, cache)."""
    width = max(len(r.prompt_tokens) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(requests), width), dtype=torch.long, device=device)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_tokens) :] = torch.tensor(r.prompt_tokens, device=device)
        attention[i, width - len(r.prompt_tokens) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        logits_to_keep=1,
        **{_cache_keyword(model): cache, "use_cache": True},
    ).logits[:, -1]
    return logits, attention, positions, cache


def _check_supported(sampling: SamplingParams) -> None:
    if sampling.stop or sampling.greedy:
        raise ValueError("the benchmark's loop copies implement sampled decoding without stop strings only")


@torch.inference_mode()
def static_sample_groups(
    model, requests: list[GroupRequest], sampling: SamplingParams, eos_id: int, pad_id: int, prompt_width: int = 0
) -> Iterator[SampledGroup]:
    """``sample_groups`` with a ``StaticCache`` for the decode steps; no row is dropped. The cache holds
    ``max(prompt_width, this chunk's prompt width) + max_new_tokens`` positions: one ``prompt_width`` for every chunk
    keeps the compiled decode's shapes fixed.

    ``model`` may be ``torch.compile(...)``'d: the prefill runs on the eager module under it (``_orig_mod``)."""
    _check_supported(sampling)
    eager = getattr(model, "_orig_mod", model)
    keyword = _cache_keyword(eager)
    group_size = requests[0].group_size
    device = next(eager.parameters()).device
    stops = torch.tensor(sorted({eos_id, *sampling.stop_token_ids}), device=device)
    logits, attention, positions, prefill_cache = _prefill(eager, requests, pad_id, device)
    width = attention.shape[1]
    cache_len = max(prompt_width, width) + sampling.max_new_tokens
    rows = len(requests) * group_size
    cache = StaticCache(config=eager.config, max_cache_len=cache_len)
    for layer, source in zip(cache.layers, prefill_cache.layers, strict=True):
        keys, values = source.keys.repeat_interleave(group_size, 0), source.values.repeat_interleave(group_size, 0)
        layer.lazy_initialization(keys, values)
        layer.keys[:, :, :width].copy_(keys)
        layer.values[:, :, :width].copy_(values)
        layer.cumulative_length.fill_(width)
    del prefill_cache
    logits = logits.repeat_interleave(group_size, 0)
    # the whole cache's mask at once (fixed shape): the prompt's padding, then ones; causality hides the future
    mask = torch.ones((rows, cache_len), dtype=torch.long, device=device)
    mask[:, :width] = attention.repeat_interleave(group_size, 0)
    next_position = positions[:, -1:].repeat_interleave(group_size, 0) + 1

    generators = []
    for request in requests:
        for seed in request.seeds:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            generators.append(generator)
    vocab = logits.shape[-1]
    noise, noise_step, block = None, 0, _FIRST_NOISE_BLOCK
    handed_out = [False] * len(requests)
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    out_tokens = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)

    for step in range(sampling.max_new_tokens):
        scaled = logits.float() / sampling.temperature
        noise, noise_step, block = _noise(generators, step, noise, noise_step, block, sampling.max_new_tokens, vocab)
        uniform = noise[:, step - noise_step]
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        choice = (filter_logits(scaled, sampling.top_k, sampling.top_p) + gumbel).argmax(-1)
        token_logprobs = scaled.log_softmax(-1)
        out_tokens[:, step] = choice
        out_logprobs[:, step] = token_logprobs.gather(-1, choice[:, None])[:, 0]
        last = step == sampling.max_new_tokens - 1
        lengths += alive
        ends = alive & torch.isin(choice, stops)
        stopped |= ends
        if last:
            alive.zero_()
        else:
            alive &= ~ends
        running_groups = alive.view(-1, group_size).any(-1).tolist()
        finished = [k for k, running in enumerate(running_groups) if not running and not handed_out[k]]
        if finished:
            index = torch.tensor([k * group_size + s for k in finished for s in range(group_size)], device=device)
            for k, tokens, logprobs, n, ended in zip(
                finished,
                out_tokens[index].view(len(finished), group_size, -1).tolist(),
                out_logprobs[index].view(len(finished), group_size, -1).tolist(),
                lengths[index].view(len(finished), group_size).tolist(),
                stopped[index].view(len(finished), group_size).tolist(),
            ):
                handed_out[k] = True
                completions = [seq[:m] for seq, m in zip(tokens, n)]
                reasons = ["stop" if e else "length" for e in ended]
                yield SampledGroup(requests[k], completions, [lp[:m] for lp, m in zip(logprobs, n)], reasons)
        if last or all(handed_out):
            break
        logits = model(
            input_ids=choice[:, None],
            attention_mask=mask,
            position_ids=next_position,
            **{keyword: cache},
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1


# -- the decode loop with fewer ops per step (rows dropped as in the original) ----------------------------------------
@torch.inference_mode()
def lean_sample_groups(
    model, requests: list[GroupRequest], sampling: SamplingParams, eos_id: int, pad_id: int
) -> Iterator[SampledGroup]:
    """``sample_groups``'s arithmetic with fewer tensor ops and Python round trips per step (see the docstring)."""
    _check_supported(sampling)
    keyword = _cache_keyword(getattr(model, "_orig_mod", model))
    config = model.config
    group_size = requests[0].group_size
    device = next(model.parameters()).device
    stop_ids = sorted({eos_id, *sampling.stop_token_ids})
    stops = torch.tensor(stop_ids, device=device)
    logits, attention, positions, cache = _prefill(model, requests, pad_id, device)
    width = attention.shape[1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    rows = len(requests) * group_size
    # every step's 2D mask is a prefix of this one; transformers' 4D sdpa mask for one query token is that prefix
    # (causality hides nothing earlier), or None when no row is padded: built here once, not per step
    attention = torch.cat(
        [attention.repeat_interleave(group_size, 0), attention.new_ones((rows, sampling.max_new_tokens))], 1
    )
    full_attention_only = all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
    masks = attention.bool()[:, None, None, :]
    padded = not bool(attention[:, :width].all())
    next_position = positions[:, -1:].repeat_interleave(group_size, 0) + 1

    generators = []
    for request in requests:
        for seed in request.seeds:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            generators.append(generator)
    vocab = logits.shape[-1]
    gumbel_block, noise_step, block = None, 0, _FIRST_NOISE_BLOCK
    active = list(range(len(requests)))
    alive = torch.ones(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    out_tokens = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    unit_temperature = sampling.temperature == 1.0
    filtered = sampling.top_k > 0 or sampling.top_p < 1.0

    for step in range(sampling.max_new_tokens):
        scaled = logits if logits.dtype == torch.float32 else logits.float()
        if not unit_temperature:
            scaled = scaled / sampling.temperature
        if gumbel_block is None or step - noise_step == gumbel_block.shape[1]:
            steps = min(block, sampling.max_new_tokens - step, max(1, _NOISE_BLOCK_ELEMENTS // vocab))
            uniform = torch.stack([torch.rand((steps, vocab), generator=g) for g in generators])
            gumbel_block = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
            noise_step, block = step, 2 * block
        gumbel = gumbel_block[:, step - noise_step]
        choice = ((filter_logits(scaled, sampling.top_k, sampling.top_p) if filtered else scaled) + gumbel).argmax(-1)
        out_tokens[:, step] = choice
        out_logprobs[:, step] = scaled.log_softmax(-1).gather(-1, choice[:, None])[:, 0]
        last = step == sampling.max_new_tokens - 1
        lengths += alive
        ends = alive & ((choice == stop_ids[0]) if len(stop_ids) == 1 else torch.isin(choice, stops))
        stopped |= ends
        if last:
            alive.zero_()
        else:
            alive &= ~ends
        running = alive.view(-1, group_size).any(-1)
        finished = [] if not last and bool(running.all()) else [k for k, r in enumerate(running.tolist()) if not r]
        if finished:
            index = torch.tensor([k * group_size + s for k in finished for s in range(group_size)], device=device)
            for k, tokens, logprobs, n, ended in zip(
                finished,
                out_tokens[index].view(len(finished), group_size, -1).tolist(),
                out_logprobs[index].view(len(finished), group_size, -1).tolist(),
                lengths[index].view(len(finished), group_size).tolist(),
                stopped[index].view(len(finished), group_size).tolist(),
            ):
                completions = [seq[:m] for seq, m in zip(tokens, n)]
                reasons = ["stop" if e else "length" for e in ended]
                yield SampledGroup(requests[active[k]], completions, [lp[:m] for lp, m in zip(logprobs, n)], reasons)
        if last or len(finished) == len(active):
            break
        if finished:
            done = set(finished)
            keep_groups = [k for k in range(len(active)) if k not in done]
            active = [active[k] for k in keep_groups]
            keep_rows = [k * group_size + s for k in keep_groups for s in range(group_size)]
            keep = torch.tensor(keep_rows, device=device)
            cache.batch_select_indices(keep)
            generators = [generators[r] for r in keep_rows]
            choice, attention, masks, next_position = choice[keep], attention[keep], masks[keep], next_position[keep]
            alive, lengths, stopped = alive[keep], lengths[keep], stopped[keep]
            out_tokens, out_logprobs, gumbel_block = out_tokens[keep], out_logprobs[keep], gumbel_block[keep]
            padded = not bool(attention[:, :width].all())
        kv = width + step + 1
        if full_attention_only:
            step_mask = masks[..., :kv] if padded else None  # 4D: transformers returns it as is
        else:
            step_mask = attention[:, :kv]
        logits = model(
            input_ids=choice[:, None],
            attention_mask=step_mask,
            position_ids=next_position,
            **{keyword: cache},
            use_cache=True,
        ).logits[:, -1]
        next_position = next_position + 1


# -- setup ----------------------------------------------------------------------------------------------------------
def build_model(args):
    if args.model_dir:
        model, tokenizer = pretrained(os.path.expanduser(args.model_dir))
    else:  # conf/model/tiny_qwen2.yaml
        model, tokenizer = tiny_qwen2(
            hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512, seed=args.seed
        )
    return model, tokenizer


def build_requests(args, tokenizer) -> list[GroupRequest]:
    task = CopyTask(min_digits=2, max_digits=4, seed=args.seed)  # conf/data/copy.yaml
    prompt_format = PromptFormat(chat=True if args.chat else None)
    texts = [prompt_format.render(task.row(i), tokenizer) for i in range(args.prompts)]
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    return [
        GroupRequest(i, tuple(ids[i]), 0, tuple(sample_seed(args.seed, 0, i, s) for s in range(args.group_size)))
        for i in range(args.prompts)
    ]


def compiled(model, mode: str | None, dynamic: bool):
    return torch.compile(copy.deepcopy(model), backend="inductor", mode=mode, dynamic=dynamic)


def decode_runners(model, variants: list[str], eos_id: int, pad_id: int, width: int) -> dict[str, Callable]:
    """variant -> run(chunks, sampling) -> the groups of every chunk, in order."""

    def through(sampler, m, **kw):
        def run(chunks, sampling):
            return [g for chunk in chunks for g in sampler(m, chunk, sampling, eos_id, pad_id, **kw)]

        return run

    makers = {
        "eager": lambda: through(sample_groups, model),
        "compile": lambda: through(sample_groups, compiled(model, None, True)),
        "compile-autotune": lambda: through(sample_groups, compiled(model, AUTOTUNE, True)),
        "static": lambda: through(static_sample_groups, model, prompt_width=width),
        "static-compile": lambda: through(static_sample_groups, compiled(model, None, False), prompt_width=width),
        "lean": lambda: through(lean_sample_groups, model),
        "lean-compile": lambda: through(lean_sample_groups, compiled(model, None, True)),
    }
    return {v: makers[v]() for v in variants}


def train_runners(model, variants: list[str], chunk_size: int) -> dict[str, Callable]:
    """variant -> run(batches) -> [(log-probs, entropy)] per micro-batch, gradients left in its model's .grad."""

    def step(function, m, batches):
        out = []
        for batch in batches:
            logp, entropy = function(m, batch.tokens, 1.0, chunk_size, True)
            mask = batch.completion_mask
            loss = -(logp * batch.advantages[:, None] * mask).sum() - 1e-3 * (entropy * mask).sum()
            loss.backward()
            out.append((logp.detach(), entropy.detach()))
        return out

    def with_model(function, compile_mode=None, compile_backbone=False):
        m = copy.deepcopy(model).train()
        if compile_backbone:
            m.get_decoder().compile(backend="inductor", mode=compile_mode, dynamic=True)

        def run(batches):
            m.zero_grad(set_to_none=True)
            return step(function, m, batches)

        run.model = m
        return run

    makers = {
        "eager": lambda: with_model(completion_logprobs),
        "compile": lambda: with_model(completion_logprobs, None, True),
        "compile-autotune": lambda: with_model(completion_logprobs, AUTOTUNE, True),
        "compile-full": lambda: with_model(torch.compile(completion_logprobs, backend="inductor", dynamic=True)),
    }
    return {v: makers[v]() for v in variants}


def micro_batches(groups: list[SampledGroup], pad_id: int, size: int, group_size: int, packing: str, seed: int):
    generator = torch.Generator().manual_seed(seed)
    trajectories = []
    for g in groups:
        advantages = torch.randn(len(g.completions), generator=generator).tolist()
        for s, (tokens, logprobs) in enumerate(zip(g.completions, g.logprobs)):
            trajectories.append(
                Trajectory(
                    g.request.prompt_id,
                    s,
                    0,
                    list(g.request.prompt_tokens),
                    tokens,
                    logprobs,
                    0.0,
                    advantages[s],
                    g.finish_reasons[s] == "length",
                )
            )
    batches = [
        collate(trajectories[i : i + size], pad_id, packing=packing, group_size=group_size)
        for i in range(0, len(trajectories), size)
    ]
    backend = resolve_backend("auto", "cpu", torch.float32)  # what GRPOModule resolves at fit start on the CPU
    for batch in batches:
        if batch.tokens.attention is not None:
            batch.tokens.attention.backend = backend
    return batches


# -- comparison, timing, table --------------------------------------------------------------------------------------
def compare_groups(reference: list[SampledGroup], got: list[SampledGroup]) -> tuple[bool, int, float]:
    """(same tokens and finish reasons everywhere, samples that differ, largest |log-prob difference| elsewhere)."""
    ref = {g.request.prompt_id: g for g in reference}
    other = {g.request.prompt_id: g for g in got}
    if ref.keys() != other.keys():
        return False, -1, float("nan")
    differ, worst = 0, 0.0
    for pid, a in ref.items():
        b = other[pid]
        for ta, tb, la, lb, ra, rb in zip(
            a.completions, b.completions, a.logprobs, b.logprobs, a.finish_reasons, b.finish_reasons, strict=True
        ):
            if ta != tb or ra != rb:
                differ += 1
            else:
                worst = max([worst, *(abs(x - y) for x, y in zip(la, lb))])
    return differ == 0, differ, worst


def grad_vector(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def compile_counts() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def interleaved(runners: dict[str, Callable], argument, repeats: int) -> dict[str, list[float]]:
    names = list(runners)
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            start = time.perf_counter()
            runners[name](*argument)
            times[name].append(time.perf_counter() - start)
    return times


def table(
    title: str,
    times: dict[str, list[float]],
    first: dict[str, float],
    recompiles: dict[str, int],
    unit: float,
    unit_name: str,
    checks: dict[str, str],
) -> None:
    print(f"\n{title}")
    header = (
        f"| variant | first round s (compile incl.) | graphs compiled while timed | median {unit_name} "
        f"| min-max {unit_name} | ratio variant/eager (median per round) | ratio min-max | check vs eager |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    eager = times.get("eager")
    for name, values in times.items():
        median = statistics.median(values)
        if eager is not None:
            ratios = [v / e for v, e in zip(values, eager)]
            ratio = f"{statistics.median(ratios):.3f}"
            spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        else:
            ratio = spread = "-"
        print(
            f"| {name} | {first[name]:.2f} | {recompiles[name]} | {median * unit:.2f} | "
            f"{min(values) * unit:.2f}-{max(values) * unit:.2f} | {ratio} | {spread} | {checks.get(name, '-')} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="a saved model directory (default: the tiny_qwen2 default)")
    parser.add_argument("--chat", action="store_true", help="prompts through the tokenizer's chat template")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed interleaved rounds per measurement")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds after each variant's first")
    parser.add_argument(
        "--decode-variants",
        default="eager,compile,static,static-compile,lean,lean-compile",
        help=f"comma-separated, of {','.join(DECODE_VARIANTS)}; empty: skip the decode",
    )
    parser.add_argument(
        "--train-variants",
        default="eager,compile,compile-full",
        help=f"comma-separated, of {','.join(TRAIN_VARIANTS)}; empty: skip the training step",
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompts-per-request", type=int, default=8, help="prompts per sample_groups call")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--packing", default="auto", choices=("auto", "shared_prompt", "padded"))
    parser.add_argument("--logprob-chunk-size", type=int, default=1024)
    parser.add_argument("--check-new-tokens", type=int, default=24, help="max_new_tokens of the stress check (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile-threads", type=int, default=1, help="inductor's compile workers")
    parser.add_argument(
        "--capture-dynamic-shapes",
        action="store_true",
        help="dynamo traces data-dependent shapes (the shared-prompt attention's boolean indexing) "
        "instead of breaking the graph there",
    )
    parser.add_argument(
        "--inductor-cache",
        choices=("cold", "warm"),
        default="cold",
        help="cold: a fresh inductor cache directory (compile time as a first run pays it)",
    )
    args = parser.parse_args()
    decode_variants = [v for v in args.decode_variants.split(",") if v]
    train_variants = [v for v in args.train_variants.split(",") if v]
    for given, known in ((decode_variants, DECODE_VARIANTS), (train_variants, TRAIN_VARIANTS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {known}")
    cache_dir = None
    if args.inductor_cache == "cold":
        cache_dir = tempfile.mkdtemp(prefix="compile_cost_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = args.compile_threads
    torch._dynamo.config.recompile_limit = 64
    if args.capture_dynamic_shapes:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
        torch._dynamo.config.capture_scalar_outputs = True
    try:
        run(args, decode_variants, train_variants)
    finally:
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)


def run(args, decode_variants: list[str], train_variants: list[str]) -> None:
    model, tokenizer = build_model(args)
    model.eval()
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    requests = build_requests(args, tokenizer)
    size = args.prompts_per_request
    chunks = [requests[i : i + size] for i in range(0, len(requests), size)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens)
    width = max(len(r.prompt_tokens) for r in requests)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model={type(model).__name__} {n_params / 1e6:.2f}M params, threads={args.threads}, repeats={args.repeats}, "
        f"torch={torch.__version__}; {args.prompts} prompts x G {args.group_size} in chunks of {size}, "
        f"max_new_tokens={args.max_new_tokens}, prompt tokens <= {width}; micro-batch {args.micro_batch}, "
        f"packing={args.packing}; inductor cache {args.inductor_cache}"
    )

    # the eager rollout: the reference samples, and the training micro-batches
    reference = [g for chunk in chunks for g in sample_groups(model, chunk, sampling, eos_id, pad_id)]

    if decode_variants:
        check_tokens = max(args.check_new_tokens, args.max_new_tokens)
        runners, first, checks, failed = {}, {}, {}, {}
        for name, runner in decode_runners(model, decode_variants, eos_id, pad_id, width).items():
            graphs = compile_counts()
            try:
                start = time.perf_counter()
                groups = runner(chunks, sampling)
                first[name] = time.perf_counter() - start
                for _ in range(args.warmup):
                    runner(chunks, sampling)
            except Exception as error:  # report and go on with the others
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                continue
            same, differ, worst = compare_groups(reference, groups)
            checks[name] = f"tokens {'identical' if same else f'DIFFER in {differ} samples'}, max |dlogp| {worst:.2e}"
            runners[name] = runner
            print(
                f"  decode {name}: first round {first[name]:.2f} s, {compile_counts() - graphs} graphs; {checks[name]}",
                flush=True,
            )
        recompiles = collections.Counter()
        if runners:
            counted = {}  # each runner counting the graphs compiled during its timed rounds
            for name, runner in runners.items():

                def counting(chunks_, sampling_, runner=runner, name=name):
                    before = compile_counts()
                    out = runner(chunks_, sampling_)
                    recompiles[name] += compile_counts() - before
                    return out

                counted[name] = counting
            times = interleaved(counted, (chunks, sampling), args.repeats)
            table(
                f"decode: {args.prompts} prompts x G {args.group_size}, {args.max_new_tokens} new tokens, "
                f"chunks of {size} (ms per rollout)",
                times,
                first,
                recompiles,
                1e3,
                "ms",
                checks,
            )
        for name, error in failed.items():
            print(f"| {name} | FAILED: {error} |")
        if args.check_new_tokens and runners:
            counts = collections.Counter(t for g in reference for c in g.completions for t in c)
            extra = tuple(t for t, _ in counts.most_common(13) if t != eos_id)[:12]
            stress = SamplingParams(max_new_tokens=check_tokens, top_k=20, top_p=0.9, stop_token_ids=extra)
            stress_reference = runners["eager"](chunks, stress) if "eager" in runners else None
            if stress_reference is None:
                stress_reference = [g for chunk in chunks for g in sample_groups(model, chunk, stress, eos_id, pad_id)]
            lengths = collections.Counter(len(c) for g in stress_reference for c in g.completions)
            print(
                f"\nstress check: max_new_tokens={check_tokens}, top_k=20, top_p=0.9, stop tokens {list(extra)}; "
                f"completion lengths {dict(sorted(lengths.items()))}"
            )
            for name, runner in runners.items():
                if name == "eager":
                    continue
                try:
                    graphs = compile_counts()
                    same, differ, worst = compare_groups(stress_reference, runner(chunks, stress))
                    print(
                        f"  {name}: tokens {'identical' if same else f'DIFFER in {differ} samples'}, "
                        f"max |dlogp| {worst:.2e} ({compile_counts() - graphs} graphs compiled for it)"
                    )
                except Exception as error:
                    print(f"  {name}: FAILED: {type(error).__name__}: {str(error).splitlines()[0][:300]}")

    if train_variants:
        batches = micro_batches(reference, pad_id, args.micro_batch, args.group_size, args.packing, args.seed)
        layouts = ["shared_prompt" if b.tokens.attention is not None else "padded" for b in batches]
        print(
            f"\ntrain: {len(batches)} micro-batches of {args.micro_batch}, layouts {layouts}, "
            f"input tokens {[b.tokens.input_ids.numel() for b in batches]}"
        )
        runners, first, checks, failed = {}, {}, {}, {}
        eager_out = eager_grad = None
        for name, runner in train_runners(model, train_variants, args.logprob_chunk_size).items():
            graphs = compile_counts()
            try:
                start = time.perf_counter()
                out = runner(batches)
                first[name] = time.perf_counter() - start
                grad = grad_vector(runner.model)
                for _ in range(args.warmup):
                    runner(batches)
            except Exception as error:
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                continue
            if name == "eager":
                eager_out, eager_grad = out, grad
            if eager_out is not None:
                dlogp = max(float((a[0] - b[0]).abs().max()) for a, b in zip(out, eager_out))
                dent = max(float((a[1] - b[1]).abs().max()) for a, b in zip(out, eager_out))
                dgrad = float((grad - eager_grad).abs().max()) / float(eager_grad.abs().max())
                checks[name] = f"max |dlogp| {dlogp:.2e}, |dentropy| {dent:.2e}, |dgrad|/max|grad| {dgrad:.2e}"
            runners[name] = runner
            print(
                f"  train {name}: first round {first[name]:.2f} s, {compile_counts() - graphs} graphs; "
                f"{checks.get(name, '')}",
                flush=True,
            )
        if runners:
            recompiles = collections.Counter()
            counted = {}
            for name, runner in runners.items():

                def counting(batches_, runner=runner, name=name):
                    before = compile_counts()
                    runner(batches_)
                    recompiles[name] += compile_counts() - before

                counted[name] = counting
            times = interleaved(counted, (batches,), args.repeats)
            per_batch = {name: [t / len(batches) for t in values] for name, values in times.items()}
            table(
                f"train: forward + backward of one micro-batch of {args.micro_batch} (ms, mean over the "
                f"{len(batches)} micro-batches of a round)",
                per_batch,
                first,
                recompiles,
                1e3,
                "ms",
                checks,
            )
        for name, error in failed.items():
            print(f"| {name} | FAILED: {error} |")


if __name__ == "__main__":
    main()
