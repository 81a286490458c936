"""An LLM judge on a real SGLang server that the run launches (``reward.judge.launch``) on the CPU: the probe finds
its model, its OpenAI-compatible chat route answers every sample (a verdict, or an answer the parser refuses, which
the scoring policy handles), repeats come from the cache, and closing the judge stops the server, leaving nothing."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sglang_contract.sglang_side import require_sglang

require_sglang()

from lit_parl.models import tiny_qwen2  # noqa: E402
from lit_parl.rewards import JudgeReward  # noqa: E402
from lit_parl.rewards.judge import JudgeParseError  # noqa: E402
from lit_parl.rewards.scoring_policy import event_loop  # noqa: E402
from lit_parl.rollout.sglang.servers import sglang_shm_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def test_a_judge_server_the_run_launches_answers_and_is_stopped(tmp_path):
    model, tokenizer = tiny_qwen2(vocabulary="ascii", seed=0)
    tokenizer.chat_template = TEMPLATE
    model.save_pretrained(tmp_path / "judge"), tokenizer.save_pretrained(tmp_path / "judge")
    config = OmegaConf.load(ROOT / "conf/reward/judge.yaml").judge  # built as the CLI builds reward=judge
    config.launch.model_path, config.launch.device = str(tmp_path / "judge"), "cpu"
    config.rubric, config.pattern, config.score_range, config.max_tokens = "Rate 0-9: {completion}", r"(\d)", [0, 9], 8
    sockets = set(_sockets_in_tmp())
    judge = instantiate(config)
    assert isinstance(judge, JudgeReward)
    (process,) = judge.launch.processes
    shm = sglang_shm_files([process.pid])
    assert judge.endpoint.model == str(tmp_path / "judge")  # what the server lists at /v1/models

    def verdict(reply: str):
        conversation = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": reply}]
        call = asyncio.run_coroutine_threadsafe(judge.judge("2+2=", conversation, "4"), event_loop())
        try:
            return call.result(300)
        except JudgeParseError as error:  # random weights answer what they answer; never a transport failure
            return error

    replies = ["4", "5", "four", "22"]
    first = [verdict(r) for r in replies]
    assert judge.endpoint.requests == 4
    for value in first:
        assert isinstance(value, JudgeParseError) or 0.0 <= value <= 1.0
    again = [verdict(r) for r in replies]
    refused = sum(isinstance(v, JudgeParseError) for v in first)
    assert judge.endpoint.requests == 4 + refused  # verdicts came from the cache; refused answers were asked again

    def outcome(value):
        return "refused" if isinstance(value, JudgeParseError) else value

    assert [outcome(v) for v in again] == [outcome(v) for v in first]  # greedy: the same answers

    judge.close()
    assert process.poll() is not None  # stopped with the judge
    assert not [p for p in shm if p.exists()]
    assert set(_sockets_in_tmp()) - sockets == set()  # SGLang's ZeroMQ sockets: in the judge's work dir, removed


def _sockets_in_tmp() -> list[Path]:
    """ZeroMQ's socket files where a server would put them without its own TMPDIR (the tests' temporary directory)."""
    return [p for p in Path(tempfile.gettempdir()).glob("tmp*") if p.is_socket()]


def test_a_judge_given_neither_a_url_nor_a_launch_is_refused():
    with pytest.raises(ValueError, match="the judge needs a server"):
        JudgeReward()
