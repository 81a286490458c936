"""A fit through the CLI against a real SGLang server: ``lit-parl pool=sglang``, as a user runs it on this CPU.

The default job at a small shape, in a process of its own (this environment's Python, ``python -m lit_parl``),
launching its own SGLang server on the CPU and syncing it by ``tensor`` every iteration, with the runtime
on-policy check at its default (``datamodule.logprob_tolerance=auto``: the pool's float32 bound):

- the run exits 0, so no group failed the check (it raises ``OffPolicyError``), and every iteration's mean
  |rollout - θ_k| log-prob in ``metrics.csv`` is within that bound;
- the server's log-probs after its last sync equal the exported policy's: ``server_probe.ServerProbe`` asks the
  server at fit end (before the pool closes), and the policy the run exported after that many iterations
  (``callbacks.export.every_n_iterations=1``) gives the same log-probs in a transformers forward. The last
  iteration's own update is never pushed (no iteration follows), so the final ``policy/`` is one step further;
- nothing of the run is left once the CLI exits: no process that inherited its environment (the server, its
  scheduler and detokenizer, the ``torch_shm_manager`` that the tensor route's ``file_system`` sharing starts)
  still runs, and it created no ``/dev/shm/sglang_*`` or ``torch_*`` file that no process holds.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from sglang_contract.sglang_side import require_sglang

require_sglang()

from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE  # noqa: E402
from sglang_contract.pool_run import free_port  # noqa: E402

ITERATIONS = 3
TESTS = Path(__file__).resolve().parents[1]
SHM_PREFIXES = ("sglang_", "torch_")


def held_shm_files() -> set[str]:
    """The /dev/shm files some live process holds open or mapped (those of other runs on this machine)."""
    held: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            names = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            names += [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
        except OSError:
            continue
        held.update(n.removesuffix(" (deleted)") for n in names if n.startswith("/dev/shm/"))
    return held


def shm_files() -> set[str]:
    return {str(p) for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIXES)}


def marked_processes(mark: str) -> list[str]:
    """Live (not zombie) processes whose environment holds ``mark``: the run's and its children's, reparented or not."""
    found = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if mark.encode() not in Path(f"/proc/{pid}/environ").read_bytes():
                continue
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z":  # an exited child that init has not reaped yet holds nothing
            found.append(f"{pid} {name[:200]}")
    return found


def policy_logprobs(model_dir: Path, sequence: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    """The CLI run, once for the module: (run directory, its process's output, the probe's answer, leftovers)."""
    from lit_parl.models import tiny_qwen2

    _, tokenizer = tiny_qwen2()
    sequences = [tokenizer.encode(text) for text in ("3917=3917", "42=4", "805=58")]
    run_dir = tmp_path_factory.mktemp("cli_fit") / "run"
    port, mark = free_port(), uuid.uuid4().hex
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "lit_parl",
        "pool=sglang",
        f"iterations={ITERATIONS}",
        "shape.prompts=4",
        "shape.group_size=4",
        "shape.micro_batch_size=16",
        "trainer.max_time=null",
        "checkpoint_every=0",
        "callbacks.progress.refresh_rate=0",
        "callbacks.export.every_n_iterations=1",
        f"pool.launch.port={port}",
        "pool.launch.start_timeout_s=600",
        f"run_dir={run_dir}",
        "+callbacks.probe._target_=sglang_contract.server_probe.ServerProbe",
        f"+callbacks.probe.url={url}",
        f"+callbacks.probe.path={run_dir}/probe.json",
        f"+callbacks.probe.sequences={json.dumps(sequences).replace(' ', '')}",
    ]
    env = {**os.environ, "PYTHONPATH": str(TESTS), "LIT_PARL_CLI_FIT_MARK": mark}
    shm_before = shm_files()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, cwd=TESTS.parent)
    # SIGKILLed children of the server are reparented to init, which reaps them a moment later
    deadline = time.monotonic() + 30.0
    while (left := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.5)
    # a file of this run that nobody holds stays; one of another run on this machine is held, or goes with it
    unheld = shm_files() - shm_before - held_shm_files()
    if unheld:
        time.sleep(10.0)
        unheld &= shm_files() - held_shm_files()
    return run_dir, done, sequences, {"processes": left, "shm": sorted(unheld)}


def test_the_cli_fit_through_a_real_server_exits_0_with_every_iteration_on_policy(fit):
    run_dir, done, _, _ = fit
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "lit_parl summary:" in done.stdout
    rows = [r for r in csv.DictReader(open(run_dir / "metrics.csv")) if r.get("reward")]
    assert len(rows) == ITERATIONS
    # the check ran at the float32 bound (a CPU server) and passed on every group; the means are far inside it
    assert all(float(r["mismatch/logprob_abs_diff"]) <= FP32_LOGPROB_TOLERANCE for r in rows)


def test_the_exported_policy_gives_the_log_probs_of_the_server_after_its_last_sync(fit):
    run_dir, done, sequences, _ = fit
    assert done.returncode == 0, done.stderr[-3000:]
    probe = json.loads((run_dir / "probe.json").read_text())
    last = ITERATIONS - 1  # the version of the last iteration: θ after ITERATIONS - 1 iterations
    assert probe["weight_version"] == str(last)
    policies = run_dir / "policy"

    def worst(exported: Path) -> float:
        return max(
            (policy_logprobs(exported, sequence) - torch.tensor(served, dtype=torch.float64)).abs().max().item()
            for sequence, served in zip(sequences, probe["logprobs"], strict=True)
        )

    assert worst(policies / f"iteration-{last}") <= FP32_LOGPROB_TOLERANCE  # 3e-7 here
    # one optimizer step either side is far from it (0.1 here): the comparison tells neighbouring versions apart
    assert worst(policies / f"iteration-{last - 1}") > 100 * FP32_LOGPROB_TOLERANCE
    assert worst(policies) > 100 * FP32_LOGPROB_TOLERANCE  # the final policy: the last update, never pushed


def test_nothing_of_the_cli_run_is_left_after_it_exits(fit):
    _, done, _, leftovers = fit
    assert done.returncode == 0, done.stderr[-3000:]
    assert leftovers == {"processes": [], "shm": []}
