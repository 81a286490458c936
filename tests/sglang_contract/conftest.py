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


@pytest.fixture(scope="session")
def standin(spec):
    """A stand-in server started as the pool starts its own (``tp_size`` 1); its URL (the probes' modules share it)."""
    import subprocess
    import time
    import urllib.request

    from sglang_contract.pool_run import STANDIN, free_port

    port = free_port()
    process = subprocess.Popen(
        [*STANDIN, "--model-path", str(spec.model_dir), "--port", str(port), "--enable-deterministic-inference"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("the stand-in did not start") from None
            time.sleep(0.3)
    yield url
    process.kill()
    process.wait()


@pytest.fixture(scope="session")
def checkpoint(spec, tmp_path_factory) -> str:
    """A sharded checkpoint of the model, as the pool's disk sync writes one."""
    import json

    from transformers import AutoModelForCausalLM

    from lit_parl.rollout.weight_transfer import save_shard

    out = tmp_path_factory.mktemp("checkpoint")
    model = AutoModelForCausalLM.from_pretrained(spec.model_dir)
    shards = save_shard(list(model.named_parameters()), out, "model-00001.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return str(out)
