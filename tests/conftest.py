"""Fixtures shared by the whole suite. What tests import lives in ``tests/helpers/``."""

from __future__ import annotations

import pytest

from lit_parl.models import tiny_qwen2
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rollout import HFRolloutPool


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
