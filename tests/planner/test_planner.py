"""The capacity planner: costs read from a timeline, the schedule it plays, and the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_parl.planner.phase_costs import PhaseCosts, measure_costs
from lit_parl.planner.pipeline_model import Plan, simulate
from lit_parl.planner.plan_cli import main

ROOT = Path(__file__).resolve().parents[2]


def write_profile(
    run_dir: Path, iterations: int = 8, lent_from: int | None = None, mode: str = "async", chunk: float = 0.010
) -> None:
    """A run of 16 prompts x 4 in chunks of 4 prompts (16 samples) and micro-batches of 16: sync 3 ms, chunks
    of 10 ms (``chunk``), steps of 20 ms (lent: 12 ms) and a last step 2 ms longer, waits of 1 ms, gaps of 0.5 ms,
    0.4 ms between iterations."""
    config = {
        "shape": {"prompts": 16, "group_size": 4, "micro_batch_size": 16, "mini_batches": 1, "passes": 1},
        "pool": {"num_workers": 1, "threads_per_worker": 1, "prompts_per_request": 4},
        "datamodule": {"mode": mode, "trainer_threads": None},
    }
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    lines, begin = [], 0.0
    for i in range(iterations):
        sync = [(begin, begin + 0.003)]
        generate = [(begin + 0.003 + chunk * c, begin + 0.003 + chunk * (c + 1)) for c in range(4)]
        train, end = [], generate[0][1] + 0.001  # waited for the first micro-batch: lag 1 ms
        for j in range(4):
            end = max(end, generate[j][1] + 0.001)  # or for a later one, when generation is the longer side
            lent = lent_from is not None and j >= lent_from
            length = (0.012 if lent else 0.020) + (0.002 if j == 3 else 0.0)
            train.append((end, end + length))
            end += length + 0.0005  # the next micro-batch was in: a gap of 0.5 ms
        lines.append(
            {
                "iteration": i,
                "sync": sync,
                "generate": generate,
                "train": train,
                "lent_from": lent_from,
            }
        )
        begin = train[-1][1] + 0.0004
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_costs_are_the_medians_of_each_phase(tmp_path):
    write_profile(tmp_path)
    costs = measure_costs(tmp_path, warmup=2)
    assert costs.chunk_s == pytest.approx(0.010)
    assert costs.step_s == pytest.approx(0.020) and costs.lent_step_s is None
    assert costs.last_extra_s == pytest.approx(0.002)
    assert costs.sync_s == pytest.approx(0.003)
    assert costs.lag_s == pytest.approx(0.001)
    assert costs.gap_s == pytest.approx(0.0005)
    assert costs.between_s == pytest.approx(0.0004)
    assert (costs.prompts, costs.group_size, costs.micro_batch_size, costs.prompts_per_request) == (16, 4, 16, 4)
    assert costs.trainer_threads == 1  # unset: the two cores less the worker's one


def test_an_unset_trainer_thread_count_is_the_cores_the_workers_leave(tmp_path):
    write_profile(tmp_path)
    assert measure_costs(tmp_path, warmup=2, cores=16).trainer_threads == 15


def test_a_wait_for_the_pool_is_not_taken_for_a_gap_between_steps(tmp_path):
    """Generation the longer side (chunks of 30 ms, steps of 20): every step waits for its micro-batch, 1 ms
    after its chunk; none follows another at once."""
    write_profile(tmp_path, chunk=0.030)
    costs = measure_costs(tmp_path, warmup=2)
    assert costs.lag_s == pytest.approx(0.001) and costs.gap_s == 0.0
    prediction = simulate(costs, Plan(), cores=2)
    assert prediction.iteration_s == pytest.approx(0.003 + 4 * 0.030 + 0.001 + 0.022 + 0.0004)


def test_lent_steps_are_measured_apart(tmp_path):
    write_profile(tmp_path, lent_from=2)
    costs = measure_costs(tmp_path, warmup=2)
    assert costs.step_s == pytest.approx(0.020)
    assert costs.lent_step_s == pytest.approx(0.012)
    assert costs.last_extra_s == pytest.approx(0.002)  # over a lent step: the last one was lent too


def test_the_profiles_own_shape_plays_back_at_its_own_time(tmp_path):
    """The schedule rebuilt from the medians: sync 3, first chunk in at 13, lag 1, four steps (20, 20, 20, 22)
    with gaps of 0.5, then 0.4 to the next sync: 97.9 ms, as the profile's iterations took."""
    write_profile(tmp_path)
    prediction = simulate(measure_costs(tmp_path, warmup=2), Plan(), cores=2)
    assert prediction.iteration_s == pytest.approx(0.003 + 0.010 + 0.001 + 4 * 0.020 + 0.002 + 3 * 0.0005 + 0.0004)


def test_more_threads_than_cores_share_them():
    """While more threads are busy than there are cores, each runs at cores / busy threads of its speed."""

    def costs(prompts: int, per_chunk: int) -> PhaseCosts:  # chunks of 10 ms, steps of 20 ms, nothing else
        return PhaseCosts(0.010, 0.020, None, 0.0, 0.0, 0.0, 0.0, 0.0, prompts, 4, 16, per_chunk, 1, 1)

    # 4 chunks of one prompt, one micro-batch of all 16 samples: one worker 40 ms then the step, 60 ms;
    # two workers on two cores (the trainer waiting) 2 rounds of 10 ms, then the step: 40 ms
    assert simulate(costs(4, 1), Plan(), cores=2).iteration_s == pytest.approx(0.060)
    assert simulate(costs(4, 1), Plan(workers=2), cores=2).iteration_s == pytest.approx(0.040)
    # two workers on one core: each at half speed (20 ms for their chunks of 4 prompts), then two steps: 60 ms
    assert simulate(costs(8, 4), Plan(workers=2), cores=1).iteration_s == pytest.approx(0.060)
    # 5 chunks of 4 prompts (a micro-batch each) on two workers and two cores: the first round alone (10 ms);
    # in the second the trainer's first step runs beside both workers, all three at 2/3 speed, for 15 ms;
    # then the last chunk beside the step's remaining 10 ms of work (to 35 ms), and 4 more steps: 115 ms
    assert simulate(costs(20, 4), Plan(workers=2), cores=2).iteration_s == pytest.approx(0.115)


def test_lending_shortens_the_tail_only_once_the_pool_is_done(tmp_path):
    write_profile(tmp_path, lent_from=2)
    costs = measure_costs(tmp_path, warmup=2)
    plain, lent = simulate(costs, Plan(), cores=2), simulate(costs, Plan(lend=True), cores=2)
    # the pool is done at 43 ms, during the second step: the third and fourth steps are lent (8 ms less each)
    assert plain.iteration_s - lent.iteration_s == pytest.approx(2 * 0.008)


def test_the_command_predicts_every_combination_and_recommends_one(tmp_path, capsys):
    write_profile(tmp_path)
    assert main([str(tmp_path), "--warmup", "2", "--cores", "2", "--prompts", "16,32", "--workers", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    # training is the longer side (20 ms a step against 10 ms a chunk of as many samples): a second worker on
    # the 2 cores only takes the trainer's share, and more prompts make the iteration's fixed costs smaller
    assert len(out) == 1 + 4 + 1 and out[-1].startswith("recommended: prompts=32, micro_batch=16, workers=1"), out


def test_bad_profiles_are_refused_with_the_fix(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "timeline.jsonl is missing" in capsys.readouterr().err
    write_profile(tmp_path / "sync", mode="sync")
    assert main([str(tmp_path / "sync")]) == 2
    assert "profile one of those" in capsys.readouterr().err
    write_profile(tmp_path / "short", iterations=4)
    assert main([str(tmp_path / "short"), "--warmup", "2"]) == 2
    assert "need 3 or more" in capsys.readouterr().err


def test_gpu_split_from_stated_throughputs():
    """8 devices, generation 4x slower per device than training: the split that balances the two sides wins
    (6 generating, 2 training: 6 x 1 = 6 against 2 x 3 = 6 units of work per second; training with ideal scaling)."""
    argv = ["--gpus", "8", "--gen-tokens-per-s", "1000", "--train-tokens-per-s", "3000", "--train-efficiency", "1"]
    argv += ["--prompts", "384", "--group-size", "8", "--completion-tokens", "100", "--prompt-tokens", "0"]
    argv += ["--chunk-prompts", "8", "--micro-batch-sizes", "64"]
    run = subprocess.run(
        [sys.executable, "-m", "lit_parl.planner.plan_cli", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].startswith("recommended: prompts=384, micro_batch=64, inference=6, train=2")


def test_the_gpu_worked_example_prints_what_its_page_shows():
    """docs/planner.md's example, run as written: the command's recommendation is the page's."""
    import re
    import shlex

    page = (ROOT / "docs" / "planner.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", page, flags=re.S) if "--gpus" in b)
    argv = shlex.split(block.replace("\\\n", " "))[1:]
    run = subprocess.run(
        [sys.executable, "-m", "lit_parl.planner.plan_cli", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert f"`{run.stdout.splitlines()[-1]}`" in page
    for row in run.stdout.splitlines()[1:-1]:
        assert f"| {row} |" in page
