"""Training from a dataset file with text rewards: every row read once per data epoch, rewards that see the
prompt text, the decoded completion, the answer and the row's metadata, per-reward metrics, and a resumed
run that draws exactly the rows the first had not trained."""

from __future__ import annotations

import json

import lightning
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from helpers.components import BatchRecorder, make_components
from helpers.pools import InProcessPool
from lit_parl.callbacks import WeightSync
from lit_parl.prompts.dataset_prompts import DatasetPrompts
from lit_parl.rewards import Reward

ROWS = [{"prompt": f"{n}{n + 1}=", "answer": f"{n}{n + 1}", "level": n % 3} for n in range(1, 7)]  # 6 rows


def write_rows(path):
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


SEEN = []


def exact_text(prompt, completion, answer, stopped):
    SEEN.append((prompt, answer))
    return float(stopped and completion == answer)


def level_bonus(metadata, completion_ids):
    return {"level": metadata["level"] / 10, "short": float(len(completion_ids) <= 3)}


def components(path, **kwargs):
    return make_components(
        pool=InProcessPool(),
        prompts=4,
        group_size=2,
        micro_batch_size=8,
        task=DatasetPrompts(path=str(path), cache_dir=str(path.parent / "cache")),
        rewards=[Reward(exact_text), Reward(level_bonus, weight=0.5)],
        **kwargs,
    )


def fit(module, data, iterations, callbacks=(), ckpt_path=None, root=None):
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=iterations,
        callbacks=[WeightSync(), *callbacks],
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_dataset_trains_with_text_rewards_reading_every_row_once_per_epoch(tmp_path):
    module, data = components(write_rows(tmp_path / "train.jsonl"))
    recorder = BatchRecorder()
    SEEN.clear()
    trainer = fit(module, data, iterations=3, callbacks=[recorder])  # 12 draws over 6 rows: two data epochs
    rows = [data.schedule.row_index(prompt_id) for prompt_id in range(12)]
    assert sorted(rows[:6]) == sorted(rows[6:]) == list(range(6))
    trained = {(epoch, t.prompt_id) for epoch, batch in recorder.batches for t in batch.trajectories}
    assert {prompt_id for _, prompt_id in trained} == set(range(12))
    # the rewards saw each row's own prompt text and answer
    assert {(ROWS[r]["prompt"], ROWS[r]["answer"]) for r in rows} == set(SEEN)
    # the total is exact_text + 0.5 x (level/10 + short): check one trained sample by hand
    batch = recorder.batches[0][1]
    t = batch.trajectories[0]
    row = ROWS[data.schedule.row_index(t.prompt_id)]
    expected = float(
        t.truncated is False and data.tokenizer.decode(t.completion_tokens, skip_special_tokens=True) == row["answer"]
    )
    expected += 0.5 * (row["level"] / 10 + float(len(t.completion_tokens) <= 3))
    assert t.reward == pytest.approx(expected)
    assert set(t.reward_components) == {"exact_text", "level_bonus/level", "level_bonus/short"}
    for name in ("reward/exact_text", "reward/level_bonus/level", "reward/level_bonus/short"):
        assert name in trainer.callback_metrics


def test_a_resumed_run_draws_exactly_the_rows_it_had_not_trained(tmp_path):
    path = write_rows(tmp_path / "train.jsonl")

    def run(iterations, ckpt_path=None, checkpoint_dir=None):
        module, data = components(path)
        recorder = BatchRecorder()
        callbacks = [recorder] + (
            [ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_last=True)] if checkpoint_dir else []
        )
        fit(module, data, iterations, callbacks, ckpt_path=ckpt_path, root=tmp_path)
        return [
            (epoch, data.schedule.row_index(t.prompt_id), t.prompt_id)
            for epoch, batch in recorder.batches
            for t in batch.trajectories[::2]
        ]

    straight = run(3)
    first = run(1, checkpoint_dir=tmp_path / "ckpt")
    resumed = run(3, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert sorted(first) == sorted(s for s in straight if s[0] == 0)
    assert sorted(resumed) == sorted(s for s in straight if s[0] > 0)  # iterations 1 and 2: the rows not yet trained


def test_resuming_with_other_data_stops(tmp_path):
    path = write_rows(tmp_path / "train.jsonl")
    module, data = components(path)
    fit(module, data, 1, [ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)], root=tmp_path)
    (tmp_path / "other.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[:5]))
    module, data = components(tmp_path / "other.jsonl")
    with pytest.raises(ValueError, match="checkpoint's data had 6 usable prompt rows, this run's has 5"):
        fit(module, data, 2, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), root=tmp_path)


def test_dropped_prompts_are_counted_in_the_log(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    rows = ROWS + [{"prompt": "1" * 40 + "=", "answer": "1", "level": 0}]  # 41 tokens
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.warns(UserWarning, match=r"dropped 1 of 7 prompts longer than 30 tokens \(rows 6\)"):
        module, data = make_components(
            pool=InProcessPool(),
            prompts=4,
            group_size=2,
            micro_batch_size=8,
            task=DatasetPrompts(path=str(tmp_path / "train.jsonl"), cache_dir=str(tmp_path / "cache")),
            rewards=[Reward(exact_text)],
            datamodule_kwargs={"prompt_format": {"max_prompt_tokens": 30, "overlong": "drop"}},
        )
    logger = CSVLogger(tmp_path, name="log", version=0)
    lightning.Trainer(
        accelerator="cpu",
        max_epochs=1,
        callbacks=[WeightSync()],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    header, *lines = (tmp_path / "log" / "version_0" / "metrics.csv").read_text().splitlines()
    column = header.split(",").index("data/dropped_prompts")
    assert [line.split(",")[column] for line in lines if line.split(",")[column]] == ["1.0"]
