"""Strategies on the CPU, 2 processes each (gloo): DDP, FSDP2 (Lightning's ModelParallelStrategy) and FSDP1
(Lightning's FSDPStrategy, given the CPU as its device: ``distributed_fit.CPUFSDPStrategy``) end with the
single-process policy on the same global batch, train every prompt once across ranks, give each rank's pool one
sync per iteration of full, correctly named tensors, resume exactly from a checkpoint written inside an
iteration, and a killed rank ends the whole run with no process left behind.

Each run is ``tests/helpers/distributed_fit.py`` in a process of its own, as a user starts a multi-device run:
Lightning's launcher starts rank 1 by running the script again. SGD without clipping, so a gradient scale error
shows.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers.multi_process import assert_same_policy

pytestmark = pytest.mark.slow  # make test-slow: several minutes of 2-process fits

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "distributed_fit.py"
ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 2


def launch(out: Path, strategy: str = "single", *flags: str, timeout: float = 240) -> subprocess.CompletedProcess:
    devices = ["--devices", "2"] if strategy != "single" else []
    command = [
        sys.executable,
        str(SCRIPT),
        "--strategy",
        strategy,
        *devices,
        "--out",
        str(out),
        "--iterations",
        str(ITERATIONS),
        *flags,
    ]
    # a session of its own, so that the test can tell whether any process of the run outlives it
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, start_new_session=True)
    return result


def run(out: Path, strategy: str = "single", *flags: str) -> dict:
    result = launch(out, strategy, *flags)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = sorted(out.glob("rank*.json"))
    return {
        "policy": torch.load(out / "policy.pt"),
        "ranks": [json.loads(path.read_text()) for path in ranks],
    }


def samples(result: dict) -> list[tuple]:
    return [tuple(sample) for rank in result["ranks"] for sample in rank["samples"]]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run(tmp_path_factory.mktemp("single"))


@pytest.fixture(scope="module", params=["ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3"])
def two_ranks(request, tmp_path_factory) -> tuple[str, Path, dict]:
    """A 2-rank run that writes a checkpoint after every optimizer step."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, out, run(out, request.param, "--save-every-step", str(out / "checkpoints"))


def test_two_ranks_train_the_single_process_update_each_prompt_once(single, two_ranks):
    strategy, out, result = two_ranks
    assert_same_policy(result["policy"], single["policy"])
    for rank in result["ranks"]:  # the global norm, not one rank's piece of it
        assert rank["grad_norm"] == pytest.approx(single["ranks"][0]["grad_norm"], rel=1e-5)
    first, second = (rank["samples"] for rank in result["ranks"])
    assert len(first) == len(second), "the ranks' shares differ in size"
    assert not {tuple(s) for s in first} & {tuple(s) for s in second}, "a sample was trained on both ranks"
    assert sorted(samples(result)) == sorted(samples(single)), (
        "the ranks together did not train the single run's samples"
    )
    assert all(rank["drawn"] == ITERATIONS * 8 for rank in result["ranks"]), "the ranks' schedules moved apart"
    names = [name for name, _ in single["policy"].items()]
    shapes = {name: list(tensor.shape) for name, tensor in single["policy"].items()}
    for rank in result["ranks"]:  # each rank's engines start from a directory of their own, as transformers writes it
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(rank["initial_dir"]["files"])
        assert rank["initial_dir"]["architectures"] == ["Qwen2ForCausalLM"]
    # each rank's pool: one sync per iteration, every tensor whole and named as in the model
    for rank in result["ranks"]:
        assert [sync["version"] for sync in rank["syncs"]] == list(range(ITERATIONS))
        for sync in rank["syncs"]:
            received = [name for name, *_ in sync["tensors"]]
            assert (sorted(received) if strategy == "fsdp" else received) == (
                sorted(names) if strategy == "fsdp" else names
            )  # FSDP1: unit by unit
            assert all(shape == shapes[name] and kind == "Tensor" for name, shape, kind in sync["tensors"])
        assert rank["parameter_types"] == (["DTensor"] if strategy == "fsdp2" else ["Parameter"])
        full = sum(tensor.numel() for tensor in single["policy"].values())
        held = rank["policy_numel_held"]  # what this rank holds of the policy: about half of it when sharded
        assert held == full if strategy in ("ddp", "deepspeed2") else 0.4 * full < held < 0.6 * full, (
            held,
            full,
        )  # ZeRO-2: whole parameters
    exported = AutoModelForCausalLM.from_pretrained(out / "export").state_dict()  # HFExport gathers the shards too
    assert all(torch.equal(exported[name], tensor) for name, tensor in result["policy"].items())


@pytest.mark.parametrize("strategy", ["deepspeed2", "deepspeed3", "fsdp"])
def test_clipping_and_a_skipped_non_finite_step_match_one_process(tmp_path, strategy):
    """Norm clipping (DeepSpeed clips inside its own step, FSDP1 through its root unit) and a step skipped for a NaN:
    the same weights as one process, the same step skipped. Prompt 9 is trained in iteration 1's first step."""
    flags = ("--clip", "0.05", "--nan-prompt", "9")
    one = run(tmp_path / "single", "single", *flags)
    two = run(tmp_path / strategy, strategy, *flags)
    assert one["ranks"][0]["skipped_steps"] == 1 and [rank["skipped_steps"] for rank in two["ranks"]] == [1, 1]
    assert_same_policy(two["policy"], one["policy"])
    assert two["ranks"][0]["grad_norms"] == pytest.approx(one["ranks"][0]["grad_norms"], rel=1e-5)
    assert one["ranks"][0]["grad_norms"][0] > 0.05, "the norm stayed under the clip: clipping was not exercised"


def test_sync_and_async_agree_under_ddp_and_every_rank_logs_the_evaluation(tmp_path, single):
    """Also with a held-out evaluation after each iteration: rank 0 evaluates, every rank logs its metrics (and so
    runs the same validation step and its collectives), and training is unchanged."""
    synchronous = run(tmp_path, "ddp", "--mode", "sync", "--eval")
    assert_same_policy(synchronous["policy"], single["policy"])
    assert sorted(samples(synchronous)) == sorted(samples(single))
    first, second = (rank["val"] for rank in synchronous["ranks"])
    assert "val/greedy_accuracy" in first and first == second


def test_dynamic_sampling_refills_are_numbered_as_on_one_device(tmp_path):
    """Refill rounds draw prompts for every rank's open slots in slot order: the same prompts as one process."""
    one = run(tmp_path / "single", "single", "--dynamic")
    two = run(tmp_path / "ddp", "ddp", "--dynamic")
    assert one["ranks"][0]["drawn"] > ITERATIONS * 8, "no group was refilled: the test would not exercise the exchange"
    assert [rank["drawn"] for rank in two["ranks"]] == [one["ranks"][0]["drawn"]] * 2
    assert sorted(samples(two)) == sorted(samples(one))
    assert_same_policy(two["policy"], one["policy"])


def test_resume_inside_an_iteration_under_two_ranks_is_exact(tmp_path, two_ranks):
    """Step 3 is the first of iteration 1's two optimizer steps; FSDP2 and FSDP1 write sharded (distributed)
    checkpoints."""
    strategy, straight_dir, straight = two_ranks
    resumed = run(tmp_path, strategy, "--resume", str(straight_dir / "checkpoints" / "step=3.ckpt"))
    assert_same_policy(resumed["policy"], straight["policy"], rtol=1e-6)
    later = [
        s for s in samples(straight) if s[0] == 1
    ]  # iteration 1's samples, half of them trained before the checkpoint
    assert set(samples(resumed)) < set(later) and len(samples(resumed)) == len(later) // 2
    if strategy != "ddp":
        assert (straight_dir / "checkpoints" / "step=3.ckpt").is_dir(), (
            "a single-file checkpoint: sharding was not exercised"
        )
        # iteration 0's last micro-batch: Lightning goes on without the next epoch's start, and the sharded
        # checkpoint holds iteration 0's θ_k, which must be taken again from the policy
        after_last = run(
            tmp_path / "after_last", strategy, "--resume", str(straight_dir / "checkpoints" / "step=2.ckpt")
        )
        assert_same_policy(after_last["policy"], straight["policy"], rtol=1e-6)


def _session_processes(session: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session:  # field 6 of /proc/<pid>/stat, counted after the command name
            found.append(stat.parent.name)
    return found


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_rank_ends_the_whole_run_and_leaves_no_process(tmp_path, rank):
    """Each rank has a pool of worker processes; rank ``rank`` is SIGKILLed when iteration 1 starts."""
    devices = ["--devices", "2"]
    command = [sys.executable, str(SCRIPT), "--strategy", "ddp", *devices, "--out", str(tmp_path), "--die", str(rank)]
    # a SIGKILLed rank cannot remove its temporary directories: they go under the test's own, not /tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert not (tmp_path / "policy.pt").exists()
    if rank == 0:  # the launcher itself was killed; rank 1 (its child) must not live on
        assert process.returncode == -signal.SIGKILL
    else:  # Lightning's launcher sees its child die, or rank 0's collective sees its peer gone: either says so
        assert process.returncode != 0
        assert re.search(r"terminated with code -9|Connection (closed|reset) by peer", output), output[-3000:]
    deadline = time.monotonic() + 30
    while _session_processes(process.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(process.pid) == [], "a process of the run outlived it"


def test_the_cli_trains_under_fsdp2_in_one_run_directory(tmp_path):
    """``lit-parl trainer=fsdp2``: Lightning starts rank 1 by running the command again, and each rank writes its
    shard of every checkpoint into the run directory, which must be the same one (the default run_dir is a time)."""
    command = [
        str(Path(sys.executable).parent / "lit-parl"),
        "trainer=fsdp2",
        "iterations=2",
        "shape.prompts=8",
        "shape.micro_batch_size=16",
        "checkpoint_every=1",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert result.returncode == 0, result.stderr[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()  # one run directory: rank 1 made none of its own
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (
        summary["iterations"] == 2 and summary["completions"] == 2 * 8 * 8
    )  # iterations x prompts x group_size, all ranks
    for checkpoint in ("epoch=0-step=1.ckpt", "epoch=1-step=2.ckpt"):
        assert sorted(p.name for p in (run_dir / "checkpoints" / checkpoint).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3"])
def test_lora_at_two_ranks_trains_the_single_process_update(tmp_path, single, strategy):
    """LoRA adapters (lit_parl.models.lora) at 2 ranks: the merged policy the pool receives is one process's; the
    frozen base holds gradients on no rank, so DDP averages the adapters' only. Under FSDP2 the adapters are
    sharded with their layers: θ_k's snapshot is copied shard by shard, the merge gathers base, A and B whole,
    and the exported adapter is gathered too; under FSDP1 unit by unit (θ_k's adapter copied inside the summoned
    unit), under ZeRO-3 tensor by tensor."""
    one = run(tmp_path / "single", "single", "--lora")
    two = run(tmp_path / strategy, strategy, "--lora")
    assert_same_policy(two["policy"], one["policy"])
    assert sorted(samples(two)) == sorted(samples(one))
    moved = max(float((one["policy"][name] - tensor).abs().max()) for name, tensor in single["policy"].items())
    assert moved > 1e-3, "the LoRA run ended where the full-weight run did: the adapters did nothing"
    names = [name for name, _ in single["policy"].items()]
    for rank in two["ranks"]:  # the pool receives the merged weights under the model's own names (FSDP1: by unit)
        assert all(sorted(name for name, *_ in sync["tensors"]) == sorted(names) for sync in rank["syncs"])
    adapters = [
        load_file(out / "export" / "adapter" / "adapter_model.safetensors")
        for out in (tmp_path / "single", tmp_path / strategy)
    ]
    assert adapters[0].keys() == adapters[1].keys() and len(adapters[0]) > 0
    for name, tensor in adapters[0].items():  # whole tensors, one process's
        torch.testing.assert_close(adapters[1][name], tensor, atol=1e-5, rtol=0)
