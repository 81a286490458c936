"""A fit whose SGLang server dies at a weight push goes on without it, on one rank and on two (DDP).

Each run is ``tests/helpers/distributed_fit.py --sglang-port``: two stand-in servers launched by rank 0 and a third,
started here and listed in the membership file, that dies on receiving its third ``/pause_generation`` (the push of
version 2). The run must end with every sample trained once, with a warning naming the dead server, and every rank
driving the same servers without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.multi_process import free_port
from helpers.sglang_pools import launch_standin, save_spec
from lit_parl.models import tiny_qwen2

pytestmark = pytest.mark.slow  # make test-slow: fits beside three stand-in servers

pytest.importorskip("aiohttp")

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "distributed_fit.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_a_server_that_dies_at_a_push_leaves_it_and_the_fit_goes_on(tmp_path, strategy):
    model_dir, listing = tmp_path / "model", tmp_path / "servers.txt"
    save_spec(*tiny_qwen2(seed=0), model_dir)
    dying, dying_url = launch_standin(model_dir, "--die-at", "/pause_generation:3")
    listing.write_text(f"{dying_url}\n")
    devices = ["--devices", "2"] if strategy != "single" else []
    command = [
        *(sys.executable, str(SCRIPT), "--strategy", strategy, *devices, "--out", str(tmp_path), "--iterations", "4"),
        *("--sglang-port", str(free_port(2)), "--sglang-sync", "disk", "--sglang-membership", str(listing)),
        *("--sglang-journal", str(tmp_path / "journal")),
    ]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=420, start_new_session=True)
    finally:
        dying.kill()
        dying.wait()
    assert result.returncode == 0, result.stderr[-4000:]
    assert dying.returncode == 1, "the dying server did not die at the push of version 2"
    assert f"SGLang server {dying_url} failed during the weight push" in result.stderr
    ranks = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("rank*.json"))]
    samples = [tuple(sample) for rank in ranks for sample in rank["samples"]]
    assert len(samples) == len(set(samples)) > 0, "a sample was trained twice"
    urls = [rank["pool_urls"] for rank in ranks]
    assert all(u == urls[0] and dying_url not in u and len(u) == 2 for u in urls), urls
