"""What goes to and comes back from SGLang's ``/generate``: one sample's request, a group's answers.

A group's G samples are G requests, each with its own ``sampling_seed`` (one request with ``n=G``
would give every sample the same seed), ``return_logprob`` for the sampled tokens' log-probs (of the
full softmax of logits / T, before top-k/top-p: the trainer's) and ``no_stop_trim`` so the stop token
stays in the completion. Stop strings go as SGLang's ``stop``: the server keeps the tokens through
the one that completed the string. Temperature 0 is SGLang's greedy (it samples at T = 1 with
``top_k=1``, so the log-probs are the plain softmax's, as ours).

The answers are checked against SGLang's documented response before anything of them reaches the
trainer: an answer that does not fit raises ``MalformedResponse`` naming the server. Finish reasons are
``{"type": "stop", "matched": <token id or stop string>}`` or ``{"type": "length", ...}``; SGLang
checks the length limit first, so a sample whose last allowed token ends it (an end token, a stop
string) says ``"length"``: that one is ``"stop"`` here, as in the other backends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams


class MalformedResponse(RuntimeError):
    """A server answered something that is not SGLang's documented response: not retried."""


@dataclass(frozen=True)
class Ends:
    """What may end a sample of a call: the finish reasons of its answers are checked against it.

    Args:
        token_ids: the end token and ``sampling.stop_token_ids``.
        strings: ``sampling.stop``.
        max_new_tokens: the length limit.
        decode: a completion's text (special tokens skipped); needed with ``strings``.
    """

    token_ids: frozenset[int]
    strings: tuple[str, ...]
    max_new_tokens: int
    decode: Callable[[list[int]], str] | None = None

    @classmethod
    def of(cls, sampling: SamplingParams, eos_id: int, decode: Callable[[list[int]], str] | None = None) -> Ends:
        if sampling.stop and decode is None:
            raise ValueError("Ends: stop strings need decode, to read completions cut at the length limit")
        return cls(frozenset({eos_id, *sampling.stop_token_ids}), sampling.stop, sampling.max_new_tokens, decode)

    def finish_reason(self, reason: dict, tokens: list[int], where: str) -> str:
        """``"stop"`` or ``"length"`` for SGLang's ``finish_reason`` of ``tokens``; raise if it does not fit them."""
        kind, matched = reason.get("type"), reason.get("matched")
        if kind == "stop":
            if isinstance(matched, bool) or not isinstance(matched, (str, int)):
                raise MalformedResponse(
                    f"{where}: a 'stop' finish_reason without the token or string it matched: {reason}"
                )
            if isinstance(matched, str) and matched not in self.strings:  # "NaN happened" is one
                raise MalformedResponse(
                    f"{where}: finished on the string {matched!r}, not one of sampling.stop {self.strings}"
                )
            if isinstance(matched, int) and matched != tokens[-1]:
                raise MalformedResponse(
                    f"{where}: finished on token {matched}, but the completion ends with {tokens[-1]}"
                )
            return "stop"
        if kind == "length":
            if len(tokens) != self.max_new_tokens:
                raise MalformedResponse(
                    f"{where}: finish_reason 'length' after {len(tokens)} tokens; the limit is {self.max_new_tokens}"
                )
            # SGLang checks the limit before the stop conditions: the last allowed token may have met one
            if tokens[-1] in self.token_ids or (self.strings and any(s in self.decode(tokens) for s in self.strings)):
                return "stop"
            return "length"
        raise MalformedResponse(f"{where}: unknown finish_reason {reason}")


def sample_payload(
    request: GroupRequest, index: int, sampling: SamplingParams, eos_id: int, adapter: str | None = None
) -> dict:
    """The ``/generate`` body for sample ``index`` of ``request``; ``adapter``: the LoRA adapter it runs with (by
    the name it was loaded under: SGLang's ``lora_path`` takes a loaded adapter's name)."""
    params = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,  # SGLang's "off" is -1
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": sorted({eos_id, *sampling.stop_token_ids}),
        "skip_special_tokens": False,
        "no_stop_trim": True,  # keep the stop token: the trainer scores and trains on it
        "sampling_seed": request.seeds[index],
        **({"stop": list(sampling.stop)} if sampling.stop else {}),  # needs a server with its tokenizer
    }
    body = {"input_ids": list(request.prompt_tokens), "sampling_params": params, "return_logprob": True}
    return body | ({"lora_path": adapter} if adapter is not None else {})


def abort_reason(answer) -> str | None:
    """Why the server aborted this sample (it may succeed elsewhere), or ``None`` if it did not."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return str(reason.get("message", reason))
    return None


def parse_group(request: GroupRequest, answers: list, url: str, ends: Ends) -> GroupCompletions:
    """One group's completions from its G answers, stamped with the weight version the server reports.

    A sample without ``meta_info.weight_version`` is refused: the trainer's on-policy check rests on the
    server's own word about the weights it used, never on the version the pool believes it set. The trainer
    refuses a group whose version is not the iteration's. ``ends`` checks each sample's finish reason
    (``Ends.finish_reason``).
    """
    G = request.group_size
    where = f"{url}/generate for prompt {request.prompt_id}"
    if not isinstance(answers, list) or len(answers) != G:
        got = f"a list of {len(answers)}" if isinstance(answers, list) else type(answers).__name__
        raise MalformedResponse(f"{where}: expected a list of {G} outputs, got {got}")
    completions, logprobs, reasons, versions = [], [], [], set()
    for k, output in enumerate(answers):
        meta = output.get("meta_info") if isinstance(output, dict) else None
        entries = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        if not isinstance(entries, list) or not entries or not isinstance(reason, dict):
            raise MalformedResponse(
                f"{where} sample {k}: meta_info lacks output_token_logprobs or finish_reason "
                f"(is return_logprob honoured?): {str(output)[:300]}"
            )
        try:
            tokens = [int(entry[1]) for entry in entries]  # entries are [logprob, token id, text]
            values = [float(entry[0]) for entry in entries]
        except (TypeError, ValueError, IndexError) as error:
            raise MalformedResponse(f"{where} sample {k}: bad output_token_logprobs entry") from error
        if "output_ids" in output and list(output["output_ids"]) != tokens:
            raise MalformedResponse(f"{where} sample {k}: output_ids disagree with the log-prob tokens")
        completions.append(tokens)
        logprobs.append(values)
        reasons.append(ends.finish_reason(reason, tokens, f"{where} sample {k}"))
        if "weight_version" not in meta:
            raise MalformedResponse(
                f"{where} sample {k}: meta_info has no weight_version, so nothing shows which weights generated it "
                "(SGLang reports it since its weight-update API; use such a release)"
            )
        versions.add(meta["weight_version"])
    if len(versions) != 1:
        raise MalformedResponse(
            f"{url}: the samples of prompt {request.prompt_id} report several weight versions {sorted(versions)}"
        )
    reported = versions.pop()
    try:
        version = int(reported)
    except (TypeError, ValueError):
        raise MalformedResponse(f"{url} reports weight_version {reported!r}, not one this pool set") from None
    return GroupCompletions(
        prompt_id=request.prompt_id,
        version=version,  # what the server says it generated with; the trainer checks it
        sample_indices=list(range(G)),
        completions=completions,
        logprobs=logprobs,
        finish_reasons=reasons,
    )
