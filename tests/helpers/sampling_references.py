"""Plain references of what a sampler draws, shared by the tests of every backend: the filtered distribution at
T, the first prefix a stop string ends, stop strings that cut given samples, and greedy decoding token by token."""

from __future__ import annotations

import torch


def filtered_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Token -> probability in the distribution drawn from: the top_k likeliest tokens at T, then the
    shortest run of them (renormalised) whose mass reaches top_p, renormalised."""
    probs = (logits.double() / temperature).softmax(-1).tolist()
    ranked = sorted(range(len(probs)), key=lambda t: -probs[t])[:top_k]
    top_mass = sum(probs[t] for t in ranked)
    kept, mass = [], 0.0
    for token in ranked:
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token] / top_mass
    total = sum(probs[t] for t in kept)
    return {t: probs[t] / total for t in kept}


def first_stop(tokenizer, completion: list[int], stop: tuple[str, ...]) -> int | None:
    """The reference: the first prefix whose decoded text contains a stop string, decoded whole."""
    for t in range(len(completion)):
        if any(s in tokenizer.decode(completion[: t + 1], skip_special_tokens=True) for s in stop):
            return t
    return None


def stop_strings_for(tokenizer, samples: list[list[int]], limit: int) -> tuple[str, ...]:
    """Stop strings to cut ``samples`` (drawn without any): two that samples meet early, and one that a sample
    cut at the length ``limit`` first completes with its last token (the other backends' tests use it too)."""

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    early = tuple(dict.fromkeys(text(c[1:3]) for c in samples if len(text(c[1:3])) == 2))[:2]
    return next(
        (*early, text(c[-2:]))
        for c in samples
        if len(c) == limit and len(text(c[-2:])) == 2 and first_stop(tokenizer, c, (*early, text(c[-2:]))) == limit - 1
    )


def argmax_loop(model, prompt: tuple[int, ...], max_new_tokens: int, ends: set[int]) -> tuple[list[int], list[float]]:
    """The reference: a full forward pass per token, the argmax taken, its log-prob in log_softmax(logits)."""
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([[*prompt, *tokens]])).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(logits.log_softmax(-1)[token].item())
            if token in ends:
                break
    return tokens, logprobs


@torch.no_grad()
def completion_logprobs_reference(model, prompt, completion, temperature: float) -> list[float]:
    """Log-probs of ``completion`` after ``prompt``: one unpadded, uncached forward of the whole sequence."""
    ids = torch.tensor([list(prompt) + list(completion)])
    logits = model(input_ids=ids, use_cache=False).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt) - 1  # position len(prompt)-1 predicts completion[0]
    return [float(logp[start + j, token]) for j, token in enumerate(completion)]
