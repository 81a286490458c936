"""The README runs as written: every Python block as a saved script in a fresh process, every CLI
example through Hydra's composition and ``cli.build``; and a script that forgets the ``__main__`` guard
gets an error that says so."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from lit_parl.callbacks import load_samples, load_timeline
from lit_parl.cli import build

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _cli_examples() -> list[list[str]]:
    """The overrides of every ``lit-parl`` (and ``make train ARGS=...``) command in the README's bash blocks."""
    examples = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            words = shlex.split(line) if line else []
            if words and words[0].endswith("lit-parl"):
                examples.append(words[1:])
            elif words[:2] == ["make", "train"] and len(words) > 2 and words[2].startswith("ARGS="):
                examples.append(shlex.split(words[2][len("ARGS="):]))
    return examples


def _run_script(tmp_path: Path, source: str, name: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(source)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_every_python_block_runs_as_a_saved_script(tmp_path, index):
    result = _run_script(tmp_path, _blocks("python")[index], f"readme_block_{index}.py")
    assert result.returncode == 0, f"README Python block {index} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """Spawned workers re-import the script; the error must say what to do, not only that a worker died."""
    (block,) = [b for b in _blocks("python") if "HFRolloutPool" in b and "CopyTask()" in b]
    unguarded = block.replace('if __name__ == "__main__":\n', "if True:\n")
    assert unguarded != block
    result = _run_script(tmp_path, unguarded, "unguarded.py")
    assert result.returncode != 0
    assert 'if __name__ == "__main__":' in result.stderr, result.stderr[-3000:]


def test_the_readme_has_cli_examples():
    assert len(_cli_examples()) >= 15  # the count guards the parser, not the README


@pytest.mark.parametrize("overrides", _cli_examples(), ids=lambda o: " ".join(o)[:60] or "default")
def test_every_cli_example_composes_and_builds(tmp_path, overrides):
    """Each README override is a valid key; where nothing external is needed, the objects build too."""
    overrides = [o for o in overrides if not o.startswith(("trainer.devices=", "trainer.accelerator="))]  # no GPU here
    if "trainer=gpu" in overrides:  # the GPU preset, built on the CPU (bf16-mixed runs here under CPU autocast)
        overrides.append("trainer.accelerator=cpu")
    placeholder = any(re.search(r"[A-Z]{4,}|/models/|/path/|/shared/", o) for o in overrides)  # e.g. TRAINER_NODE_IP
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"run_dir={tmp_path}"])
    if placeholder or any(o.startswith(("pool=sglang", "pool=vllm", "resume=")) for o in overrides):
        return  # paths and engines that do not exist on this machine: composing is all that can be checked
    logger = next((o.split("=", 1)[1] for o in overrides if o.startswith("logger=")), "csv")
    if logger != "csv" and importlib.util.find_spec({"tensorboard": "tensorboard"}.get(logger, logger)) is None:
        with pytest.raises(ImportError, match=rf"pip install 'lit-parl\[{logger}\]'"):
            build(cfg)
        return
    module, datamodule, trainer = build(cfg)
    assert not datamodule.pool.health().started  # building starts nothing


LIT_PARL = Path(sys.executable).parent / "lit-parl"


def test_the_default_job_prints_no_warning_and_writes_one_directory(tmp_path):
    """The CLI's console is the job's own: progress and summary, no library notice a user cannot act on."""
    run_dir = tmp_path / "run"
    result = subprocess.run([str(LIT_PARL), "iterations=2", f"run_dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    noise = [line for line in output.splitlines() if re.search(r"warn|deprecat|Tip:|Writing model shards|\.py:\d+: ", line, re.I)]
    assert not noise, "\n".join(noise)
    assert "lit_parl summary:" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "a second directory was created"
    assert {".hydra", "metrics.csv", "summary.json", "policy"} <= {p.name for p in run_dir.iterdir()}


def test_a_default_job_cut_by_max_time_prints_no_warning(tmp_path):
    """On a slow machine the default job ends at ``trainer.max_time``, inside an iteration: that iteration is left
    out of the summary and the timeline, quietly. An iteration of 128 micro-batches (1,024 prompts) makes a stop
    at its very end unlikely; the samples file shows where it came (written at the stop, of the cut iteration)."""
    run_dir = tmp_path / "run"
    command = [str(LIT_PARL), "shape.prompts=1024", "trainer.max_time=00:00:00:01", f"run_dir={run_dir}"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Time limit reached" in output
    noise = [line for line in output.splitlines() if re.search(r"warn|deprecat|Tip:|\.py:\d+: ", line, re.I)]
    assert not noise, "\n".join(noise)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {row["iteration"] for row in load_samples(run_dir / "samples.jsonl")} == {summary["iterations"]}, "not cut inside an iteration"
    assert len(load_timeline(run_dir / "timeline.jsonl")) == summary["iterations"]


def test_help_and_cfg_job_still_work(tmp_path):
    shown = subprocess.run([str(LIT_PARL), "--cfg", "job", "shape.group_size=16"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for line in ("_target_: lit_parl.RolloutDataModule", "_target_: lit_parl.IterationShape", "group_size: 16"):
        assert line in shown.stdout, line
    helped = subprocess.run([str(LIT_PARL), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "pool: hf, sglang, vllm" in helped.stdout, helped.stdout[-2000:]
    assert list(tmp_path.iterdir()) == [], "--cfg job and --help must not create a run directory"
