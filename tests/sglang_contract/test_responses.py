"""The answers lit_parl's SGLang pool reads, against SGLang's own code (sglang 0.5.23, as pinned in
requirements.txt).

* SGLang's response schema of ``/generate`` and ``/model_info`` (``sglang.api.v1.api_types``, generated from
  the ``proto/sglang/api/v1`` schema both SGLang servers answer by): a response built and encoded with its
  classes goes through the pool's parser (``messages.parse_group``) to the intended completion, log-probs,
  finish reasons and version; the stand-in's answers recorded in the scripted run decode with it.
* SGLang's finish reasons (``managers/schedule_batch.py``: ``FINISH_MATCHED_TOKEN``, ``FINISH_MATCHED_STR``,
  ``FINISH_LENGTH``, ``FINISH_ABORT``, their ``to_json``) as the parser and the abort check read them.
* The log-prob entries as SGLang's tokenizer manager makes them (``TokenizerManager.detokenize_logprob_tokens``,
  called on its own).
* Where no class holds it, SGLang's installed source: the tokenizer manager puts ``weight_version`` and
  ``finish_reason`` into each answer's ``meta_info`` in a dict built inline (``_handle_batch_output``), and
  http_server.py's ``model_info`` reports ``weight_version``; those source texts are read.
"""

from __future__ import annotations

import inspect
import json

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

from sglang.api.v1.api_types import (  # noqa: E402
    FinishLength,
    FinishStop,
    GenerateMetaInfo,
    GenerateResponse,
    GetModelInfoResponse,
    LogprobEntry,
)
from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, FINISH_MATCHED_STR, FINISH_MATCHED_TOKEN  # noqa: E402
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402

from lit_parl.rollout.records import GroupRequest, SamplingParams  # noqa: E402
from lit_parl.rollout.sglang.messages import Ends, MalformedResponse, abort_reason, parse_group  # noqa: E402

EOS = 2
REQUEST = GroupRequest(prompt_id=3, prompt_tokens=(5, 6, 7), version=4, seeds=(11, 12))


def json_round_trip(value):
    return json.loads(json.dumps(value))


def sglang_answer(tokens: list[int], logprobs: list[float], finish, version: str = "4") -> dict:
    """One ``/generate`` answer as SGLang encodes it, from its own schema classes."""
    response = GenerateResponse(
        output_ids=tokens,
        meta_info=GenerateMetaInfo(
            id="rid",
            prompt_tokens=3,
            completion_tokens=len(tokens),
            finish_reason=finish,
            weight_version=version,
            output_token_logprobs=[LogprobEntry(logprob=lp, token_id=t) for t, lp in zip(tokens, logprobs)],
        ),
    )
    return json_round_trip(response.to_json_value())


def test_an_answer_in_sglangs_schema_parses_to_the_intended_group():
    ends = Ends.of(SamplingParams(max_new_tokens=3, stop_token_ids=(9,)), eos_id=EOS)
    answers = [
        sglang_answer([5, 9], [-0.5, -0.25], FinishStop(matched=9)),
        sglang_answer([7, 8, 10], [-1.0, -2.0, -3.0], FinishLength(length=3)),
    ]
    group = parse_group(REQUEST, answers, "http://sglang", ends)
    assert group.version == 4 and group.prompt_id == 3
    assert group.completions == [[5, 9], [7, 8, 10]]
    assert group.logprobs == [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    assert group.finish_reasons == ["stop", "length"]
    with pytest.raises(MalformedResponse, match="weight_version 'default'"):  # a server never synced
        parse_group(
            REQUEST, [sglang_answer([5, 9], [-0.5, -0.25], FinishStop(matched=9), version="default")] * 2, "u", ends
        )


def test_the_fields_the_parser_reads_are_in_sglangs_response_schema():
    assert {"output_ids", "meta_info"} <= set(GenerateResponse.__struct_fields__)
    assert {"finish_reason", "output_token_logprobs", "weight_version"} <= set(GenerateMetaInfo.__struct_fields__)
    # a log-prob entry is the positional array [logprob, token_id, text]: the parser reads [0] and [1]
    assert LogprobEntry(logprob=-0.5, token_id=7).to_json_value() == [-0.5, 7, None]
    assert GetModelInfoResponse.from_json_value({"weight_version": "4"}).weight_version == "4"
    assert "weight_version" in GetModelInfoResponse.__struct_fields__


def test_sglangs_finish_reasons_are_read_as_intended():
    strings = Ends.of(
        SamplingParams(max_new_tokens=4, stop=("ab",)), eos_id=EOS, decode=lambda tokens: "x" * len(tokens)
    )
    tokens = [5, 6, EOS]
    assert strings.finish_reason(json_round_trip(FINISH_MATCHED_TOKEN(matched=EOS).to_json()), tokens, "w") == "stop"
    assert strings.finish_reason(json_round_trip(FINISH_MATCHED_STR(matched="ab").to_json()), tokens, "w") == "stop"
    assert strings.finish_reason(json_round_trip(FINISH_LENGTH(length=4).to_json()), [5, 6, 7, 8], "w") == "length"
    assert strings.finish_reason(json_round_trip(FINISH_LENGTH(length=4).to_json()), [5, 6, 7, EOS], "w") == "stop"
    aborted = {"meta_info": {"finish_reason": json_round_trip(FINISH_ABORT(message="server draining").to_json())}}
    assert abort_reason(aborted) == "server draining"
    assert abort_reason({"meta_info": {"finish_reason": FINISH_LENGTH(length=4).to_json()}}) is None


def test_sglangs_tokenizer_manager_makes_log_prob_entries_the_parser_reads():
    entries = TokenizerManager.detokenize_logprob_tokens(None, [-0.5, -0.25], [5, EOS], False)  # no text: self unused
    answer = {
        "output_ids": [5, EOS],
        "meta_info": {
            "output_token_logprobs": json_round_trip(entries),
            "finish_reason": FINISH_MATCHED_TOKEN(matched=EOS).to_json(),
            "weight_version": "4",
        },
    }
    group = parse_group(REQUEST, [answer, answer], "u", Ends.of(SamplingParams(max_new_tokens=4), eos_id=EOS))
    assert group.completions == [[5, EOS]] * 2 and group.logprobs == [[-0.5, -0.25]] * 2


def test_sglang_puts_weight_version_and_finish_reason_into_meta_info_and_model_info():
    """Read in SGLang's installed source (the dicts are built inline: no class to check against)."""
    batch_output = inspect.getsource(TokenizerManager._handle_batch_output)
    assert '"weight_version": self.config_value("weight_version")' in batch_output
    assert '"finish_reason": recv_obj.finished_reasons[i]' in batch_output
    assert '"weight_version": _global_state.tokenizer_manager.config_value(' in inspect.getsource(
        http_server.model_info
    )


def test_the_standins_answers_decode_with_sglangs_response_schema(run):
    generated = [s for s in run.where("POST", "/generate") if s.answer is not None]
    assert len(generated) == len(run.where("POST", "/generate"))
    for sent in generated:
        response = GenerateResponse.from_json_value(sent.answer)
        meta = response.meta_info
        assert isinstance(meta.finish_reason, (FinishStop, FinishLength)), meta.finish_reason  # not an unknown shape
        assert isinstance(meta.weight_version, str)
        assert [entry.token_id for entry in meta.output_token_logprobs] == list(response.output_ids)
    for sent in run.where("GET", "/model_info"):
        assert isinstance(GetModelInfoResponse.from_json_value(sent.answer).weight_version, str)
