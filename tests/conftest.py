"""Fixtures shared by the whole suite. What tests import lives in ``tests/helpers/``."""

from __future__ import annotations

import os
import tempfile

import pytest

from lit_parl.models import tiny_qwen2
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rollout import HFRolloutPool


@pytest.fixture(scope="session", autouse=True)
def contained_tmpdir(tmp_path_factory):
    """Every temporary file of the session, ours and our children's, goes under pytest's own base directory.

    A process a test kills on purpose (a rank, a server) cannot remove what it made in the temporary directory (a
    saved model, a socket, torch's shared-memory manager directory): left in ``/tmp`` they pile up run after run.
    Here they land in one directory of pytest's, which pytest removes once it is three sessions old (not at the end
    of this one: this process's own ``multiprocessing`` directory is in it until the interpreter exits).
    """
    directory = tmp_path_factory.getbasetemp() / "TMPDIR"
    directory.mkdir()
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(directory)
    tempfile.tempdir = None  # gettempdir() caches its answer: read TMPDIR again
    yield directory
    if previous is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = previous
    tempfile.tempdir = None


@pytest.fixture
def hf_pool():
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tok():
    """The character tokenizer of the tiny models."""
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model():
    """The tiny random-init Qwen2 (seed 0), in eval mode."""
    policy, _ = tiny_qwen2(seed=0)
    return policy.eval()
