"""The README and the pages of docs/ run as written: every Python block as a saved script in a fresh process, every
CLI example through Hydra's composition and ``cli.build``, every path, module and link they name exists; and a
script that forgets the ``__main__`` guard gets an error that says so."""

from __future__ import annotations

import importlib
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

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
EXPERIMENTS = sorted((ROOT / "conf" / "experiment").glob("*.yaml"))


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(language: str, page: Path = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def _cli_examples(page: Path = README) -> list[list[str]]:
    """The overrides of every ``lit-parl`` (and ``make train ARGS=...``) command in the page's bash blocks."""
    examples = []
    for block in _blocks("bash", page):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            words = shlex.split(line) if line else []
            if words and words[0].endswith("lit-parl"):
                examples.append(words[1:])
            elif words[:2] == ["make", "train"] and len(words) > 2 and words[2].startswith("ARGS="):
                examples.append(shlex.split(words[2][len("ARGS=") :]))
    return examples


PYTHON_BLOCKS = [(page, index) for page in PAGES for index in range(len(_blocks("python", page)))]
CLI_EXAMPLES = [(page, overrides) for page in PAGES for overrides in _cli_examples(page)]


def _run_script(tmp_path: Path, source: str, name: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(source)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(("page", "index"), PYTHON_BLOCKS, ids=[f"{_name(p)}:{i}" for p, i in PYTHON_BLOCKS])
def test_every_python_block_runs_as_a_saved_script(tmp_path, page, index):
    result = _run_script(tmp_path, _blocks("python", page)[index], f"block_{index}.py")
    output = f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"{_name(page)}: Python block {index} failed:\n{output}"


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


def _needs_what_is_not_here(cfg, overrides: list[str]) -> bool:
    """Paths or GPUs that do not exist on this machine: composing is all that can be checked. (An engine's pool builds
    without its engine: nothing starts before ``setup``.)"""
    placeholder = any(re.search(r"[A-Z]{4,}|/models/|/path/|/shared/", o) for o in overrides)  # e.g. TRAINER_NODE_IP
    return placeholder or cfg.trainer.accelerator != "cpu"


@pytest.mark.parametrize(
    ("page", "overrides"), CLI_EXAMPLES, ids=[f"{_name(p)}: {' '.join(o)[:60] or 'default'}" for p, o in CLI_EXAMPLES]
)
def test_every_cli_example_composes_and_builds(tmp_path, page, overrides):
    """Each override of a page is a valid key (an experiment recipe too); where nothing external is needed, the
    objects build too."""
    overrides = [o for o in overrides if not o.startswith(("trainer.devices=", "trainer.accelerator="))]  # no GPU here
    if "trainer=gpu" in overrides:  # the GPU preset, built on the CPU (bf16-mixed runs here under CPU autocast)
        overrides.append("trainer.accelerator=cpu")
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"run_dir={tmp_path}"])
    if _needs_what_is_not_here(cfg, overrides):
        return
    logger = next((o.split("=", 1)[1] for o in overrides if o.startswith("logger=")), "csv")
    if logger != "csv" and importlib.util.find_spec({"tensorboard": "tensorboard"}.get(logger, logger)) is None:
        with pytest.raises(ImportError, match=rf"pip install 'lit-parl\[{logger}\]'"):
            build(cfg)
        return
    module, datamodule, trainer = build(cfg)
    assert not datamodule.pool.health().started  # building starts nothing


def test_every_experiment_recipe_is_a_global_package_that_a_page_runs():
    assert EXPERIMENTS, "conf/experiment/ holds no recipe"
    used = {o.split("=", 1)[1] for _, overrides in CLI_EXAMPLES for o in overrides if o.startswith("+experiment=")}
    for recipe in EXPERIMENTS:
        assert recipe.read_text().startswith("# @package _global_\n"), f"{recipe.name}: not merged at the top level"
        assert recipe.stem in used, f"no page's bash block runs lit-parl +experiment={recipe.stem}"


def _expand(path: str) -> list[str]:
    """``a/{b,c}.py`` as ``a/b.py`` and ``a/c.py``."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [out for alt in match.group(1).split(",") for out in _expand(head + alt + tail)]


def _names_a_module(dotted: str) -> bool:
    """``lit_parl.x.y.Name``: its longest module prefix exists, and the rest are attributes of that module."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:end])) is not None
        except ModuleNotFoundError:  # a parent that is a module, not a package
            found = False
        if found:
            break
    if end == len(parts):
        return True
    value = importlib.import_module(".".join(parts[:end]))
    for attribute in parts[end:]:
        if not hasattr(value, attribute):
            return False
        value = getattr(value, attribute)
    return True


REPOSITORY_PATH = r"(?<![\w./-])((?:lit_parl|tests|benchmarks|gpu_check|callbacks|kernels|conf|docs)/[\w./{},-]*)"


def _missing(page: Path) -> list[str]:
    text = page.read_text()
    missing = []
    for path in re.findall(REPOSITORY_PATH, text):
        path = re.sub(r":\w+$", "", path.split("::")[0]).rstrip(".,;:")  # a test id, or a function after a file
        missing += [p for p in _expand(path) if not (ROOT / p).exists()]
    missing += [dotted for dotted in set(re.findall(r"\blit_parl(?:\.\w+)+", text)) if not _names_a_module(dotted)]
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not target.startswith(("http://", "https://", "#")) and not (page.parent / target.split("#")[0]).exists():
            missing.append(f"link {target}")
    return sorted(set(missing))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_path_module_and_link_a_page_names_exists(page):
    """Files move: a page that names a path, a dotted module or a link that is not there any more fails here."""
    assert not _missing(page), f"{_name(page)} names what does not exist: {_missing(page)}"


LIT_PARL = Path(sys.executable).parent / "lit-parl"
NOISE = r"warn|deprecat|Tip:|\.py:\d+: "


def test_the_default_job_prints_no_warning_and_writes_one_directory(tmp_path):
    """The CLI's console is the job's own: progress and summary, no library notice a user cannot act on."""
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [str(LIT_PARL), "iterations=2", f"run_dir={run_dir}"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    noise = [line for line in output.splitlines() if re.search(rf"{NOISE}|Writing model shards", line, re.I)]
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
    noise = [line for line in output.splitlines() if re.search(NOISE, line, re.I)]
    assert not noise, "\n".join(noise)
    summary = json.loads((run_dir / "summary.json").read_text())
    samples = load_samples(run_dir / "samples.jsonl")
    assert {row["iteration"] for row in samples} == {summary["iterations"]}, "not cut inside an iteration"
    assert len(load_timeline(run_dir / "timeline.jsonl")) == summary["iterations"]


def test_help_and_cfg_job_still_work(tmp_path):
    command = [str(LIT_PARL), "--cfg", "job", "shape.group_size=16"]
    shown = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    for line in ("_target_: lit_parl.RolloutDataModule", "_target_: lit_parl.IterationShape", "group_size: 16"):
        assert line in shown.stdout, line
    helped = subprocess.run([str(LIT_PARL), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "pool: hf, sglang, vllm" in helped.stdout, helped.stdout[-2000:]
    assert list(tmp_path.iterdir()) == [], "--cfg job and --help must not create a run directory"
