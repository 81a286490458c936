"""``lit-parl-profile``: a job profiled in both modes at two chunkings, every chunking that divides its iteration
predicted, and the fastest printed as the overrides to add (nothing changed behind the user's back)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from planner.test_planner import write_profile

from lit_parl.planner import profile_cli

ROOT = Path(__file__).resolve().parents[2]


def ranked_rows(out: list[str]) -> list[tuple[str, int, int, float]]:
    rows = [line.split(" | ") for line in out if line.split(" | ")[0] in ("async", "sync")]
    return [(mode, int(chunk), int(batch), float(rate.replace(",", ""))) for mode, chunk, batch, rate in rows]


def written_profiles(directory: Path):
    """In place of ``run_profiles``' four runs: profiles of 16 prompts x 4 written under ``directory``."""

    def profiles(args, root, group_size):
        made = []
        for mode in profile_cli.MODES:
            for per_chunk in args.chunks:
                made.append(directory / f"{mode}_c{per_chunk}")
                write_profile(made[-1], mode=mode, per_chunk=per_chunk, chunk=0.006 + 0.001 * per_chunk)
        return made

    return profiles


def test_every_chunking_of_both_modes_is_ranked_and_the_fastest_is_printed_as_overrides(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profile_cli, "run_profiles", written_profiles(tmp_path))
    monkeypatch.setattr(profile_cli, "job_shape", lambda overrides: (16, 4))
    assert profile_cli.main(["--warmup", "2", "--chunks", "4,8", "--", "data=reverse"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = ranked_rows(out)
    assert sorted((mode, chunk) for mode, chunk, _, _ in rows) == sorted(
        (mode, chunk) for mode in ("async", "sync") for chunk in (1, 2, 4, 8, 16)
    )
    assert all(batch == 4 * chunk for _, chunk, batch, _ in rows)
    rates = [rate for *_, rate in rows]
    assert rates == sorted(rates, reverse=True)
    mode, chunk, batch, _ = rows[0]
    overrides = f"datamodule.mode={mode} pool.prompts_per_request={chunk} shape.micro_batch_size={batch}"
    assert out[-1] == f"run it with: lit-parl data=reverse {overrides}"


def test_with_fit_the_job_is_trained_with_the_fastest_overrides_in_the_same_process(tmp_path, monkeypatch, capsys):
    execs = []
    monkeypatch.setattr(profile_cli, "run_profiles", written_profiles(tmp_path))
    monkeypatch.setattr(profile_cli, "job_shape", lambda overrides: (16, 4))
    monkeypatch.setattr(profile_cli.os, "execv", lambda path, argv: execs.append((path, argv)))
    profile_cli.main(["--fit", "--warmup", "2", "--chunks", "4,8", "--", "data=reverse"])
    out = capsys.readouterr().out.splitlines()
    mode, chunk, batch, _ = ranked_rows(out)[0]
    chosen = [
        "data=reverse",
        f"datamodule.mode={mode}",
        f"pool.prompts_per_request={chunk}",
        f"shape.micro_batch_size={batch}",
    ]
    assert execs == [(profile_cli.lit_parl_command(), [str(profile_cli.lit_parl_command()), *chosen])]
    assert out[-1] == "training it: lit-parl " + " ".join(chosen)


def test_chunks_that_do_not_divide_the_iteration_are_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(profile_cli, "run_profiles", lambda *a: pytest.fail("nothing may run"))
    assert profile_cli.main(["--chunks", "8,12"]) == 2  # the default job: 32 prompts
    assert "each must divide the job's 32 prompts per iteration and be smaller" in capsys.readouterr().err
    assert profile_cli.main(["--chunks", "8,32"]) == 2  # one chunk, one micro-batch: no step to tell apart
    assert "and be smaller" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_profiles_the_real_job_and_names_overrides_it_can_run(tmp_path):
    argv = ["--iterations", "6", "--warmup", "2", "--chunks", "1,2", "--keep", str(tmp_path), "--", "shape.prompts=4"]
    run = subprocess.run(
        [sys.executable, "-m", "lit_parl.planner.profile_cli", *argv], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["async_c1", "async_c2", "sync_c1", "sync_c2"]
    assert all((p / "timeline.jsonl").exists() for p in tmp_path.iterdir())
    last = run.stdout.splitlines()[-1]
    assert last.startswith("run it with: lit-parl shape.prompts=4 datamodule.mode=")
    overrides = last.removeprefix("run it with: lit-parl ").split()
    fit = subprocess.run(
        [str(Path(sys.executable).parent / "lit-parl"), *overrides, "iterations=2", f"run_dir={tmp_path / 'chosen'}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert fit.returncode == 0, fit.stderr[-2000:]
