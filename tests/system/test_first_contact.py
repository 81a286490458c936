"""What a new user meets first through ``lit-parl``: a mistake on the command line, a setting that cannot run or an
extra that is not installed gets one line that names the fix, before any process starts; ``--help`` answers
without loading the training stack.

The command-line mistakes run the CLI in a subprocess (it answers before torch is imported, so in about a
second); the settings that need the built objects run ``lit_parl.cli.main`` in this process, where torch and
Lightning are already loaded, with the missing package simulated by ``sys.modules[name] = None`` (``import`` then
fails, and ``importlib.util.find_spec`` finds nothing).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from hydra.core.global_hydra import GlobalHydra

import lit_parl.cli as cli

# what ``import lit_parl.cli`` must not load: the job imports them when it runs
HEAVY = (
    "torch",
    "lightning",
    "transformers",
    "datasets",
    "matplotlib",
    "lit_parl.callbacks",
    "lit_parl.data",
    "lit_parl.rollout",
    "lit_parl.trainer",
)


def _cli(*args: str, blocked: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess:
    """``lit-parl *args`` in a fresh process, with the packages ``blocked`` made unimportable."""
    code = textwrap.dedent(
        f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None
        sys.argv = ["lit-parl", *sys.argv[1:]]
        from lit_parl.cli import main
        main()
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("lit-parl: error: "), result.stderr[
        -3000:
    ]
    return lines[0]


def test_import_of_the_cli_loads_no_training_stack():
    code = f"import sys, lit_parl.cli; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-3000:]


def test_help_names_the_app_lit_parl():
    result = _cli("--help")
    assert result.returncode == 0 and result.stdout.startswith("lit-parl is powered by Hydra"), result.stdout[:500]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["shape.prompt=8"], "shape.prompt=8: the config has no key shape.prompt; did you mean shape.prompts=8?"),
        (
            ["resume=runs/x/checkpoints/epoch=1-step=2.ckpt"],
            "quote the value: \"resume='runs/x/checkpoints/epoch=1-step=2.ckpt'\" (or pass the run directory)",
        ),
        (["pool=sglan"], "Could not find 'pool/sglan'; available options in 'pool': hf, sglang, vllm, vllm_gpu"),
    ],
    ids=["unknown_key", "unquoted_equals", "unknown_option"],
)
def test_a_command_line_hydra_refuses_gets_one_line_that_names_the_fix(tmp_path, args, expected):
    line = _one_error_line(_cli(*args, f"run_dir={tmp_path}"))
    assert expected in line, line


def test_a_missing_extra_is_one_line_through_the_cli(tmp_path):
    line = _one_error_line(_cli("lora=r16", f"run_dir={tmp_path}", blocked=("peft",), timeout=300))
    assert line == (
        "lit-parl: error: LoRA (lora=r16, module.lora) needs peft, which is not installed: pip install 'lit-parl[lora]'"
    )


def _main(monkeypatch, *args: str) -> str:
    """``lit-parl *args`` run in this process: the one line it exits with."""
    monkeypatch.setattr(sys, "argv", ["lit-parl", *args])
    try:
        with pytest.raises(SystemExit) as exited:
            cli.main()
    finally:
        GlobalHydra.instance().clear()
    message = str(exited.value.code)
    assert len(message.splitlines()) == 1 and message.startswith("lit-parl: error: "), message
    return message


@pytest.mark.parametrize(
    "args, blocked, expected",
    [
        (["lora=r16"], ("peft",), "pip install 'lit-parl[lora]'"),
        (["logger=tensorboard"], ("tensorboard", "tensorboardX"), "pip install 'lit-parl[tensorboard]' (or use"),
        (
            ["logger=wandb"],
            ("wandb",),
            "logger=wandb needs wandb, which is not installed: pip install 'lit-parl[wandb]'",
        ),
        (["logger=mlflow"], ("mlflow",), "pip install 'lit-parl[mlflow]'"),
        (["reward=math"], ("math_verify",), "needs math_verify, which is not installed: pip install 'lit-parl[math]'"),
        (["trainer=deepspeed", "trainer.accelerator=cpu"], ("deepspeed",), "pip install 'lit-parl[deepspeed]'"),
        (
            ["model=smollm2"],
            ("gguf",),
            "model=smollm2 needs gguf, which is not installed: pip install 'lit-parl[smollm2]'",
        ),
        (["pool=vllm"], ("vllm",), "pool=vllm needs vllm, which is not installed: pip install 'lit-parl[vllm]'"),
        (["pool=sglang"], ("sglang",), "launching SGLang servers needs sglang, which is not installed"),
        (["pool=sglang", "pool.servers.urls=[http://127.0.0.1:9]"], ("aiohttp",), "pip install 'lit-parl[sglang]'"),
    ],
    ids=[
        "lora",
        "tensorboard",
        "wandb",
        "mlflow",
        "math",
        "deepspeed",
        "smollm2",
        "vllm",
        "sglang",
        "aiohttp",
    ],
)
def test_each_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, args, blocked, expected):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "lit_parl.rewards.math_answers", raising=False)  # it requires at import
    message = _main(monkeypatch, *args, "iterations=1", f"run_dir={tmp_path}")
    assert expected in message, message


@pytest.mark.parametrize(
    "backend, package, extra", [("flash", "flash_attn", "flash-attn"), ("npu", "torch_npu", "torch-npu")]
)
def test_an_attention_backend_whose_package_is_missing_names_its_extra(monkeypatch, backend, package, extra):
    """On its device (which this machine lacks, so the check is called as ``build`` calls it), the refusal is the
    same one-line ``MissingExtra``."""
    from lit_parl.extras import MissingExtra
    from lit_parl.kernels.backends import resolve_backend

    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingExtra, match=re.escape(f"pip install 'lit-parl[{extra}]'")) as refused:
        resolve_backend(backend, {"flash": "cuda", "npu": "npu"}[backend])
    assert cli.refusal_message(refused.value) == str(refused.value)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["iterations=0"], "lit-parl: error: iterations=0 trains nothing: set iterations to 1 or more"),
        (["optimizer.lr=-1e-3"], "lit-parl: error: config optimizer: Invalid learning rate: -0.001"),
        (
            ["trainer=ddp", "trainer.devices=3"],
            "set shape.prompts=48, or shape.prompts=33 shape.micro_batch_size=44, or trainer.devices=2",
        ),
    ],
    ids=["no_iterations", "negative_lr", "ranks_split"],
)
def test_a_setting_that_cannot_run_is_refused_before_the_fit(tmp_path, monkeypatch, args, expected):
    """Before ``trainer.fit``: no pool, no rank started, so the message comes once."""
    import lightning

    def no_fit(*args, **kwargs):
        raise AssertionError("trainer.fit started")

    monkeypatch.setattr(lightning.Trainer, "fit", no_fit)
    message = _main(monkeypatch, *args, f"run_dir={tmp_path}")
    assert expected in message, message


def test_a_ddp_fit_prints_no_advice_to_sync_lit_parls_own_metrics(tmp_path):
    """Lightning advises ``sync_dist=True`` once per metric logged per epoch under a process group (21 lines in a
    ``trainer=ddp`` run); lit_parl's are reduced already or rank 0's own. DDP on one device has the group, fast."""
    args = ["trainer=ddp", "trainer.devices=1", "iterations=2", "shape.prompts=8", "shape.micro_batch_size=16"]
    result = subprocess.run(
        [sys.executable, "-m", "lit_parl", *args, "checkpoint_every=0", f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sync_dist=True" not in result.stderr + result.stdout, result.stderr[-3000:]


def test_an_attached_server_that_does_not_answer_is_one_line_naming_the_setting(tmp_path, monkeypatch):
    args = ["pool=sglang", "pool.servers.urls=[http://127.0.0.1:9]", "pool.servers.attach_timeout_s=1"]
    message = _main(monkeypatch, *args, "iterations=1", f"run_dir={tmp_path}")
    assert "SGLang server http://127.0.0.1:9 is not healthy after 1 s" in message, message
    assert message.endswith("Check pool.servers.urls, and that the server runs."), message


def test_a_run_prints_each_message_once_and_a_pool_that_cannot_start_one_error_line(tmp_path):
    """Through the CLI as a user runs it: Lightning's messages appear once (Hydra's handler on the root logger printed
    each a second time), and a pool that cannot start ends the run with its one line, no traceback."""
    args = ["pool=sglang", "pool.servers.urls=[http://127.0.0.1:9]", "pool.servers.attach_timeout_s=1"]
    result = _cli(*args, "iterations=1", f"run_dir={tmp_path}")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip("- \n")]
    assert len([line for line in lines if "GPU available" in line]) == 1, f"a message printed twice: {lines}"
    errors = [line for line in lines if line.startswith("lit-parl: error: ")]
    assert result.returncode == 1 and len(errors) == 1 and "Traceback" not in result.stderr, lines


def test_an_attention_backend_this_device_cannot_run_is_one_line(tmp_path, monkeypatch):
    message = _main(monkeypatch, "module.attention_backend=flex", "iterations=1", f"run_dir={tmp_path}")
    assert "attention backend 'flex' cannot run on cpu" in message and "Available here" in message, message
