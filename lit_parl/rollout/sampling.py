"""Group sampling on a transformers model: each prompt prefilled once, its KV cache repeated G times.

Why not ``model.generate``: GRPO needs a distinct, reproducible seed per sample (two samples of a group
must never share one) and the sampler's log-probs. ``generate`` draws from one global generator for the
whole batch, so a sample would depend on which other requests shared its batch. Here each row owns a
``torch.Generator`` and samples by the Gumbel-max trick (argmax of filtered logits plus Gumbel noise,
exactly a draw from the filtered softmax), so a completion depends only on its seed and the weights.
Finished groups are handed out at once and their rows dropped from the batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from lit_parl.trajectory import GroupRequest, SamplingParams


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
) -> Iterator[SampledGroup]:
    """Yield each request's completions as soon as all of its samples have stopped."""
    if not requests:
        return
    group_size = requests[0].group_size
    if any(r.group_size != group_size for r in requests):
        raise ValueError("sample_groups needs one group size per call")
    device = next(model.parameters()).device
    stops = torch.tensor(sorted({eos_id, *sampling.stop_token_ids}), device=device)

    # prefill each prompt once (left-padded), then repeat its cache for the G samples
    width = max(len(r.prompt_ids) for r in requests)
    input_ids = torch.full((len(requests), width), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(requests), width), dtype=torch.long, device=device)
    for i, r in enumerate(requests):
        input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids, device=device)
        attention[i, width - len(r.prompt_ids) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    cache_kwargs = {_cache_keyword(model): cache, "use_cache": True}
    logits = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, logits_to_keep=1, **cache_kwargs).logits[:, -1]
    cache.batch_repeat_interleave(group_size)
    logits = logits.repeat_interleave(group_size, 0)
    attention = attention.repeat_interleave(group_size, 0)
    next_position = positions[:, -1:].repeat_interleave(group_size, 0) + 1

    rows = [(i, s) for i in range(len(requests)) for s in range(group_size)]  # (request, sample) of each batch row
    generators = []
    for i, s in rows:
        generator = torch.Generator(device=device)
        generator.manual_seed(requests[i].seeds[s])
        generators.append(generator)
    tokens = [[[] for _ in range(group_size)] for _ in requests]
    logprobs = [[[] for _ in range(group_size)] for _ in requests]
    stopped = [[False] * group_size for _ in requests]
    pending = [group_size] * len(requests)  # samples still running, per request

    for step in range(sampling.max_new_tokens):
        scaled = logits.float() / sampling.temperature
        token_logprobs = scaled.log_softmax(-1)
        uniform = torch.stack([torch.rand(scaled.shape[-1], generator=g, device=device) for g in generators])
        gumbel = -torch.log(-torch.log(uniform.clamp(min=1e-20, max=1.0 - 1e-7)))
        choice = (filter_logits(scaled, sampling.top_k, sampling.top_p) + gumbel).argmax(-1)
        chosen_logprob = token_logprobs.gather(-1, choice[:, None])[:, 0].tolist()
        is_stop = torch.isin(choice, stops).tolist()
        finished_requests = []
        for (i, s), token, lp, stop in zip(rows, choice.tolist(), chosen_logprob, is_stop):
            if stopped[i][s]:
                continue
            tokens[i][s].append(token)
            logprobs[i][s].append(lp)
            if stop or step == sampling.max_new_tokens - 1:
                stopped[i][s] = True
                pending[i] -= 1
                if pending[i] == 0:
                    finished_requests.append(i)
        for i in finished_requests:
            reasons = ["stop" if seq[-1] in stops.tolist() else "length" for seq in tokens[i]]
            yield SampledGroup(requests[i], tokens[i], logprobs[i], reasons)
        if step == sampling.max_new_tokens - 1 or all(p == 0 for p in pending):
            break
        if finished_requests:  # drop finished groups' rows from the batch and the cache
            keep = [row for row, (i, _) in enumerate(rows) if pending[i] > 0]
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            rows = [rows[k] for k in keep]
            generators = [generators[k] for k in keep]
            choice, attention, next_position = choice[index], attention[index], next_position[index]
        attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=1)
        logits = model(input_ids=choice[:, None], attention_mask=attention, position_ids=next_position, **cache_kwargs).logits[:, -1]
        next_position = next_position + 1
