"""The initial policy's temporary directory never outlives the run that made it."""

import gc
import os
import subprocess
import sys

from lit_parl.data.initial_model_dir import InitialModelDir
from lit_parl.models import tiny_qwen2


def test_the_directory_goes_with_its_owner_when_nobody_removes_it():
    policy, tokenizer = tiny_qwen2()
    saved = InitialModelDir(policy, tokenizer)
    directory = saved.path()
    assert os.path.isfile(os.path.join(directory, "config.json"))
    del saved  # a datamodule dropped without teardown (a notebook, a script that never fit)
    gc.collect()
    assert not os.path.exists(directory)


def test_the_directory_goes_when_the_interpreter_exits_first():
    script = (
        "from lit_parl.data.initial_model_dir import InitialModelDir\n"
        "from lit_parl.models import tiny_qwen2\n"
        "saved = InitialModelDir(*tiny_qwen2())\n"
        "print(saved.path())\n"  # still referenced at exit: nothing calls remove()
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    directory = result.stdout.strip().splitlines()[-1]
    assert directory and not os.path.exists(directory)


def test_remove_is_idempotent_and_a_given_path_is_never_removed(tmp_path):
    policy, tokenizer = tiny_qwen2()
    saved = InitialModelDir(policy, tokenizer)
    directory = saved.path()
    saved.remove()
    saved.remove()
    assert not os.path.exists(directory)
    given = InitialModelDir(str(tmp_path), tokenizer)
    assert given.path() == str(tmp_path)
    given.remove()
    assert tmp_path.exists()
