"""Group sampling on a transformers model: each prompt prefilled once, its KV cache repeated G times.

Why not ``model.generate``: GRPO needs a distinct, reproducible seed per sample (two samples of a group
must never share one) and the sampler's log-probs. ``generate`` draws from one global generator for the
whole batch, so a sample would depend on which other requests shared its batch. Here each row owns a
``torch.Generator`` and samples by the Gumbel-max trick (argmax of filtered logits plus Gumbel noise,
exactly a draw from the filtered softmax), so a completion depends only on its seed and the weights.
Finished groups are handed out at once and their rows dropped from the batch.

Log-probs: each token's is that of the full softmax of logits / T, before the top-k/top-p filter, the
distribution the trainer differentiates (``lit_parl.kernels.forward.completion_logprobs``); the draw
comes from the filtered one. The ``vllm`` and ``sglang`` pools report the same.

Greedy (``temperature == 0``, for evaluation): each token is the argmax of the logits, so seeds play no
part and the G samples of a group are one; its log-prob is that of the plain softmax (T = 1).

Stop strings (``SamplingParams.stop``) need the tokenizer: a sample ends with ``"stop"`` at the token
that completes one in its decoded completion (``lit_parl.rollout.stop_strings``). Without stop strings
nothing is decoded.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.rollout.records import GroupRequest, SamplingParams
from lit_parl.rollout.stop_strings import StopStrings


@dataclass
class SampledGroup:
    request: GroupRequest
    completions: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the logits outside top-k and outside the smallest top-p nucleus."""
    if top_k > 0 and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


# Gumbel noise drawn ahead per row on CPU: first block of steps, doubled for each next block (a sample
# that stops early wastes at most about as many draws as it used), and at most this many floats per row
# and block (a vocabulary at least this large draws one step at a time, as on other devices)
_FIRST_NOISE_BLOCK = 8
_NOISE_BLOCK_ELEMENTS = 1 << 14


def _cache_keyword(model: PreTrainedModel) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.x); pass whichever this model takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def sample_groups(
    model: PreTrainedModel,
    requests: list[GroupRequest],
    sampling: SamplingParams,
    eos_id: int,
    pad_id: int,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Iterator[SampledGroup]:
    """Yield each request's completions as soon as all of its samples have stopped.

    Each token is drawn from the top-k/top-p filtered softmax of logits / T (T = 0: the argmax); its
    log-prob is that of the unfiltered softmax of logits / T (T = 0: of the logits). ``tokenizer``
    decodes completions for ``sampling.stop``; it is needed only then.
    """
    if sampling.stop and tokenizer is None:
        raise ValueError(
            f"sampling.stop={sampling.stop!r} needs the tokenizer to decode completions: "
            "pass sample_groups(tokenizer=...)"
        )
    if not requests:
        return
    group_size = requests[0].group_size
    if any(r.group_size != group_size for r in requests):
        raise ValueError("sample_groups needs one group size per call")
    device = next(model.parameters()).device
    stops = torch.tensor(sorted({eos_id, *sampling.stop_token_ids}), device=device)

    # prefill each prompt once (left-padded), then repeat its cache for the G samples
    width = max(len(r.prompt_tokens) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(requests), width), dtype=torch.long, device=device)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_tokens) :] = torch.tensor(r.prompt_tokens, device=device)
        attention[i, width - len(r.prompt_tokens) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_kwargs = {_cache_keyword(model): cache, "use_cache": True}
    logits = model(
        input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=1, **cache_kwargs
    ).logits[:, -1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    attention = attention.repeat_interleave(group_size, 0)
    next_position = positions[:, -1:].repeat_interleave(group_size, 0) + 1

    rows = len(requests) * group_size  # batch row r is sample r % group_size of request r // group_size
    generators = []  # greedy draws nothing: no generator
    for request in requests if not sampling.greedy else ():
        for seed in request.seeds:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            generators.append(generator)
    strings = StopStrings(tokenizer, sampling.stop, rows) if sampling.stop else None
    vocab = logits.shape[-1]
    # A CPU generator's stream is serial: one draw of (k, V) uniforms equals k draws of V in a row. So on
    # CPU each row draws the Gumbel noise of several steps at once, in blocks of 8, 16, 32... steps (at most
    # _NOISE_BLOCK_ELEMENTS floats): noise[:, k] is step noise_step + k. Other devices draw step by step.
    noise, noise_step, block = None, 0, _FIRST_NOISE_BLOCK
    active = list(range(len(requests)))  # requests still in the batch, in batch order
    alive = torch.ones(rows, dtype=torch.bool, device=device)  # sample still running
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    out_tokens = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.long, device=device)
    out_logprobs = torch.zeros((rows, sampling.max_new_tokens), dtype=torch.float32, device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)  # ended by a stop token or string

    for step in range(sampling.max_new_tokens):
        if sampling.greedy:
            scaled = logits.float()
            choice = scaled.argmax(-1)
        else:
            scaled = logits.float() / sampling.temperature
            if device.type == "cpu":
                if noise is None or step - noise_step == noise.shape[1]:
                    steps = min(block, sampling.max_new_tokens - step, max(1, _NOISE_BLOCK_ELEMENTS // vocab))
                    noise = torch.stack([torch.rand((steps, vocab), generator=g) for g in generators])
                    noise_step, block = step, 2 * block
                uniform = noise[:, step - noise_step]
            else:
                uniform = torch.stack([torch.rand(vocab, generator=g, device=device) for g in generators])
            gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
            choice = (filter_logits(scaled, sampling.top_k, sampling.top_p) + gumbel).argmax(-1)
        token_logprobs = scaled.log_softmax(-1)
        out_tokens[:, step] = choice
        out_logprobs[:, step] = token_logprobs.gather(-1, choice[:, None])[:, 0]
        last = step == sampling.max_new_tokens - 1
        # a running sample takes this token; it stops on a stop token or string, or at the length limit
        lengths += alive
        ends = alive & torch.isin(choice, stops)
        if strings is not None:  # every running sample's completion is step + 1 tokens long now
            running = alive.nonzero()[:, 0].tolist()
            matched = strings.update(choice[running].tolist(), running)
            if matched:
                ends[torch.tensor(matched, device=device)] = True
        stopped |= ends
        if last:
            alive.zero_()
        else:
            alive &= ~ends
        running_groups = alive.view(-1, group_size).any(-1).tolist()
        finished = [k for k, running in enumerate(running_groups) if not running]  # positions in `active`
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
        if finished:  # drop finished groups' rows from the batch and the cache
            done = set(finished)
            keep_groups = [k for k in range(len(active)) if k not in done]
            active = [active[k] for k in keep_groups]
            keep_rows = [k * group_size + s for k in keep_groups for s in range(group_size)]
            keep = torch.tensor(keep_rows, device=device)
            cache.batch_select_indices(keep)
            generators = [generators[r] for r in keep_rows] if generators else generators
            if strings is not None:
                strings.select(keep_rows)
            choice, attention, next_position = choice[keep], attention[keep], next_position[keep]
            alive, lengths, stopped = alive[keep], lengths[keep], stopped[keep]
            out_tokens, out_logprobs = out_tokens[keep], out_logprobs[keep]
            if noise is not None:
                noise = noise[keep]
        attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
        logits = model(
            input_ids=choice[:, None], attention_mask=attention, position_ids=next_position, **cache_kwargs
        ).logits[:, -1]
        next_position = next_position + 1
