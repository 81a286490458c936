"""Every stand-in agreement probe (``test_standin_agreement.PROBES``) replayed against a real SGLang server, launched on
the CPU as ``pool=sglang`` launches one: the real server must answer each as the stand-in does (accepted, refused
with a 4xx, or failed with a 5xx). ``test_standin_agreement`` holds the stand-in to SGLang's HTTP front end with
its scheduler stubbed; here nothing is stubbed, so a check SGLang makes past its front end (in its tokenizer
manager, scheduler or model runner) that the stand-in lacks shows as a disagreement. The probes' setup and
clean-up requests (a session around a tensor update, a pause undone) run on the real server too.
"""

from __future__ import annotations

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

from lit_parl.rollout.sglang import SGLangRolloutPool  # noqa: E402
from sglang_contract.pool_run import free_port  # noqa: E402
from sglang_contract.test_standin_agreement import PROBES, outcome, prepared, send  # noqa: E402


@pytest.fixture(scope="module")
def real_server(spec):
    """A real SGLang server on the CPU, launched by the pool (not synced: it serves the model directory); its URL."""
    port = free_port()
    pool = SGLangRolloutPool(servers={"deterministic_inference": False}, launch={"port": port, "start_timeout_s": 600})
    pool.start(spec)
    yield f"http://127.0.0.1:{port}"
    pool.close()


@pytest.mark.parametrize("path, body, before, after, why", PROBES)
def test_the_real_server_answers_a_probe_as_the_standin_does(
    path, body, before, after, why, real_server, standin, checkpoint, spec
):
    body, keep = prepared(body, checkpoint, spec)
    real = send(real_server, path, body, before, after)
    got = send(standin, path, body, before, after)
    del keep
    assert outcome(got) == outcome(real), (
        f"the stand-in {outcome(got)} (HTTP {got}), the real SGLang server {outcome(real)} (HTTP {real}). {why}"
    )
