"""Nothing of a tensor sync outlives the run: the ``torch_shm_manager`` that CPU tensors' pickles name.

A server that unpickles a shared-memory tensor stays connected to the manager its pickle names while it lives.
These tests hold the pool's answer (``lit_parl/rollout/shm_manager.py``): the pickles name a manager of the
pool's own, stopped when the pool closes and killed with the trainer, so an attached server keeps nothing of the
run alive, and a later pool in the same process, or a later run, syncs to the same server.

The stand-in server (``tests/helpers/sglang_standin.py``) unpickles the payloads in its own process as SGLang's
scheduler does, so it connects to the manager named as a real server would. A run's processes are found by a
variable in their environment (``RUN_TAG``), which every process it starts inherits (torch's managers included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from helpers.sglang_pools import SAMPLING, alive, attached, buckets, launch_standin, requests_for

pytest.importorskip("aiohttp")

ROOT = Path(__file__).resolve().parents[2]
RUN_TAG = "LIT_PARL_TEST_RUN"


def tagged(tag: str) -> list[str]:
    """``pid command`` of each live process whose environment holds ``RUN_TAG=tag``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{RUN_TAG}={tag}".encode() in environ.split(b"\0") and alive(int(pid)):
            found.append(f"{pid} {command}")
    return found


def assert_none_left(tag: str, patience_s: float = 30.0) -> None:
    """No process of the run is left once ``patience_s`` has passed (libtorch's own manager exits 2 s after its
    last client); what is left is killed (the test started it) and named in the failure."""
    deadline = time.monotonic() + patience_s
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = tagged(tag)
    for line in left:
        os.kill(int(line.split()[0]), signal.SIGKILL)
    assert not left, f"processes of the run outlived it: {left}"


def test_a_fit_with_attached_servers_leaves_nothing_running_and_no_pipe_held(tmp_path, saved_model):
    """``lit-parl pool=sglang pool.servers.urls=[...]`` synced by tensor (the default): once the run has exited,
    its output pipes close and none of its processes is left, while the attached server lives on."""
    _, _, model_dir = saved_model
    server, url = launch_standin(model_dir, deterministic=False)
    tag = uuid.uuid4().hex
    overrides = [
        *("pool=sglang", f"pool.servers.urls=[{url}]", "pool.servers.deterministic_inference=false"),
        *("iterations=2", f"run_dir={tmp_path / 'run'}", "checkpoint_every=0", "callbacks.progress.refresh_rate=0"),
        *("model.hidden_size=64", "model.intermediate_size=256", "shape.prompts=8", "shape.micro_batch_size=16"),
    ]
    try:
        run = subprocess.Popen(
            [sys.executable, "-m", "lit_parl", *overrides],
            cwd=ROOT,
            env={**os.environ, RUN_TAG: tag},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        output: dict[str, bytes] = {}

        def read(name: str, pipe) -> None:  # to the end of the pipe: until every process holding it has closed it
            output[name] = pipe.read()

        readers = [
            threading.Thread(target=read, args=p, daemon=True) for p in (("out", run.stdout), ("err", run.stderr))
        ]
        for reader in readers:
            reader.start()
        try:
            code = run.wait(timeout=400)
        except subprocess.TimeoutExpired:
            run.kill()
            raise
        deadline = time.monotonic() + 30
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        held = tagged(tag) if any(r.is_alive() for r in readers) else []
        assert_none_left(tag)
        assert code == 0, output.get("err", b"")[-3000:].decode(errors="replace")
        assert not held, f"the run's output pipes were still open after it exited, held by {held}"
        assert server.poll() is None, "the attached server died"
    finally:
        server.kill()
        server.wait()


def test_a_second_pool_in_the_process_syncs_to_a_server_the_first_left(saved_model):
    """A pool's tensor updates name its own manager, which the server connects to; closing the pool stops it. A
    second pool in the same process (the trainer's later CPU shares) syncs to the same server, which still holds
    its socket to the first, dead, manager, and generates with the new weights."""
    model, spec, model_dir = saved_model
    server, url = launch_standin(model_dir)
    try:
        first = attached([url])
        try:
            first.start(spec)
            first.sync_weights(buckets(model), version=1)
            manager = first._weights.shm.pid
            assert manager is not None, "the update did not name the pool's manager"
            sockets = [
                fd for fd in os.listdir(f"/proc/{manager}/fd") if "socket" in os.readlink(f"/proc/{manager}/fd/{fd}")
            ]
            assert len(sockets) == 3, "the manager's clients are the pool's own connection and the server"
            socket_dir = Path(first._weights.shm.handle().decode()).parent
        finally:
            first.close()
        assert not alive(manager) and not socket_dir.exists(), "the pool's manager outlived the pool"
        second = attached([url])
        try:
            second.start(spec)
            second.sync_weights(buckets(model), version=2)
            (group,) = second.generate(requests_for(2, prompts=1), SAMPLING)
            assert group.version == 2
        finally:
            second.close()
        assert server.poll() is None, "the server died after its first manager had gone"
    finally:
        server.kill()
        server.wait()


def test_a_sigkilled_trainer_leaves_no_manager(tmp_path):
    """A trainer killed by SIGKILL while a server holds a connection to the manager its update named: neither that
    manager nor libtorch's own (started by the trainer's first CPU share) outlives it, and the server lives on."""
    tag = uuid.uuid4().hex
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env={**os.environ, RUN_TAG: tag},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server.stdin.write(trainer.stdout.readline())
        server.stdin.flush()
        assert server.stdout.readline().strip() == "6.0"  # unpickled in the server: it connected to the manager
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert_none_left(tag)
        assert server.poll() is None
    finally:
        for process in (trainer, server):
            process.kill()
            process.wait()


# a trainer that shares one CPU tensor as the pool does, then waits to be killed
TRAINER = """
import sys, torch
from lit_parl.rollout.shm_manager import ShmManager
from lit_parl.rollout.weight_transfer import serialize_named_tensors
weights, manager = torch.arange(4.0), ShmManager()
print(serialize_named_tensors([("w", weights)], manager), flush=True)
sys.stdin.read()
"""
# a server that unpickles an update, drops its tensors before answering (as SGLang's scheduler does: dropping one
# tells the manager, which a trainer killed after the answer no longer runs) and lives on
SERVER = """
import sys
from lit_parl.rollout.weight_transfer import deserialize_named_tensors
[(_, tensor)] = deserialize_named_tensors(sys.stdin.readline())
total = float(tensor.sum())
del tensor
print(total, flush=True)
sys.stdin.read()
"""
