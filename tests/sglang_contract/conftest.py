"""Fixtures of the SGLang contract tests. Nothing here imports sglang at import time: in the main environment
(``make test``, no sglang) the test modules skip themselves (``sglang_side.require_sglang``)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spec(tmp_path_factory):
    """The tiny policy saved as a model directory (what a pool is started with, and what servers load)."""
    from sglang_contract.pool_run import save_model_dir

    return save_model_dir(tmp_path_factory.mktemp("sglang_contract") / "model")


@pytest.fixture(scope="session")
def server_side(spec):
    """SGLang's HTTP front end in a process of its own (``sglang_side.ServerSide``)."""
    from sglang_contract.sglang_side import ServerSide

    side = ServerSide(spec.model_dir)
    yield side
    side.close()


@pytest.fixture(scope="session")
def run(spec, server_side):
    """The scripted pool run against the stand-in, every request with SGLang's verdict (``pool_run.run_pools``)."""
    from sglang_contract.pool_run import run_pools

    return run_pools(spec, server_side)
