"""LoRA adapters alone (``pool.sync.lora=adapter``) cannot be served by SGLang 0.5.23 on the CPU: its LoRA layers pin
host memory (``sglang/srt/lora/layers.py:141``, every LoRA layer type and the adapter's weights at load too), which
torch refuses without an accelerator. A CPU server started with ``--enable-lora --lora-backend torch_native`` died
while starting, at that line. So the pool refuses, before launching anything, naming the route that works on the
CPU (``merged``: tested against a real server in ``test_real_fleet``)."""

from __future__ import annotations

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

from lit_parl.rollout.sglang import SGLangRolloutPool  # noqa: E402
from lit_parl.rollout.sglang.commands import launches_on_cpu  # noqa: E402
from sglang_contract.pool_run import free_port  # noqa: E402


def test_adapter_sync_on_a_cpu_launch_is_refused_in_one_line_naming_merged(spec):
    pool = SGLangRolloutPool(
        servers={"deterministic_inference": False}, launch={"port": free_port()}, sync={"lora": "adapter"}
    )
    assert launches_on_cpu(pool.launch)
    with pytest.raises(ValueError) as refused:
        pool.start(spec)
    message = str(refused.value)
    assert "pool.sync.lora=merged" in message and "sglang/srt/lora/layers.py" in message and "\n" not in message
    assert pool.launched_pids() == [], "a server was launched before the refusal"
