"""The ``hf`` sampler's semantics: which distribution the log-probs refer to, stop strings, greedy decoding.

The trainer computes log_softmax(logits / T) over the whole vocabulary; the truncated importance weights
and the on-policy check compare the rollout log-probs with exactly that. So the sampler must report the
full softmax at T, while it draws from the top-k/top-p filtered one. Checked against references written
here, not the sampler's own filter:

* the sampler's log-probs are the trainer's (the packed forward of ``lit_parl.kernels``) on the same tokens,
  and not the filtered distribution's;
* every drawn token is in the filtered set, and the draws follow the filtered distribution at T.

Stop strings end a sample at the token whose text completes one (kept, "stop"), as a reference that
decodes every prefix finds it; without stop strings the samples are the ones the sampler drew before
they existed. Greedy (T = 0) is an argmax loop over the model, with the log-probs of the plain softmax.

The vLLM and SGLang pools are held to the same in ``tests/vllm_backend`` and ``tests/rollout/test_sglang_backend.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.sampling_references import argmax_loop, filtered_distribution, first_stop
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import pack
from lit_parl.models import tiny_qwen2
from lit_parl.rollout.records import GroupRequest, SamplingParams
from lit_parl.rollout.sampling import sample_groups
from lit_parl.rollout.stop_strings import StopStrings

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
            version=0,
            seeds=tuple(1000 * i + s for s in range(group_size)),
        )
        for i, text in enumerate(texts)
    ]


def next_token_logits(model, prompt: tuple[int, ...], completion: list[int]) -> torch.Tensor:
    """Row t: the logits that chose completion[t]."""
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *completion]])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def test_logprobs_are_the_trainers_full_softmax_at_t_and_draws_stay_in_the_filtered_set(peaked):
    model, tokenizer = peaked
    sampling = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
    asked = requests(tokenizer, group_size=4)
    groups = {
        g.request.prompt_id: g
        for g in sample_groups(model, asked, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id)
    }

    full_gap, filtered_gap, cut = 0.0, 0.0, 0
    for request in asked:
        group = groups[request.prompt_id]
        packed = pack(
            [(list(request.prompt_tokens), group.completions)], pad_id=tokenizer.pad_token_id, shared_prompt=True
        )
        with torch.no_grad():
            trainer = completion_logprobs(model, packed, TEMPERATURE)
        for row, (completion, logprobs) in enumerate(zip(group.completions, group.logprobs)):
            reported = torch.tensor(logprobs, dtype=torch.float64)
            full_gap = max(full_gap, (reported - trainer[row, : len(completion)].double()).abs().max().item())
            for t, (token, logits) in enumerate(
                zip(completion, next_token_logits(model, request.prompt_tokens, completion))
            ):
                kept = filtered_distribution(logits, TEMPERATURE, TOP_K, TOP_P)
                assert token in kept, (
                    f"prompt {request.prompt_id} drew token {token} at step {t}, "
                    f"outside the filtered set {sorted(kept)}"
                )
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
    assert distance < 0.03, (
        f"total variation {distance:.3f} between the draws {frequency} and the filtered distribution {expected}"
    )


def test_a_negative_top_k_is_refused():
    with pytest.raises(ValueError, match=r"sampling.top_k must be >= 0 \(0: no top-k filter\), got -1"):
        SamplingParams(top_k=-1)


# ------------------------------------------------------------------------------------------------------
# stop strings
# ------------------------------------------------------------------------------------------------------
STOP_SAMPLING = SamplingParams(max_new_tokens=16, temperature=0.7, top_k=6, top_p=0.8, stop_token_ids=(13,))
# what the sampler drew for requests(tiny_qwen2(seed=0) tokenizer, 4) at STOP_SAMPLING before stop strings existed
BEFORE_STOP_STRINGS = {
    0: [
        [15, 15, 15, 49, 49, 18, 18, 18, 28, 49, 49, 49, 49, 18, 18, 52],
        [52, 9, 6, 15, 49, 49, 49, 52, 48, 48, 48, 48, 48, 29, 46, 29],
        [52, 52, 52, 52, 11, 11, 11, 26, 26, 32, 32, 32, 32, 11, 11, 11],
        [49, 18, 2, 18, 18, 2, 2, 2, 2, 2, 32, 13],
    ],
    1: [
        [52, 48, 48, 23, 23, 23, 13],
        [27, 19, 19, 19, 27, 28, 28, 27, 49, 49, 52, 48, 49, 49, 18, 49],
        [19, 27, 19, 19, 19, 50, 50, 50, 19, 27, 28, 20, 20, 40, 13],
        [45, 45, 39, 39, 39, 39, 45, 45, 45, 45, 43, 43, 19, 19, 30, 19],
    ],
    2: [
        [5, 5, 42, 45, 40, 40, 51, 51, 51, 43, 17, 17, 50, 50, 50, 50],
        [9, 9, 9, 28, 21, 21, 10, 43, 19, 19, 40, 40, 40, 13],
        [9, 9, 27, 17, 19, 17, 17, 17, 17, 42, 42, 17, 13],
        [40, 42, 42, 45, 45, 45, 31, 24, 19, 50, 19, 19, 50, 17, 17, 50],
    ],
}


def sampled(model, tokenizer, sampling: SamplingParams, seeds_offset: int = 0) -> dict[int, tuple]:
    asked = requests(tokenizer, group_size=4)
    if seeds_offset:
        asked = [
            GroupRequest(r.prompt_id, r.prompt_tokens, r.version, tuple(s + seeds_offset for s in r.seeds))
            for r in asked
        ]
    groups = sample_groups(model, asked, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer)
    return {g.request.prompt_id: (g.completions, g.logprobs, g.finish_reasons) for g in groups}


def test_without_stop_strings_the_samples_are_the_ones_drawn_before_they_existed():
    model, tokenizer = tiny_qwen2(seed=0)
    plain = sampled(model, tokenizer, STOP_SAMPLING)
    assert {i: completions for i, (completions, _, _) in plain.items()} == BEFORE_STOP_STRINGS
    # a stop string that never occurs decodes every token and changes nothing
    never = sampled(model, tokenizer, replace(STOP_SAMPLING, stop=("~never~",)))
    assert never == plain


def test_a_stop_string_ends_a_sample_at_the_token_that_completes_it():
    """Against a reference that decodes every prefix whole. Group 1 ends at step 3 while the others run on,
    so the matcher's rows follow the batch as it drops finished groups."""
    model, tokenizer = tiny_qwen2(seed=0)
    stop = ("??", "gg", "..", ";;")
    plain = sampled(model, tokenizer, STOP_SAMPLING)
    stopped = sampled(model, tokenizer, replace(STOP_SAMPLING, stop=stop))
    cut_at = []
    for prompt_id, (completions, logprobs, reasons) in plain.items():
        got_completions, got_logprobs, got_reasons = stopped[prompt_id]
        for k, completion in enumerate(completions):
            t = first_stop(tokenizer, completion, stop)
            if t is None:  # untouched: the same tokens, log-probs and reason
                assert (got_completions[k], got_reasons[k]) == (completion, reasons[k])
            else:
                assert got_completions[k] == completion[: t + 1], (
                    f"prompt {prompt_id} sample {k}: {tokenizer.decode(got_completions[k])!r}"
                )
                assert got_reasons[k] == "stop"
                cut_at.append((prompt_id, t))
            # the same draws; a batch that shrinks as groups stop computes in other shapes: float32 rounding apart
            torch.testing.assert_close(got_logprobs[k], logprobs[k][: len(got_completions[k])], rtol=0, atol=1e-6)
    assert max(t for p, t in cut_at if p == 1) == 3 and max(t for p, t in cut_at if p != 1) > 3, cut_at
    assert any(r == "length" for _, _, reasons in stopped.values() for r in reasons)


def test_stop_strings_need_the_tokenizer():
    model, tokenizer = tiny_qwen2(seed=0)
    with pytest.raises(
        ValueError, match=r"sampling.stop=\('\?\?',\) needs the tokenizer .* sample_groups\(tokenizer=...\)"
    ):
        list(
            sample_groups(
                model,
                requests(tokenizer, 2),
                SamplingParams(stop=("??",)),
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
            )
        )


def multi_char_tokenizer():
    """Tokens of one to three characters and a special token, so that a stop string can end inside a token,
    span several, or sit across a token that decodes to nothing."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = ["<pad>", "<eos>", "<unk>", "<sep>", "a", "b", "c", " ", "ab", "bc", "ca", "abc", "c a", "é"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<sep>"]})
    return tokenizer, len(vocab)


class DecodeOnly:
    """A tokenizer without a Rust backend: only ``decode`` (the matcher's fallback path)."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("fast", [True, False])
def test_the_matcher_finds_the_first_prefix_that_contains_a_stop_string(fast):
    """Random token sequences and stop strings: the row and step of every match are the reference's."""
    tokenizer, vocab = multi_char_tokenizer()
    generator = torch.Generator().manual_seed(0)
    alphabet = "abc é"
    found = 0
    for trial in range(60):
        rows, length = 5, 12
        sequences = torch.randint(3, vocab, (rows, length), generator=generator).tolist()
        stop = tuple(
            "".join(alphabet[i] for i in torch.randint(0, len(alphabet), (n,), generator=generator).tolist())
            for n in (2, 3, 4)
        )
        matcher = StopStrings(tokenizer if fast else DecodeOnly(tokenizer), stop, rows)
        expected = [first_stop(tokenizer, sequence, stop) for sequence in sequences]
        got: list[int | None] = [None] * rows
        running = list(range(rows))  # original row ids, in the matcher's current order
        for t in range(length):
            for position in matcher.update([sequences[r][t] for r in running], range(len(running))):
                got[running[position]] = t
            keep = [i for i, r in enumerate(running) if got[r] is None]
            matcher.select(keep)  # drop matched rows, as the sampler drops finished groups
            running = [running[i] for i in keep]
        assert got == expected, f"trial {trial}: stop {stop}, sequences {[tokenizer.decode(s) for s in sequences]}"
        found += sum(t is not None for t in got)
    assert found > 50, f"the trials should exercise many matches, got {found}"


# ------------------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------------------
def test_greedy_is_the_argmax_for_every_sample_whatever_the_seeds(peaked):
    model, tokenizer = peaked
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0, top_k=TOP_K, top_p=TOP_P, stop_token_ids=(15, 16))
    assert sampling.greedy
    groups = sampled(model, tokenizer, sampling)
    reseeded = sampled(model, tokenizer, sampling, seeds_offset=77)
    assert groups == reseeded, "greedy samples depend on the seeds"
    reasons = set()
    for request in requests(tokenizer, group_size=4):
        completions, logprobs, finish = groups[request.prompt_id]
        tokens, expected = argmax_loop(model, request.prompt_tokens, 10, {tokenizer.eos_token_id, 15, 16})
        assert completions == [tokens] * 4, f"prompt {request.prompt_id}: {completions} is not the argmax {tokens}"
        for row in logprobs:
            torch.testing.assert_close(torch.tensor(row), torch.tensor(expected), atol=1e-5, rtol=0)
        reasons.update(finish)
        assert finish == ["stop" if tokens[-1] in (tokenizer.eos_token_id, 15, 16) else "length"] * 4
    assert reasons == {"stop", "length"}, f"the prompts should end both ways, got {reasons}"


# ------------------------------------------------------------------------------------------------------
# through the hf pool: its workers load the tokenizer from the model directory
# ------------------------------------------------------------------------------------------------------
def test_the_hf_pool_matches_stop_strings_with_the_model_directorys_tokenizer(tmp_path):
    from lit_parl.rollout import HFRolloutPool, PoolSpec

    model, tokenizer = tiny_qwen2(seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "bare")  # no tokenizer files
    stop = ("??", "gg", "..", ";;")
    expected = sampled(model, tokenizer, replace(STOP_SAMPLING, stop=stop))
    for directory, fails in (("model", False), ("bare", True)):
        pool = HFRolloutPool(num_workers=1)
        try:
            pool.start(PoolSpec(tmp_path / directory, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
            pool.sync_weights([list(model.named_parameters())], version=0)
            asked = requests(tokenizer, group_size=4)
            if fails:
                with pytest.raises(
                    RuntimeError, match=r"sampling.stop=.* but the model directory .*bare' holds no tokenizer"
                ):
                    list(pool.generate(asked, replace(STOP_SAMPLING, stop=stop)))
                continue
            groups = {g.prompt_id: g for g in pool.generate(asked, replace(STOP_SAMPLING, stop=stop))}
            assert {i: (g.completions, g.finish_reasons) for i, g in groups.items()} == {
                i: (c, r) for i, (c, _, r) in expected.items()
            }
        finally:
            pool.close()
