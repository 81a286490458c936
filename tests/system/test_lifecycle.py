"""Process lifecycle, configuration errors and packaging.

* Rollout workers never outlive the run: normal end of ``Trainer.fit``, an exception inside training,
  SIGINT / SIGTERM / SIGKILL of a real ``lit-parl`` CLI process.
* A bad configuration fails with a message naming the problem before any process starts.
* The built wheel ships ``lit_parl.callbacks``, ``lit_parl.kernels`` and the Hydra configs, with no
  top-level ``kernels`` / ``callbacks`` package.
* Running from the repository root (where ``import kernels`` finds our folder) does not break transformers.

Processes are inspected through ``/proc`` (Linux only; psutil is not a dependency).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lightning
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import InstantiationException, MissingConfigException
from omegaconf.errors import MissingMandatoryValue

from helpers.components import fit, make_components
from lit_parl.cli import build
from lit_parl.data.rollout_datamodule import RolloutDataModule
from lit_parl.trainer.grpo_module import GRPOModule

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LIT_PARL = BIN / "lit-parl"


# -- /proc helpers --------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, session id, start time) of ``pid``, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data.rsplit(")", 1)[1].split()  # fields[0] is field 3 (state) of proc(5)
    return fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def _processes() -> dict[int, tuple[str, int, int, int]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def _running(stat) -> bool:
    return stat is not None and stat[0] not in ("Z", "X")  # a zombie has exited already


def _alive(pid: int, start_time: int | None = None) -> bool:
    stat = _stat(pid)
    return _running(stat) and (start_time is None or stat[3] == start_time)


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return stat[3] if stat else None


def _live_children(pid: int) -> set[int]:
    return {p for p, s in _processes().items() if s[1] == pid and _running(s)}


def _session(sid: int) -> set[int]:
    """Live processes of session ``sid``: descendants keep it even when re-parented to init."""
    return {p for p, s in _processes().items() if s[2] == sid and _running(s)}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ignores_sigint(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except OSError:
        pass
    return False


def _describe(pids) -> str:
    return ", ".join(f"{p} [{_cmdline(p)[:120]}]" for p in sorted(pids)) or "none"


def _wait_until(predicate, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)


def _non_tracker_children() -> set[int]:
    """Live children of this test process, except multiprocessing's resource tracker: the first
    multiprocessing queue of the interpreter starts it and it stays until the interpreter exits."""
    return {p for p in _live_children(os.getpid()) if "resource_tracker" not in _cmdline(p)}


# -- 1a / 1b: in-process fits -------------------------------------------------------------------------
class _RecordWorkers(lightning.Callback):
    """Records the pool's worker pids mid-training, checks they are live children of this process."""

    def __init__(self) -> None:
        self.workers: dict[int, int] = {}  # pid -> start time
        self.children_then: set[int] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self.workers:
            self.workers = {pid: _start_time(pid) for pid in trainer.datamodule.pool.pids()}
            self.children_then = _live_children(os.getpid())


def _assert_recorded_workers(recorder: _RecordWorkers) -> None:
    assert recorder.workers, "the pool reported no worker pids during training"
    assert set(recorder.workers) <= recorder.children_then, (
        f"workers {sorted(recorder.workers)} were not live children during training: "
        f"{_describe(recorder.children_then)}"
    )


def test_workers_gone_after_normal_fit():
    before = _non_tracker_children()
    module, datamodule = make_components()
    recorder = _RecordWorkers()
    try:
        trainer = fit(module, datamodule, iterations=2, callbacks=[recorder])
        assert trainer.current_epoch == 2 and datamodule.iterations_done == 2
        _assert_recorded_workers(recorder)
        # close() joins the workers, so they must be gone as soon as fit returns
        alive = [pid for pid, start in recorder.workers.items() if _alive(pid, start)]
        assert not alive, f"rollout workers still alive after fit returned: {_describe(alive)}"
        leftover = _non_tracker_children() - before
        assert not leftover, f"new child processes left after fit: {_describe(leftover)}"
        assert datamodule.pool.pids() == [] and not datamodule.pool.health().started
    finally:
        datamodule.pool.close()


class _FailingModule(GRPOModule):
    def training_step(self, batch, batch_idx):
        if self.current_epoch == 1:
            raise ValueError("injected failure in training_step")
        return super().training_step(batch, batch_idx)


def test_workers_gone_after_exception_in_training():
    before = _non_tracker_children()
    module, datamodule = make_components()
    module = _FailingModule(
        module.policy, module.objective, module.shape, tokenizer=module.tokenizer
    )  # fails in iteration 2
    recorder = _RecordWorkers()
    try:
        with pytest.raises(ValueError, match="injected failure in training_step"):
            fit(module, datamodule, iterations=2, callbacks=[recorder])
        _assert_recorded_workers(recorder)
        # the datamodule (and its pool) is still referenced here, as it is in a user's script or notebook
        assert _wait_until(lambda: not any(_alive(p, s) for p, s in recorder.workers.items()), 2.0), (
            "rollout workers still alive 2 s after fit raised: "
            f"{_describe(p for p, s in recorder.workers.items() if _alive(p, s))}"
        )
        leftover = _non_tracker_children() - before
        assert not leftover, f"new child processes left after fit raised: {_describe(leftover)}"
    finally:
        datamodule.pool.close()
        assert not any(_alive(p, s) for p, s in recorder.workers.items()), "pool.close() left workers alive"


# -- 1c: signals to a real CLI process -------------------------------------------------------------------
@contextlib.contextmanager
def _cli(tmp_path: Path):
    """A ``lit-parl`` run in its own session; whatever is left of that session is killed on exit."""
    assert LIT_PARL.exists(), f"{LIT_PARL} not found: install the package (pip install -e .)"
    log_path = tmp_path / "cli.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(LIT_PARL), "iterations=100000", f"run_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # as from a terminal: a suite started in the background (`cmd &`) ignores SIGINT, and children
            # inherit that, which would defeat the Ctrl-C test and the "worker ignores SIGINT" probe
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    seen: set[int] = set()
    try:
        yield proc, log_path, seen
    finally:
        seen |= _session(proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in seen | _session(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _tail(log_path: Path, chars: int = 3000) -> str:
    return log_path.read_text(errors="replace")[-chars:]


def _wait_for_worker(proc: subprocess.Popen, log_path: Path, timeout_s: float = 120.0) -> int:
    """The pid of the CLI's rollout worker, once it runs ``_worker_main`` (which ignores SIGINT)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"lit-parl exited early with {proc.returncode}:\n{_tail(log_path)}")
        for pid in _live_children(proc.pid):
            if "spawn_main" in _cmdline(pid) and _ignores_sigint(pid):
                return pid
        time.sleep(0.1)
    pytest.fail(f"no rollout worker child of lit-parl within {timeout_s:.0f} s:\n{_tail(log_path)}")


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize(
    "signum, to_group",
    [
        pytest.param(signal.SIGINT, True, id="SIGINT-to-process-group"),  # Ctrl-C in a terminal
        pytest.param(signal.SIGTERM, False, id="SIGTERM-to-pid"),  # kill, schedulers, containers
    ],
)
def test_cli_signal_shuts_down_cleanly(tmp_path, signum, to_group):
    with _cli(tmp_path) as (proc, log_path, seen):
        worker = _wait_for_worker(proc, log_path)
        worker_start = _start_time(worker)
        time.sleep(0.5)  # let training get under way
        seen |= _session(proc.pid)
        assert proc.poll() is None, f"lit-parl exited before the signal:\n{_tail(log_path)}"
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"lit-parl did not exit within 60 s of {signum.name}:\n{_tail(log_path)}")
        # > 0: the CLI handled the signal and exited (Lightning's graceful shutdown: 1, ours: 130);
        # < 0 would mean the signal's default action killed it without closing the pool
        assert rc > 0, f"lit-parl exited with {rc} after {signum.name}:\n{_tail(log_path)}"
        assert not _alive(worker, worker_start), f"rollout worker {worker} outlived the CLI after {signum.name}"
        assert _wait_until(lambda: not _session(proc.pid), 10.0), (
            f"processes of the run still alive 10 s after {signum.name}: {_describe(_session(proc.pid))}"
        )


@pytest.mark.slow  # make test-slow
def test_cli_sigkill_takes_the_worker_down(tmp_path):
    with _cli(tmp_path) as (proc, log_path, seen):
        worker = _wait_for_worker(proc, log_path)
        worker_start = _start_time(worker)
        seen |= _session(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert _wait_until(lambda: not _alive(worker, worker_start), 5.0), (
            f"rollout worker {worker} still alive 5 s after its parent was SIGKILLed (PR_SET_PDEATHSIG)"
        )
        assert _wait_until(lambda: not _session(proc.pid), 10.0), (
            f"processes of the run still alive 10 s after SIGKILL: {_describe(_session(proc.pid))}"
        )


@pytest.mark.slow  # make test-slow
def test_cli_resumes_from_a_step_checkpoint_with_the_default_callbacks(tmp_path):
    """As a user would: a step-level ModelCheckpoint added on the command line, then a resume from a checkpoint
    inside an iteration, its name (which holds '=') quoted; the resumed run ends with the first run's weights."""
    from safetensors.torch import load_file

    job = ["iterations=3", "shape.mini_batches=2", "checkpoint_every=0", "trainer.max_time=null"]
    step_checkpoints = [
        "+callbacks.stepckpt._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        "+callbacks.stepckpt.every_n_train_steps=1",
        "+callbacks.stepckpt.save_top_k=-1",
        f"+callbacks.stepckpt.dirpath={tmp_path / 'ckpts'}",
    ]
    for overrides in (
        [*job, *step_checkpoints, f"run_dir={tmp_path / 'first'}"],
        [*job, f"resume='{tmp_path / 'ckpts' / 'epoch=1-step=3.ckpt'}'", f"run_dir={tmp_path / 'resumed'}"],
    ):
        result = subprocess.run([str(LIT_PARL), *overrides], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
    first, resumed = (load_file(tmp_path / run / "policy" / "model.safetensors") for run in ("first", "resumed"))
    assert first.keys() == resumed.keys() and all(torch.equal(first[name], resumed[name]) for name in first)


# -- 2: bad configuration fails early, before any process -----------------------------------------------
ROWS = {  # data files with one bad row or column, and the message that names it
    "bad_column": (
        '{"question": "12=", "answer": "12"}\n',
        [],
        r"bad_column.jsonl \(split 'train'\) has no column 'prompt'",
    ),
    "empty_prompt": (
        '{"prompt": "12=", "answer": "12"}\n{"prompt": "", "answer": "3"}\n',
        [],
        r"row 1: the prompt is empty",
    ),
    "bad_messages": (
        '{"messages": [{"role": "user", "content": "1="}], "answer": "1"}\n'
        '{"messages": [{"content": "hi"}], "answer": "3"}\n',
        ["data.messages_column=messages", "data.prompt_column=null"],
        r"row 1: message 0 must be a dict with string 'role'",
    ),
}


@pytest.mark.parametrize(
    "case, overrides, message",
    [
        *[
            (name, ["data=jsonl", f"data.path={name}.jsonl", *extra], pattern)
            for name, (_, extra, pattern) in ROWS.items()
        ],
        ("bad_setting", ["shape.group_size=1"], r"config shape: IterationShape\(group_size=1\): GRPO needs at least 2"),
        (
            "missing_value",
            ["model=pretrained"],
            r"Missing mandatory value: model.path: set it on the command line \(model.path=\.\.\.\)",
        ),
        (
            "missing_checkpoint",
            ["resume=nowhere.ckpt"],
            r"resume=nowhere.ckpt: no such checkpoint file or run directory",
        ),
    ],
)
def test_a_bad_setting_or_data_row_prints_one_clear_line(tmp_path, case, overrides, message):
    """What the user gave is refused in one line naming it (the config key, the file, the row), not a traceback."""
    for name, (rows, _, _) in ROWS.items():
        (tmp_path / f"{name}.jsonl").write_text(rows)
    result = subprocess.run(
        [str(LIT_PARL), *overrides, f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(rf"^lit-parl: error: .*{message}", lines[0]), result.stderr[-3000:]


@pytest.mark.parametrize("where", ["reward", "data_source"])
def test_a_failure_in_the_users_code_is_not_taken_for_a_refusal(tmp_path, where):
    """A reward of the user's that raises while training keeps its traceback; a data source of the user's whose
    constructor raises a ValueError is reported by Hydra as raised there, not as lit_parl's one-line refusal."""
    (tmp_path / "my_code.py").write_text(
        "def broken(completion: str) -> float:\n    raise ValueError('a bug of the reward')\n\n\n"
        "class Source:\n    def __init__(self, **settings):\n        raise ValueError('a bug of the source')\n"
    )
    overrides = {
        "reward": [
            "iterations=1",
            "+reward.mine._target_=lit_parl.rewards.Reward",
            "+reward.mine.fn=my_code.py:broken",
        ],
        "data_source": ["data._target_=my_code.Source"],
    }[where]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [str(LIT_PARL), *overrides, f"run_dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 1 and "lit-parl: error:" not in result.stderr, result.stderr[-3000:]
    if where == "reward":
        assert "Traceback" in result.stderr and 'my_code.py", line 2, in broken' in result.stderr, result.stderr[-3000:]
    else:
        assert "Error in call to target 'my_code.Source'" in result.stderr and "a bug of the source" in result.stderr


def _compose_and_build(tmp_path: Path, overrides: list[str]):
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"run_dir={tmp_path}", *overrides])
    return build(cfg)


@pytest.mark.parametrize(
    "overrides, error, fragments",
    [
        (["shape.group_size=1"], InstantiationException, ["group_size=1", "at least 2", "full_key: shape"]),
        (
            ["shape.micro_batch_size=7"],
            InstantiationException,
            ["micro_batch_size=7", "32 prompts x group_size 8 = 256", "full_key: shape"],
        ),
        (["data=nonexistent"], MissingConfigException, ["data/nonexistent", "copy", "reverse"]),
        (["pool=nonexistent"], MissingConfigException, ["pool/nonexistent", "hf"]),
        (
            ["model=pretrained", "model.path=/does/not/exist"],
            InstantiationException,
            ["/does/not/exist", "config.json"],
        ),
        (["model=pretrained"], MissingMandatoryValue, ["model.path"]),
        (["datamodule.mode=bogus"], ValueError, ["config datamodule: ", "mode='bogus'", "async", "sync"]),
        (
            ["shape.mini_batches=3"],
            InstantiationException,
            ["mini_batches=3", "32 prompts", "micro_batch_size=64", "full_key: shape"],
        ),
    ],
    ids=["group_size", "micro_batch_size", "task", "pool", "model_path", "model_path_missing", "mode", "mini_batches"],
)
def test_bad_config_fails_before_any_process(tmp_path, overrides, error, fragments):
    before = _live_children(os.getpid())
    with pytest.raises(error) as excinfo:
        _compose_and_build(tmp_path, overrides)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from the error message:\n{message}"
    if error is InstantiationException:  # the library's own error, not a bare Hydra wrapper
        assert isinstance(excinfo.value.__cause__, (FileNotFoundError, ValueError))
    started = _live_children(os.getpid()) - before
    assert not started, f"a bad configuration started processes: {_describe(started)}"


def test_default_config_builds_without_starting_processes(tmp_path):
    before = _live_children(os.getpid())
    module, datamodule, trainer = _compose_and_build(tmp_path, [])
    try:
        assert isinstance(module, GRPOModule) and isinstance(datamodule, RolloutDataModule)
        assert isinstance(trainer, lightning.Trainer)
        assert datamodule.pool.pids() == [] and not datamodule.pool.health().started
        started = _live_children(os.getpid()) - before
        assert not started, f"build() started processes: {_describe(started)}"
    finally:
        datamodule.pool.close()


# -- 3: the wheel ---------------------------------------------------------------------------------------
def _copy_sources(destination: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (no build/, egg-info, .venv)."""
    try:
        listing = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: copy the tree without build outputs
        ignore = shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "runs", "outputs", "__pycache__", ".pytest_cache"
        )
        shutil.copytree(REPO, destination, ignore=ignore, dirs_exist_ok=True)
        return
    for name in filter(None, listing.split("\0")):
        source = REPO / name
        if source.is_file():  # skip files deleted in the working tree
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


_WHEEL_CHECK = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    site = Path(sys.argv[1]).resolve()

    def under_site(module):
        return Path(module.__file__).resolve().is_relative_to(site)

    import lit_parl, lit_parl.conf
    from lit_parl.callbacks import HFExport, RunSummary, WeightSync
    from lit_parl.kernels import token_logprobs
    import lit_parl.callbacks, lit_parl.kernels
    for module in (lit_parl, lit_parl.conf, lit_parl.callbacks, lit_parl.kernels, sys.modules[WeightSync.__module__]):
        assert under_site(module), (module.__name__, module.__file__)
    assert "kernels" not in sys.modules and "callbacks" not in sys.modules, "a top-level package was imported"

    import torch
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    assert token_logprobs(logits, targets, 1.0).shape == (2, 3)

    from hydra import compose, initialize_config_module
    from hydra.utils import get_class, get_method
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["run_dir=unused"])
        for group in ("model", "data", "reward", "pool", "algorithm", "optimizer", "lr_schedule", "trainer",
                      "logger", "callbacks"):
            assert group in cfg, group
        assert cfg.model._target_ == "lit_parl.models.tiny_qwen2"
        assert cfg.data._target_ == "lit_parl.tasks.CopyTask"
        assert cfg.pool._target_ == "lit_parl.rollout.HFRolloutPool" and cfg.shape.group_size == 8
        assert cfg.algorithm.objective._target_ == "lit_parl.GRPOObjective"
        assert cfg.trainer._target_ == "lightning.Trainer"
        overrides = ["run_dir=unused", "data=reverse", "model=pretrained", "model.path=/x"]
        other = compose(config_name="config", overrides=overrides)
        assert other.data._target_ == "lit_parl.tasks.ReverseTask"
        assert other.model._target_ == "lit_parl.models.pretrained"
    for target in (cfg.model._target_, other.model._target_):
        assert under_site(sys.modules[get_method(target).__module__]), target
    for target in (cfg.data._target_, other.data._target_, cfg.pool._target_, cfg.algorithm.objective._target_):
        assert under_site(sys.modules[get_class(target).__module__]), target
    print("WHEEL OK")
    """
)


@pytest.mark.slow  # make test-slow
def test_wheel_ships_subpackages_and_configs(tmp_path):
    source, dist, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    _copy_sources(source)
    build_run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dist),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build_run.returncode == 0, build_run.stdout[-3000:] + build_run.stderr[-3000:]
    wheels = list(dist.glob("lit_parl-*.whl"))
    assert len(wheels) == 1, wheels
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheels[0])],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    top_level = {p.name for p in site.iterdir() if (p / "__init__.py").exists() or p.suffix == ".py"}
    assert top_level == {"lit_parl"}, f"top-level modules in the wheel: {sorted(top_level)}"
    for name in ("kernels", "callbacks", "conf"):
        assert not (site / name).exists(), f"the wheel installs a top-level {name!r}"
    for config in (REPO / "conf").rglob("*.yaml"):
        config = config.relative_to(REPO / "conf")
        assert (site / "lit_parl" / "conf" / config).is_file(), f"lit_parl/conf/{config} missing from the wheel"
    # a folder that [tool.setuptools] packages leaves out costs the user about 40 lines of warnings at install
    assert "absent from the `packages` configuration" not in build_run.stderr, build_run.stderr[-3000:]

    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    check = subprocess.run(
        [sys.executable, "-c", _WHEEL_CHECK, str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert check.returncode == 0 and "WHEEL OK" in check.stdout, check.stdout[-3000:] + check.stderr[-5000:]


# -- 4: running from the repository root ----------------------------------------------------------------
_ROOT_CHECK = textwrap.dedent(
    """
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("kernels")  # the precondition: our folder shadows the PyPI name here
    assert spec is not None and Path(spec.origin).resolve() == Path("kernels/__init__.py").resolve(), spec

    import importlib.metadata
    import lit_parl
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM
    import transformers.utils.import_utils as u
    import kernels
    try:  # Hugging Face's hub-kernels package, a dependency of transformers from 5.25
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        assert not u.is_kernels_available()  # our folder, which carries no version: taken for absent
    else:  # our folder handed the import over to the installed package
        assert Path(kernels.__file__).resolve() != Path("kernels/__init__.py").resolve(), kernels.__file__

    import torch
    model, tokenizer = lit_parl.tiny_qwen2()
    assert isinstance(model, Qwen2ForCausalLM)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[:2] == (1, 3)
    print("ROOT OK")
    """
)


def _root_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_repo_root_does_not_break_transformers():
    run = subprocess.run(
        [sys.executable, "-c", _ROOT_CHECK],
        cwd=REPO,
        env=_root_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0 and "ROOT OK" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]


def test_from_the_repository_root_import_kernels_is_hugging_faces_package_when_installed(tmp_path):
    """transformers 5.25 depends on Hugging Face's ``kernels`` and imports it as it initialises; from the repository
    root our folder of that name comes first on the path and must hand the import over. A stand-in distribution of
    that name (its metadata and package) is installed into a directory of its own for the check."""
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text('MARK = "hub"\n__version__ = "0.19.1"\n')
    (site / "kernels-0.19.1.dist-info").mkdir()
    (site / "kernels-0.19.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n"
    )
    check = (
        "import kernels, lit_parl.kernels as ours; "
        "assert kernels.MARK == 'hub', kernels.__file__; assert ours.pack is not None; print('HANDED OVER')"
    )
    env = {**_root_env(), "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", check], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "HANDED OVER" in run.stdout, run.stdout[-3000:] + run.stderr[-5000:]


def test_module_help_from_repo_root():
    run = subprocess.run(
        [sys.executable, "-m", "lit_parl", "--help"],
        cwd=REPO,
        env=_root_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "== Configuration groups ==" in run.stdout, run.stdout[-3000:]
    assert (
        "data: calculator, copy, countdown, gsm8k_format, guess_number, jsonl, reverse" in run.stdout
        and "reward: countdown, environment, format, gsm8k, judge, math, model, positional" in run.stdout
        and "env: calculator, guess_number, none" in run.stdout
    ), run.stdout[-3000:]


def test_openmp_threads_sleep_when_idle_unless_the_user_says_otherwise():
    """Spinning idle OpenMP threads in one process steal the cores another process is computing on (sync mode
    measured 14 instead of ~450 completions/s): importing lit_parl sets OMP_WAIT_POLICY=PASSIVE by default, and
    a short spin before sleeping (GOMP_SPINCOUNT=1000, about 10 us) so a team is not woken for every operation, short
    enough that a team whose partner another process descheduled does not spin away the core.
    Either one the user set wins, and a user's wait policy gets no spin count of ours over it."""
    import os
    import subprocess
    import sys

    code = "import lit_parl, os; print(os.environ['OMP_WAIT_POLICY'], os.environ.get('GOMP_SPINCOUNT'))"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def seen(**env: str) -> str:
        run = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True)
        return run.stdout.strip()

    assert seen() == "PASSIVE 1000"
    assert seen(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None"
    assert seen(GOMP_SPINCOUNT="0") == "PASSIVE 0"


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb", "mlflow"])
def test_each_logger_builds_or_names_the_extra_to_install(tmp_path, logger):
    import importlib.util

    package = {"csv": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[logger]
    if package is None or importlib.util.find_spec(package) is not None:
        module, datamodule, trainer = _compose_and_build(tmp_path, [f"logger={logger}"])
        assert type(trainer.logger).__name__.lower().startswith(logger)
    else:
        with pytest.raises(
            ImportError, match=rf"logger={logger} needs {package}.*: pip install 'lit-parl\[{logger}\]'"
        ):
            _compose_and_build(tmp_path, [f"logger={logger}"])
