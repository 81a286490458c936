"""Which distribution the rollout log-probs refer to under temperature, top-k and top-p (the ``hf`` sampler).

The trainer computes log_softmax(logits / T) over the whole vocabulary; the truncated importance weights
and the on-policy check compare the rollout log-probs with exactly that. So the sampler must report the
full softmax at T, while it draws from the top-k/top-p filtered one. Checked against references written
here, not the sampler's own filter:

* the sampler's log-probs are the trainer's (the packed forward of ``lit_parl.kernels``) on the same tokens,
  and not the filtered distribution's;
* every drawn token is in the filtered set, and the draws follow the filtered distribution at T.

The vLLM and SGLang pools are held to the same in ``tests/vllm_backend`` and ``tests/test_sglang_backend.py``.
"""

from __future__ import annotations

import pytest
import torch

from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import pack
from lit_parl.model import tiny_qwen2
from lit_parl.rollout.sampling import sample_groups
from lit_parl.trajectory import GroupRequest, SamplingParams

TEMPERATURE, TOP_K, TOP_P = 0.7, 6, 0.8


@pytest.fixture(scope="module")
def peaked():
    """The tiny model with logits 3 times larger: a random init is near uniform, where neither the
    temperature nor a top-p cut would show."""
    model, tokenizer = tiny_qwen2(seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)  # the final norm scales the logits linearly
    return model.eval(), tokenizer


def requests(tokenizer, group_size: int, prompts: int = 3) -> list[GroupRequest]:
    texts = ["copy: abc", "copy: hello", "copy: xyz12"][:prompts]
    return [
        GroupRequest(
            prompt_id=i,
            prompt_tokens=tuple(tokenizer(text, add_special_tokens=False).input_ids),
            answer_tokens=(),
            version=0,
            seeds=tuple(1000 * i + s for s in range(group_size)),
        )
        for i, text in enumerate(texts)
    ]


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


def next_token_logits(model, prompt: tuple[int, ...], completion: list[int]) -> torch.Tensor:
    """Row t: the logits that chose completion[t]."""
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *completion]])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def test_logprobs_are_the_trainers_full_softmax_at_t_and_draws_stay_in_the_filtered_set(peaked):
    model, tokenizer = peaked
    sampling = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    asked = requests(tokenizer, group_size=4)
    groups = {g.request.prompt_id: g for g in sample_groups(model, asked, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)}

    full_gap, filtered_gap, cut = 0.0, 0.0, 0
    for request in asked:
        group = groups[request.prompt_id]
        packed = pack([(list(request.prompt_tokens), group.completions)], pad_id=tokenizer.pad_token_id, shared_prompt=True)
        with torch.no_grad():
            trainer = completion_logprobs(model, packed, TEMPERATURE)
        for row, (completion, logprobs) in enumerate(zip(group.completions, group.logprobs)):
            reported = torch.tensor(logprobs, dtype=torch.float64)
            full_gap = max(full_gap, (reported - trainer[row, : len(completion)].double()).abs().max().item())
            for t, (token, logits) in enumerate(zip(completion, next_token_logits(model, request.prompt_tokens, completion))):
                kept = filtered_distribution(logits, TEMPERATURE, TOP_K, TOP_P)
                assert token in kept, f"prompt {request.prompt_id} drew token {token} at step {t}, outside the filtered set {sorted(kept)}"
                filtered_gap = max(filtered_gap, abs(reported[t].item() - torch.tensor(kept[token]).log().item()))
                cut += len(kept) < TOP_K
    assert full_gap < 1e-5, f"the sampler's log-probs are not the trainer's full softmax at T (max gap {full_gap:.2e})"
    assert cut, "top-p should have cut some steps below top_k tokens on this model"
    assert filtered_gap > 0.05, "the filtered distribution's log-probs should differ from the full softmax's here"


def test_draws_follow_the_filtered_distribution_at_t(peaked):
    """4,000 one-token samples of one prompt: their frequencies are the filtered distribution at T."""
    model, tokenizer = peaked
    sampling = SamplingParams(max_new_tokens=1, temperature=TEMPERATURE, top_k=TOP_K, top_p=0.95)
    (request,) = requests(tokenizer, group_size=4000, prompts=1)
    (group,) = list(sample_groups(model, [request], sampling, tokenizer.eos_token_id, tokenizer.pad_token_id))
    expected = filtered_distribution(next_token_logits(model, request.prompt_tokens, [0])[0], TEMPERATURE, TOP_K, 0.95)
    assert len(expected) >= 3, f"the test needs a spread distribution, got {expected}"
    drawn = torch.tensor([c[0] for c in group.completions])
    frequency = {t: (drawn == t).double().mean().item() for t in set(drawn.tolist()) | set(expected)}
    distance = 0.5 * sum(abs(frequency[t] - expected.get(t, 0.0)) for t in frequency)
    assert distance < 0.03, f"total variation {distance:.3f} between the draws {frequency} and the filtered distribution {expected}"


def test_a_negative_top_k_is_refused():
    with pytest.raises(ValueError, match=r"sampling.top_k must be >= 0 \(0: no top-k filter\), got -1"):
        SamplingParams(top_k=-1)
