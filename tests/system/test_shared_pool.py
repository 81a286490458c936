"""One SGLang pool for every rank: a 2-rank trainer (DDP, FSDP2) and the servers rank 0 launched (stand-ins).

Each run is ``tests/helpers/distributed_fit.py --sglang-port``: rank 0 launches two stand-in servers, rank 1
joins them, and both ranks send their own share of every iteration's requests to them. The stand-ins write
each weight load and each sample to a journal (``--journal``), which the tests read: one load per server per
iteration (one push, from one rank, of whole tensors named as in the model), and every sample of an iteration
drawn once across the ranks, with the seeds one process uses. SGD without clipping, as in test_strategies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers.multi_process import assert_same_policy, free_port
from helpers.sglang_pools import launch_standin, save_spec
from lit_parl.models import tiny_qwen2

pytestmark = pytest.mark.slow  # make test-slow: 2-process fits beside two stand-in servers

pytest.importorskip("aiohttp")

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "distributed_fit.py"
ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 2


def command(out: Path, strategy: str, *flags: str) -> list[str]:
    devices = ["--devices", "2"] if strategy != "single" else []
    port = free_port(2)
    return [
        *(sys.executable, str(SCRIPT), "--strategy", strategy, *devices, "--out", str(out)),
        *("--iterations", str(ITERATIONS), "--sglang-port", str(port), "--sglang-journal", str(out / "journal")),
        *("--sglang-master-port", str(free_port()), *flags),
    ]


def run(out: Path, strategy: str, *flags: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        command(out, strategy, *flags), cwd=ROOT, capture_output=True, text=True, timeout=420, start_new_session=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    events = [json.loads(line) for line in (out / "journal").read_text().splitlines()]
    return {
        "policy": torch.load(out / "policy.pt"),
        "ranks": [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))],
        "loads": [e for e in events if e["event"] == "load"],
        "draws": [(e["version"], tuple(e["prompt"]), tuple(e["seeds"])) for e in events if e["event"] == "generate"],
    }


def samples(result: dict) -> list[tuple]:
    return sorted(tuple(sample) for rank in result["ranks"] for sample in rank["samples"])


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("single"), "single")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp", "deepspeed3"])
def test_two_ranks_share_one_pool_and_train_the_single_process_update(tmp_path, single, strategy):
    two = run(tmp_path, strategy)
    assert_same_policy(two["policy"], single["policy"])
    assert samples(two) == samples(single), "the ranks together did not train the single run's samples"
    first, second = (set(map(tuple, rank["samples"])) for rank in two["ranks"])
    assert first and second and not first & second, "a sample was trained on both ranks, or one rank trained none"
    # one push per iteration, to each of the two servers: from one rank, whole tensors named as in the model
    shapes = {name: list(tensor.shape) for name, tensor in single["policy"].items()}
    loads = Counter((load["port"], load["version"]) for load in two["loads"])
    assert sorted(loads.values()) == [1] * (2 * ITERATIONS) and {v for _, v in loads} == {
        str(i) for i in range(ITERATIONS)
    }, loads
    for load in two["loads"]:
        assert {name: shape for name, shape in load["tensors"]} == shapes
    # every sample drawn once across the ranks, with the weights of its iteration and one process's seeds
    assert len(set(two["draws"])) == len(two["draws"]), "a sample was drawn twice"
    assert sorted(two["draws"]) == sorted(single["draws"])
    assert {version for version, *_ in two["draws"]} == {str(i) for i in range(ITERATIONS)}


def test_a_resume_inside_an_iteration_with_the_shared_pool_is_exact(tmp_path):
    """Step 3 is the first of iteration 1's two steps: the resumed fit's rank 0 launches the servers again and
    pushes θ_1 (the module's snapshot), and both ranks train the rest of iteration 1 from it."""
    straight = run(tmp_path / "straight", "ddp", "--save-every-step", str(tmp_path / "checkpoints"))
    resumed = run(tmp_path / "resumed", "ddp", "--resume", str(tmp_path / "checkpoints" / "step=3.ckpt"))
    assert_same_policy(resumed["policy"], straight["policy"], rtol=1e-6)
    assert [load["version"] for load in resumed["loads"]] == ["1", "1"], "θ_1 pushed once, to each server"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_ends_the_run_and_stops_the_servers(tmp_path, rank):
    """Rank ``rank`` is SIGKILLed when iteration 1 starts; the servers rank 0 launched must not outlive the run."""
    args = command(tmp_path, "ddp", "--die", str(rank))
    port = int(args[args.index("--sglang-port") + 1])
    # a SIGKILLed rank cannot remove its temporary directories: they go under the test's own, not /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode != 0 and not (tmp_path / "policy.pt").exists(), output[-3000:]
    deadline = time.monotonic() + 30
    while any(_listening(p) for p in (port, port + 1)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_listening(p) for p in (port, port + 1)), "a launched server outlived the run"


def test_servers_that_join_and_fail_between_iterations_lose_and_duplicate_nothing(tmp_path):
    """DDP, 6 iterations. Rank 0 launches two servers; a third, listed in the membership file from the start,
    dies while answering its third sample of iteration 4; a fourth (capacity 2) is added to the file during
    iteration 1 and joins at iteration 2's push. Both ranks must train exactly the undisturbed run's samples
    and end on its weights (SGD); the joiner draws nothing before it holds θ_2; every rank ends driving the
    same servers, the joiner among them and the dead one not."""
    # disk: a tensor sync's shared-memory files keep torch's shm manager (which holds the run's output pipe) alive
    # while an outside server that mapped them lives on
    iterations = ("--iterations", "6", "--sglang-sync", "disk")
    model_dir = tmp_path / "model"
    save_spec(*tiny_qwen2(seed=0), model_dir)  # what the outside servers start from; θ_k arrives at each push
    journal, listing = tmp_path / "elastic" / "journal", tmp_path / "servers.txt"
    journal.parent.mkdir()
    dying, dying_url = launch_standin(
        model_dir, "--journal", str(journal), "--die-at-version", "4", "--die-after-generates", "2"
    )
    joiner, joiner_url = launch_standin(model_dir, "--journal", str(journal))
    listing.write_text(f"{dying_url}\n")
    try:
        straight = run(tmp_path / "straight", "ddp", *iterations)
        membership = ("--sglang-membership", str(listing), "--sglang-join-at", "2", f"{joiner_url} 2")
        elastic = run(tmp_path / "elastic", "ddp", *iterations, *membership)
    finally:
        for process in (dying, joiner):
            process.kill()
            process.wait()
    assert dying.returncode == 1, "the dying server did not die (it must fail mid-iteration 4)"
    assert_same_policy(elastic["policy"], straight["policy"])
    assert samples(elastic) == samples(straight), "the elastic run did not train the undisturbed run's samples"
    first, second = (set(map(tuple, rank["samples"])) for rank in elastic["ranks"])
    assert not first & second, "a sample was trained on both ranks"
    assert set(elastic["draws"]) == set(straight["draws"]), "a sample was drawn that the undisturbed run did not draw"
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    joined, died = int(joiner_url.rsplit(":", 1)[1]), int(dying_url.rsplit(":", 1)[1])
    mine = [e for e in events if e["port"] == joined]
    assert [e["version"] for e in mine if e["event"] == "load"] == ["2", "3", "4", "5"]
    assert mine[0]["event"] == "load", "the joiner drew a sample before it held θ_2"
    assert {e["version"] for e in mine if e["event"] == "generate"} == {"2", "3", "4", "5"}
    assert [e["version"] for e in events if e["port"] == died and e["event"] == "load"] == ["0", "1", "2", "3", "4"]
    assert {rank["world"] for rank in elastic["ranks"]} == {2}
    urls = [rank["pool_urls"] for rank in elastic["ranks"]]
    assert urls[0] == urls[1] and joiner_url in urls[0] and dying_url not in urls[0], urls
