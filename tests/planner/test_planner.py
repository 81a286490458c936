"""The capacity planner: costs read from a timeline, the schedule it plays, and the command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lit_parl.planner.phase_costs import PhaseCosts, fit_fixed_costs, measure_costs
from lit_parl.planner.pipeline_model import Plan, simulate
from lit_parl.planner.plan_cli import main

ROOT = Path(__file__).resolve().parents[2]


def write_profile(
    run_dir: Path,
    iterations: int = 8,
    lent_from: int | None = None,
    mode: str = "async",
    chunk: float = 0.010,
    per_chunk: int = 4,
    passes: int = 1,
    cold: float = 0.0,
) -> None:
    """A run of 16 prompts x 4 in chunks of 4 prompts (16 samples; ``per_chunk``) and micro-batches of 16: sync
    3 ms, chunks of 10 ms (``chunk``), steps of 20 ms (lent: 12 ms) and a last step 2 ms longer, waits of 1 ms,
    gaps of 0.5 ms, 0.4 ms between iterations. ``mode="sync"``: the first step waits for the last chunk. ``cold``:
    what the first chunk takes beyond the others."""
    config = {
        "shape": {"prompts": 16, "group_size": 4, "micro_batch_size": 16, "mini_batches": 1, "passes": passes},
        "pool": {"num_workers": 1, "threads_per_worker": 1, "prompts_per_request": per_chunk},
        "datamodule": {"mode": mode, "trainer_threads": None},
        "model": {"hidden_size": 128},
    }
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    lines, begin = [], 0.0
    for i in range(iterations):
        sync = [(begin, begin + 0.003)]
        starts = [begin + 0.003 + chunk * c + (cold if c else 0.0) for c in range(16 // per_chunk)]
        generate = [(start, start + chunk + (0.0 if c else cold)) for c, start in enumerate(starts)]
        train, end = [], 0.0
        for j in range(4):
            ready = generate[-1 if mode == "sync" else (4 * j + 3) // per_chunk][1]
            end = max(end, ready + 0.001)  # waited for this micro-batch (lag 1 ms), or it was in already
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
    plain, lent = simulate(costs, Plan(lend=False), cores=2), simulate(costs, Plan(lend=True), cores=2)
    assert simulate(costs, Plan(), cores=2) == lent  # unset: as the profile ran
    # the pool is done at 43 ms, during the second step: the third and fourth steps are lent (8 ms less each)
    assert plain.iteration_s - lent.iteration_s == pytest.approx(2 * 0.008)


def test_the_command_predicts_every_combination_and_recommends_one(tmp_path, capsys):
    write_profile(tmp_path)
    assert main([str(tmp_path), "--warmup", "2", "--cores", "2", "--prompts", "16,32", "--workers", "1,2"]) == 0
    out = capsys.readouterr().out.splitlines()
    # training is the longer side (20 ms a step against 10 ms a chunk of as many samples): a second worker on
    # the 2 cores only takes the trainer's share, and more prompts make the iteration's fixed costs smaller
    assert len(out) == 1 + 4 + 1, out
    assert out[-1].startswith("recommended: mode=async, prompts=32, chunk=4, micro_batch=16, workers=1"), out


def test_the_first_chunk_after_the_sync_is_measured_apart(tmp_path):
    """Two chunks of 50 ms (generation the longer side), the first 6 ms slower (a worker resuming after a pause):
    the chunks cost 50 ms, the fill 6 ms more, and the profile's own shape plays back 6 ms longer than without."""
    write_profile(tmp_path / "cold", cold=0.006, chunk=0.050, per_chunk=8)
    write_profile(tmp_path / "warm", chunk=0.050, per_chunk=8)
    cold, warm = (measure_costs(tmp_path / name, warmup=2) for name in ("cold", "warm"))
    assert cold.chunk_s == pytest.approx(0.050) and cold.fill_extra_s == pytest.approx(0.006)
    assert warm.fill_extra_s == pytest.approx(0.0)
    played = simulate(cold, Plan(), cores=2).iteration_s - simulate(warm, Plan(), cores=2).iteration_s
    assert played == pytest.approx(0.006)


def test_a_sync_profile_plays_back_with_every_step_after_the_whole_iteration(tmp_path):
    """Sync 3, four chunks (to 43), lag 1, four steps (20, 20, 20, 22) with gaps of 0.5, 0.4 to the next sync."""
    write_profile(tmp_path, mode="sync")
    costs = measure_costs(tmp_path, warmup=2, cores=2)
    assert costs.mode == "sync" and costs.trainer_threads == 2  # the phases take turns: the trainer has every core
    assert costs.lag_s == pytest.approx(0.001) and costs.gap_s == pytest.approx(0.0005)
    prediction = simulate(costs, Plan(), cores=2)
    assert prediction.iteration_s == pytest.approx(0.003 + 0.040 + 0.001 + 0.082 + 3 * 0.0005 + 0.0004)
    # more chunks' worth of prompts: every step still waits for all of them
    longer = simulate(costs, Plan(prompts=32), cores=2)
    assert longer.iteration_s == pytest.approx(0.003 + 0.080 + 0.001 + 0.162 + 7 * 0.0005 + 0.0004)
    with pytest.raises(ValueError, match="predicts its own split"):
        simulate(costs, Plan(workers=2), cores=2)


def test_profiles_at_two_chunk_sizes_separate_a_calls_fixed_cost(tmp_path):
    """Chunks of 4 prompts in 10 ms and of 8 in 12 ms: 8 ms a call, 0.5 ms a prompt; a chunk of 16 takes 16 ms."""
    write_profile(tmp_path / "c4", per_chunk=4, chunk=0.010)
    write_profile(tmp_path / "c8", per_chunk=8, chunk=0.012)
    fitted = fit_fixed_costs([measure_costs(tmp_path / "c4", warmup=2), measure_costs(tmp_path / "c8", warmup=2)])
    assert fitted.prompts_per_request == 4 and fitted.chunk_fixed_s == pytest.approx(0.008)
    assert fitted.step_fixed_s == 0.0  # one micro-batch size: a step's fixed part cannot be told apart
    one_chunk = simulate(fitted, Plan(prompts_per_request=16), cores=2)
    # sync 3, the one chunk 16, lag 1, four steps back to back (82 and 3 gaps), 0.4
    assert one_chunk.iteration_s == pytest.approx(0.003 + 0.016 + 0.001 + 0.082 + 3 * 0.0005 + 0.0004)
    # from the first profile alone a chunk's time is in proportion to its prompts: 40 ms for 16
    alone = simulate(measure_costs(tmp_path / "c4", warmup=2), Plan(prompts_per_request=16), cores=2)
    assert alone.iteration_s - one_chunk.iteration_s == pytest.approx(0.040 - 0.016)
    # a line that would put a negative or more-than-whole fixed part (noise between two close sizes) is clamped:
    # a chunk is then all per-sample (twice the prompts, three times the time) or all fixed (a bigger one no slower)
    steep = fit_fixed_costs([fitted, dataclasses.replace(fitted, prompts_per_request=8, chunk_s=0.030)])
    flat = fit_fixed_costs([fitted, dataclasses.replace(fitted, prompts_per_request=8, chunk_s=0.009)])
    assert (steep.chunk_fixed_s, flat.chunk_fixed_s) == (0.0, pytest.approx(0.010))
    other = measure_costs(tmp_path / "c8", warmup=2)
    with pytest.raises(ValueError, match="must differ only in prompts, chunk and micro-batch sizes"):
        fit_fixed_costs([fitted, dataclasses.replace(other, workers=2)])


def test_a_profile_that_lent_is_predicted_lending_unless_asked_for_both(tmp_path, capsys):
    write_profile(tmp_path, lent_from=2)
    assert main([str(tmp_path), "--warmup", "2", "--cores", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert [row.split(" | ")[6] for row in rows] == ["True"], rows
    assert main([str(tmp_path), "--warmup", "2", "--cores", "2", "--lend"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:-1]
    assert [row.split(" | ")[6] for row in rows] == ["True", "False"], rows


def test_the_command_compares_the_modes_it_was_given_profiles_of(tmp_path, capsys):
    """Async and sync profiles of one model: each mode's rows, and the faster recommended (async here: sync
    waits for all four chunks before the first step)."""
    write_profile(tmp_path / "async")
    write_profile(tmp_path / "sync", mode="sync")
    argv = [str(tmp_path / "async"), str(tmp_path / "sync"), "--warmup", "2", "--cores", "2", "--workers", "1,2"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    modes = [line.split(" | ")[0] for line in out[1:-1]]
    assert modes == ["async", "async", "sync"], out  # a sync profile predicts its own split only
    assert out[-1].startswith("recommended: mode=async"), out
    other = tmp_path / "other"
    write_profile(other, mode="sync")
    config = yaml.safe_load((other / ".hydra" / "config.yaml").read_text())
    config["model"]["hidden_size"] = 64
    (other / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    assert main([str(tmp_path / "async"), str(other), "--warmup", "2"]) == 2
    assert "2 different models" in capsys.readouterr().err


def test_bad_profiles_are_refused_with_the_fix(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "timeline.jsonl is missing" in capsys.readouterr().err
    write_profile(tmp_path / "passes", passes=2)
    assert main([str(tmp_path / "passes")]) == 2
    assert "profile one of those" in capsys.readouterr().err
    one_step = tmp_path / "one_step"  # one micro-batch an iteration: its step is not told from the optimizer's
    write_profile(one_step)
    lines = [json.loads(line) for line in (one_step / "timeline.jsonl").read_text().splitlines()]
    timeline = "".join(json.dumps({**line, "train": line["train"][-1:]}) + "\n" for line in lines)
    (one_step / "timeline.jsonl").write_text(timeline)
    assert main([str(one_step), "--warmup", "2"]) == 2
    assert "profile with two or more" in capsys.readouterr().err
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


@pytest.mark.parametrize("prompts", [2, 4])
def test_every_workers_first_chunk_of_the_iteration_is_cold(prompts):
    """Two workers, chunks of one prompt dealt round-robin (one or two each): each worker's first chunk takes
    ``fill_extra_s`` more, so every chunk, and with them the whole iteration, ends exactly that much later;
    a worker's later chunks are warm."""
    costs = PhaseCosts(
        chunk_s=0.010,
        step_s=0.020,
        lent_step_s=None,
        last_extra_s=0.002,
        sync_s=0.003,
        lag_s=0.001,
        gap_s=0.0005,
        between_s=0.0004,
        prompts=prompts,
        group_size=4,
        micro_batch_size=4,
        prompts_per_request=1,
        workers=2,
        trainer_threads=1,
    )
    cold = simulate(dataclasses.replace(costs, fill_extra_s=0.005), Plan(), cores=3)
    warm = simulate(costs, Plan(), cores=3)
    assert cold.iteration_s - warm.iteration_s == pytest.approx(0.005)
    assert cold.gen_busy_s - warm.gen_busy_s == pytest.approx(0.005)  # the workers' first chunks side by side
