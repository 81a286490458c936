"""The CLI's run end to end: the summary, the metrics file and the Hugging Face export, which reloads in
transformers."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lit_parl import tiny_qwen2


def test_cli_run_summary_metrics_and_hf_export(tmp_path, monkeypatch, capsys):
    from hydra import compose, initialize_config_module

    import lit_parl.cli as cli

    run_dir = tmp_path / "run"
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["iterations=2", f"run_dir={run_dir}", "checkpoint_every=0"])

    built = {}
    real_build = cli.build

    def capturing_build(config):
        module, datamodule, trainer = real_build(config)
        built["module"], built["datamodule"] = module, datamodule
        return module, datamodule, trainer

    monkeypatch.setattr(cli, "build", capturing_build)
    summary = cli.run(cfg)

    # the summary
    keys = {
        "iterations",
        "mode",
        "reward_first",
        "reward_last10",
        "wall_s",
        "completions_per_s",
        "tokens_per_s",
        "gen_busy_s",
        "train_busy_s",
        "run_dir",
    }
    assert keys <= summary.keys()
    assert summary["iterations"] == 2
    assert summary["mode"] == cfg.datamodule.mode
    assert summary["run_dir"] == str(run_dir.resolve())
    samples = cfg.shape.prompts * cfg.shape.group_size
    if "completions" in summary:
        assert summary["completions"] == 2 * samples
    assert summary["wall_s"] > 0 and summary["completions_per_s"] > 0 and summary["tokens_per_s"] > 0
    # every completion has between 1 and max_new_tokens tokens
    max_new = cfg.sampling.max_new_tokens
    assert (
        summary["completions_per_s"] <= summary["tokens_per_s"] + 0.01 <= max_new * summary["completions_per_s"] + 0.02
    )
    assert summary["completions_per_s"] == pytest.approx(2 * samples / summary["wall_s"], rel=0.01)
    assert summary["gen_busy_s"] > 0 and summary["train_busy_s"] > 0
    assert 0.0 <= summary["reward_first"] <= 1.0 and 0.0 <= summary["reward_last10"] <= 1.0

    # summary.json and the printed line carry the same dict
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lit_parl summary: ")]
    assert len(lines) == 1
    assert json.loads(lines[0][len("lit_parl summary: ") :]) == summary

    # metrics.csv: one row per iteration with the reward; the summary's rewards are those rewards
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert "reward" in rows[0].keys()
    rewarded = [row for row in rows if row.get("reward")]
    assert len(rewarded) == 2
    rewards = [float(row["reward"]) for row in rewarded]
    assert summary["reward_first"] == pytest.approx(rewards[0], abs=1e-6)
    assert summary["reward_last10"] == pytest.approx(sum(rewards) / 2, abs=1e-6)
    # and the reward is the mean of the iteration's samples' rewards (datamodule history)
    history = built["datamodule"].history
    assert len(history) == 2 and all(stats.completions == samples for stats in history)

    # the Hugging Face export loads with the Auto classes and is the trained policy
    module = built["module"]
    policy_dir = run_dir / "policy"
    loaded = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    loaded_tok = AutoTokenizer.from_pretrained(policy_dir)
    text = "3917=7193"
    assert loaded_tok(text).input_ids == module.tokenizer(text).input_ids
    assert (loaded_tok.pad_token_id, loaded_tok.eos_token_id) == (
        module.tokenizer.pad_token_id,
        module.tokenizer.eos_token_id,
    )
    ids = torch.tensor([loaded_tok(text).input_ids, loaded_tok("0123456789").input_ids[:9]])
    trained = module.policy.eval()
    initial, _ = tiny_qwen2(seed=cfg.seed)
    with torch.no_grad():
        exported_logits = loaded(input_ids=ids, use_cache=False).logits
        trained_logits = trained(input_ids=ids, use_cache=False).logits
        initial_logits = initial.eval()(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(exported_logits, trained_logits, atol=1e-6, rtol=1e-6)
    assert (trained_logits - initial_logits).abs().max() > 1e-4, "two iterations of training changed nothing"
    assert loaded.config.vocab_size == len(loaded_tok)


def test_the_default_progress_bar_is_redrawn_a_few_times_a_second(tmp_path):
    """Lightning's own default redraws the bar after every step (100 a second), in a thread that takes the
    trainer's core between steps; the default job's steps are tens of milliseconds apart."""
    from hydra import compose, initialize_config_module
    from lightning.pytorch.callbacks import RichProgressBar

    import lit_parl.cli as cli

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=["iterations=1", "checkpoint_every=0", f"run_dir={tmp_path}"])
    _, _, trainer = cli.build(cfg)
    bars = [c for c in trainer.callbacks if isinstance(c, RichProgressBar)]
    assert len(bars) == 1 and trainer.progress_bar_callback is bars[0]
    assert 0 < bars[0].refresh_rate <= 10
