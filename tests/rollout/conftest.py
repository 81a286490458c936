"""Fixtures of the SGLang pool's tests: the tiny model saved as a model directory, as a pool starts from it."""

from __future__ import annotations

import pytest

from helpers.sglang_pools import save_spec
from lit_parl.models import tiny_qwen2
from lit_parl.rollout import PoolSpec


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> PoolSpec:
    model, tokenizer = tiny_qwen2(seed=0)
    return save_spec(model, tokenizer, tmp_path_factory.mktemp("spec") / "model")


@pytest.fixture()
def saved_model(tmp_path):
    model, tokenizer = tiny_qwen2(seed=0)
    spec = save_spec(model, tokenizer, tmp_path / "model")
    return model, spec, tmp_path / "model"
