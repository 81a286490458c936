"""Learned rewards through the CLI, as a user runs them: ``reward=model reward.model.path=...`` and ``reward=judge
reward.judge.url=...``, each beside the rule reward (``reward=[positional,...]``): both logged, the total their
weighted sum, scored once per sample; the reward model's running normalisation kept in the checkpoint, and a resumed
run going on from it."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.judge_server import JudgeServer
from lit_parl import tiny_reward_model


def run_cli(overrides: list[str], run_dir) -> list[dict]:
    from hydra import compose, initialize_config_module

    import lit_parl.cli as cli

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*overrides, f"run_dir={run_dir}", "shape.prompts=8"])
    cli.run(cfg)
    (metrics,) = run_dir.rglob("metrics.csv")
    with open(metrics) as f:
        return [row for row in csv.DictReader(f) if row.get("reward")]


def judged_run(server: JudgeServer, tmp_path, *overrides: str) -> list[dict]:
    """Two iterations of the default job with the judge at ``server`` beside the positional reward."""
    server.start()
    try:
        judge = ["reward=[positional,judge]", f"reward.judge.url={server.url}", "iterations=2", "checkpoint_every=0"]
        return run_cli([*judge, *overrides], tmp_path / "run")
    finally:
        server.stop()


def test_a_reward_model_beside_the_rule_reward(tmp_path):
    model, tokenizer = tiny_reward_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, seed=1)
    model.save_pretrained(tmp_path / "rm"), tokenizer.save_pretrained(tmp_path / "rm")
    rows = run_cli(
        [
            "reward=[positional,model]",
            f"reward.model.path={tmp_path / 'rm'}",
            "reward.model.weight=0.5",
            "reward.model.normalize=running",
            "iterations=2",
            "checkpoint_every=1",
        ],
        tmp_path / "run",
    )
    assert len(rows) == 2
    for row in rows:
        total = float(row["reward/positional"]) + 0.5 * float(row["reward/model"])
        assert float(row["reward"]) == pytest.approx(total, abs=1e-5)
    (checkpoint,) = (tmp_path / "run").rglob("last.ckpt")
    state = torch.load(checkpoint, weights_only=False)["RolloutDataModule"]
    assert state["rewards"]["model"]["count"] == 2 * 8 * 8  # every sample of both iterations, scored once
    resumed = [
        *("reward=[positional,model]", f"reward.model.path={tmp_path / 'rm'}", "reward.model.normalize=running"),
        *("iterations=3", "checkpoint_every=1", f"resume={checkpoint}"),
    ]
    run_cli(resumed, tmp_path / "resumed")
    (checkpoint,) = (tmp_path / "resumed").rglob("last.ckpt")
    state = torch.load(checkpoint, weights_only=False)["RolloutDataModule"]
    assert state["rewards"]["model"]["count"] == 3 * 8 * 8  # the statistics went on from the checkpoint's


def test_a_judge_beside_the_rule_reward(tmp_path):
    server = JudgeServer()
    rows = judged_run(server, tmp_path, "reward.judge.rubric='{completion}'")
    assert len(rows) == 2
    for row in rows:
        assert 0.0 <= float(row["reward/judge"]) <= 1.0
        total = float(row["reward/positional"]) + float(row["reward/judge"])
        assert float(row["reward"]) == pytest.approx(total, abs=1e-5)
    assert len(server.requests) <= 2 * 8 * 8  # at most one request per sample: repeats come from the cache


def test_a_judge_that_fails_on_every_sample_is_logged_as_failures_not_left_out(tmp_path):
    refusing = JudgeServer(answer=lambda text: "I cannot grade this.")  # no score: every verdict refused
    rows = judged_run(refusing, tmp_path, "datamodule.scoring.on_error=score")
    assert len(rows) == 2
    for row in rows:
        assert float(row["reward/judge/failures"]) == 8 * 8  # every sample's call, counted
        assert row.get("reward/judge", "") == ""  # a mean of no scored sample is not logged as a number
        assert float(row["reward/positional/failures"]) == 0


@pytest.mark.slow  # a 2-process fit: make test-slow
def test_under_two_ranks_each_sample_is_scored_once_on_the_rank_that_trains_it(tmp_path):
    """``lit-parl trainer=ddp trainer.devices=2 reward=[positional,model]``: each rank scores the samples it trains
    and no other, so rank 0's running statistics (what the checkpoint keeps) count exactly half of the samples."""
    model, tokenizer = tiny_reward_model(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, seed=1)
    model.save_pretrained(tmp_path / "rm"), tokenizer.save_pretrained(tmp_path / "rm")
    command = [
        *(str(Path(sys.executable).parent / "lit-parl"), "trainer=ddp", "trainer.devices=2"),
        *("reward=[positional,model]", f"reward.model.path={tmp_path / 'rm'}", "reward.model.normalize=running"),
        *("iterations=2", "shape.prompts=8", "shape.micro_batch_size=16", "checkpoint_every=1"),
        f"run_dir={tmp_path / 'run'}",
    ]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["completions"] == 2 * 8 * 8  # iterations x prompts x group_size, both ranks
    (checkpoint,) = (tmp_path / "run").rglob("last.ckpt")
    state = torch.load(checkpoint, weights_only=False)["RolloutDataModule"]
    assert state["rewards"]["model"]["count"] == 2 * 8 * 8 // 2  # rank 0's half, each sample once
