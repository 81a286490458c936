"""A real SGLang server attached by two pools in turn, synced by ``tensor`` on the CPU: each pool's pickles name a
``torch_shm_manager`` of its own (``lit_parl/rollout/shm_manager.py``), which SGLang's scheduler connects to and
keeps in libshm's cache. Once the first pool has closed, its manager is gone and the server still holds a socket
to it: the second pool's updates name a new manager, and the server takes them, reports the version and samples
from those weights at the float32 on-policy bound. Nothing the pools started is left running.
"""

from __future__ import annotations

import pytest

from sglang_contract.sglang_side import require_sglang

require_sglang()

from helpers.real_sglang_servers import start_servers, stop_servers  # noqa: E402
from helpers.sglang_pools import alive  # noqa: E402
from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE  # noqa: E402
from lit_parl.rollout.sglang import SGLangRolloutPool  # noqa: E402
from sglang_contract.pool_run import SAMPLINGS, free_port, group_requests  # noqa: E402
from sglang_contract.test_real_server import policy, sync, worst_mismatch  # noqa: E402


@pytest.fixture(scope="module")
def server(spec, tmp_path_factory):
    (started,) = start_servers(spec.model_dir, [free_port()], tmp_path_factory.mktemp("shm_logs"))
    yield started
    stop_servers([started])


def test_a_server_syncs_from_a_second_pool_after_the_first_pools_manager_is_gone(server, spec):
    managers = []
    for version in (1, 2):
        pool = SGLangRolloutPool(servers={"urls": [server.url], "deterministic_inference": False})
        try:
            pool.start(spec)
            sync(pool, "tensor", version)
            managers.append(pool._weights.shm.pid)
            requests = group_requests(version, prompts=2)
            sampling = SAMPLINGS["sampled"]
            groups = list(pool.generate(requests, sampling))
            assert all(g.version == version for g in groups)
            assert worst_mismatch(groups, requests, policy(version), sampling.temperature) <= FP32_LOGPROB_TOLERANCE
        finally:
            pool.close()
        assert server.process.poll() is None, server.log.read_text()[-3000:]
    assert None not in managers and managers[0] != managers[1], "each pool's updates name its own manager"
    assert not any(alive(pid) for pid in managers), "a pool's manager outlived the pool"
