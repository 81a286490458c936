"""CompletionSamples writes, every N iterations and at the last, the first groups the trainer trained on:
decoded as the model saw and wrote them, with the rewards and advantages training used, to a JSONL file
and to any logger with a table."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning
import pytest
from lightning.pytorch.loggers import CSVLogger

from helpers.components import BatchRecorder, make_components
from helpers.pools import InProcessPool
from lit_parl import GRPOObjective
from lit_parl.callbacks import CompletionSamples, WeightSync, load_samples
from lit_parl.tasks import CopyTask

pytestmark = pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")

GROUP_SIZE = 4
KEPT_PROMPTS = 2  # of the iteration's 4


class LengthTask(CopyTask):
    """Rewards the completion's length: a random policy's rewards differ within a group (copying scores ~0)."""

    def reward(self, answer_ids, completion_ids, eos_id) -> float:
        return len(completion_ids) / 6


class TableLogger(CSVLogger):
    """A logger with ``WandbLogger``'s ``log_table`` signature that records what it is sent."""

    def __init__(self, save_dir) -> None:
        super().__init__(save_dir)
        self.tables: list[dict] = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        self.tables.append({"key": key, "columns": columns, "data": data, "step": step})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 3-iteration fit, writing iterations 1 (every second one) and 2 (the last)."""
    tmp = tmp_path_factory.mktemp("samples")
    module, datamodule = make_components(
        pool=InProcessPool(),
        prompts=4,
        group_size=GROUP_SIZE,
        micro_batch_size=8,
        task=LengthTask(),
        objective=GRPOObjective(overlong_buffer=2),
    )  # shaped rewards differ from the task's
    recorder, logger = BatchRecorder(), TableLogger(tmp / "logs")
    samples = CompletionSamples(dirpath=str(tmp), every_n_iterations=2, prompts=KEPT_PROMPTS)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        callbacks=[WeightSync(), recorder, samples],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule)
    return SimpleNamespace(
        rows=load_samples(tmp / "samples.jsonl"),
        recorder=recorder,
        logger=logger,
        tokenizer=module.tokenizer,
        datamodule=datamodule,
        trainer=trainer,
    )


def _trained(recorder: BatchRecorder) -> dict[tuple[int, int, int], tuple]:
    """(iteration, prompt_id, sample_index) -> (trajectory, reward, advantage, truncated, correct) as trained."""
    trained = {}
    for epoch, batch in recorder.batches:
        if batch.pass_index == 0:
            for i, t in enumerate(batch.trajectories):
                trained[(epoch, t.prompt_id, t.sample_index)] = (
                    t,
                    batch.rewards[i].item(),
                    batch.advantages[i].item(),
                    bool(batch.truncated[i]),
                    bool(batch.correct[i]),
                )
    return trained


def test_only_due_iterations_are_written_with_the_first_groups_whole(run):
    keys = [(row["iteration"], row["prompt_id"], row["sample_index"]) for row in run.rows]
    assert sorted({it for it, _, _ in keys}) == [1, 2]
    assert len(keys) == len(set(keys)) == 2 * KEPT_PROMPTS * GROUP_SIZE
    for iteration in (1, 2):
        first_seen = list(dict.fromkeys(p for it, p, _ in run.recorder.samples() if it == iteration))
        written = [(p, k) for it, p, k in keys if it == iteration]
        assert written == [(p, k) for p in first_seen[:KEPT_PROMPTS] for k in range(GROUP_SIZE)]
        assert {row["version"] for row in run.rows if row["iteration"] == iteration} == {iteration}


def test_rows_hold_the_decoded_text_and_the_values_training_used(run):
    trained = _trained(run.recorder)
    schedule = run.datamodule.schedule
    for row in run.rows:
        t, reward, advantage, truncated, correct = trained[(row["iteration"], row["prompt_id"], row["sample_index"])]
        # the prompt from the data module's own schedule, not from what the callback saw
        drawn = schedule.draw([row["prompt_id"]], row["version"])[row["prompt_id"]]
        assert (
            row["prompt"]
            == run.tokenizer.decode(list(drawn.request.prompt_tokens), skip_special_tokens=False)
            == drawn.text
        )
        assert row["completion"] == run.tokenizer.decode(t.completion_tokens, skip_special_tokens=False)
        assert (row["reward"], row["advantage"], row["truncated"], row["correct"]) == (
            reward,
            advantage,
            truncated,
            correct,
        )
        assert row["reward_components"] == t.reward_components and "positional" in row["reward_components"]
        assert row["reward_failures"] == list(t.reward_failures)
    # the checks above see special tokens: some completion ends with the end token, whose text stays
    assert any(row["completion"].endswith(run.tokenizer.eos_token) for row in run.rows)
    assert len({row["advantage"] for row in run.rows}) > 1 and len({row["reward"] for row in run.rows}) > 1
    assert any(row["reward"] != row["advantage"] for row in run.rows)
    assert any(
        trained[key][0].shaped_reward != trained[key][1] for key in trained
    )  # the reward is the task's, not the shaped one


def test_a_table_logger_receives_the_rows(run):
    tables = run.logger.tables
    assert [table["key"] for table in tables] == ["samples", "samples"]
    assert tables[0]["step"] < tables[1]["step"] == run.trainer.global_step
    columns = tables[0]["columns"]
    assert columns[:6] == ["iteration", "version", "prompt_id", "sample_index", "prompt", "completion"]
    assert "reward/positional" in columns
    logged = [dict(zip(table["columns"], line)) for table in tables for line in table["data"]]
    assert len(logged) == len(run.rows)
    for line, row in zip(logged, run.rows):
        assert (
            line["iteration"],
            line["prompt_id"],
            line["prompt"],
            line["completion"],
            line["reward"],
            line["advantage"],
        ) == (row["iteration"], row["prompt_id"], row["prompt"], row["completion"], row["reward"], row["advantage"])
        assert line["reward/positional"] == row["reward_components"]["positional"]


# -- the callback alone, driven with stand-ins -----------------------------------------------------------
class Tokenizer:
    def batch_decode(self, sequences, skip_special_tokens=False):
        return ["|".join(map(str, ids)) for ids in sequences]


def _sample(prompt_id, k, version=0):
    return SimpleNamespace(
        prompt_id=prompt_id,
        sample_index=k,
        version=version,
        prompt_tokens=[prompt_id],
        completion_tokens=[k, 0],
        reward=float(k),
        advantage=k - 1.5,
        truncated=False,
        correct=False,
        reward_components={"exact": float(k)},
        reward_failures=(),
    )


def _trainer(epoch, max_epochs=10, loggers=()):
    return SimpleNamespace(
        current_epoch=epoch,
        max_epochs=max_epochs,
        max_steps=-1,
        global_step=epoch,
        should_stop=False,
        is_global_zero=True,
        default_root_dir=".",
        loggers=list(loggers),
    )


def _epoch(samples, trainer, batches):
    module = SimpleNamespace(tokenizer=Tokenizer())
    samples.on_train_epoch_start(trainer, module)
    for i, batch in enumerate(batches):
        samples.on_train_batch_end(trainer, module, None, batch, i)
    samples.on_train_epoch_end(trainer, module)


def test_groups_split_over_micro_batches_are_kept_whole_and_replays_skipped(tmp_path):
    samples = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=3, prompts=2)
    samples.on_fit_start(_trainer(0), SimpleNamespace(tokenizer=Tokenizer()))
    # group size 4 over micro-batches of 2, samples out of order; then a second pass that must not count
    first = [
        SimpleNamespace(pass_index=0, trajectories=[_sample(p, k + 1), _sample(p, k)])
        for p in (7, 5, 9)
        for k in (0, 2)
    ]
    replay = [SimpleNamespace(pass_index=1, trajectories=[_sample(p, k) for k in range(4)]) for p in (7, 1)]
    for epoch in range(3):
        _epoch(samples, _trainer(epoch), [*first, *replay])
    rows = load_samples(samples.path)
    assert [(r["iteration"], r["prompt_id"], r["sample_index"]) for r in rows] == [
        (2, p, k) for p in (7, 5) for k in range(4)
    ]
    assert (rows[0]["prompt"], rows[1]["completion"], rows[1]["advantage"]) == ("7", "1|0", -0.5)
    assert samples.rows_written == 8


def test_the_last_iteration_is_written_and_log_text_gets_strings(tmp_path):
    logged = []
    text_logger = SimpleNamespace(log_text=lambda **kwargs: logged.append(kwargs))
    samples = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=50, prompts=1)
    samples.on_fit_start(_trainer(0), SimpleNamespace(tokenizer=Tokenizer()))
    for epoch in range(3):
        _epoch(
            samples,
            _trainer(epoch, max_epochs=3, loggers=[text_logger]),
            [SimpleNamespace(trajectories=[_sample(4, 0), _sample(4, 1)])],
        )
    assert [(r["iteration"], r["sample_index"]) for r in load_samples(samples.path)] == [(2, 0), (2, 1)]
    assert [call["step"] for call in logged] == [2]
    assert all(isinstance(value, str) for line in logged[0]["data"] for value in line)
    assert dict(zip(logged[0]["columns"], logged[0]["data"][1]))["reward/exact"] == "1.0"


def test_only_global_rank_zero_writes_and_logs(tmp_path):
    logged = []
    samples = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=1)
    other_rank = SimpleNamespace(
        **{
            **vars(_trainer(0, loggers=[SimpleNamespace(log_table=lambda **kw: logged.append(kw))])),
            "is_global_zero": False,
        }
    )
    samples.on_fit_start(other_rank, SimpleNamespace(tokenizer=Tokenizer()))
    _epoch(samples, other_rank, [SimpleNamespace(trajectories=[_sample(1, 0)])])
    assert not samples.path.exists() and logged == [] and samples.rows_written == 0


def test_a_resumed_run_drops_the_lines_after_its_checkpoint_and_appends(tmp_path):
    samples = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=1, prompts=1)
    samples.on_fit_start(_trainer(0), SimpleNamespace(tokenizer=Tokenizer()))
    for epoch in range(3):
        _epoch(samples, _trainer(epoch), [SimpleNamespace(trajectories=[_sample(epoch, 0)], pass_index=0)])
        if epoch == 0:
            checkpoint = json.loads(json.dumps(samples.state_dict()))
    resumed = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=1, prompts=1)
    resumed.load_state_dict(checkpoint)
    resumed.on_fit_start(_trainer(1), SimpleNamespace(tokenizer=Tokenizer()))
    assert [r["iteration"] for r in load_samples(resumed.path)] == [0]
    _epoch(resumed, _trainer(1), [SimpleNamespace(trajectories=[_sample(1, 0)], pass_index=0)])
    assert [r["iteration"] for r in load_samples(resumed.path)] == [0, 1]
    # a fresh run into the same directory appends
    fresh = CompletionSamples(dirpath=str(tmp_path), every_n_iterations=1, prompts=1)
    fresh.on_fit_start(_trainer(0), SimpleNamespace(tokenizer=Tokenizer()))
    _epoch(fresh, _trainer(0), [SimpleNamespace(trajectories=[_sample(0, 0)], pass_index=0)])
    assert [r["iteration"] for r in load_samples(fresh.path)] == [0, 1, 0]


def test_a_module_without_a_tokenizer_fails_at_fit_start(tmp_path):
    module, datamodule = make_components(pool=InProcessPool(), prompts=2, group_size=2, micro_batch_size=4)
    module.tokenizer = None
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[WeightSync(), CompletionSamples(dirpath=str(tmp_path))],
    )
    with pytest.raises(
        TypeError,
        match=r"CompletionSamples needs the LightningModule to satisfy lit_parl.callbacks.HasTokenizer, "
        r"but GRPOModule has no `tokenizer.batch_decode`\. Set `self.tokenizer`",
    ):
        trainer.fit(module, datamodule=datamodule)
    with pytest.raises(TypeError, match=r"but object has no `tokenizer`"):
        CompletionSamples().on_fit_start(_trainer(0), object())


def test_a_batch_without_trajectories_fails_naming_the_contract(tmp_path):
    samples = CompletionSamples(dirpath=str(tmp_path))
    samples.on_fit_start(_trainer(0), SimpleNamespace(tokenizer=Tokenizer()))
    with pytest.raises(
        TypeError,
        match=r"each training batch to satisfy lit_parl.callbacks.SampleBatch, but dict has no `trajectories`",
    ):
        samples.on_train_batch_end(_trainer(0), None, None, {"input_ids": [1]}, 0)
    broken = SimpleNamespace(trajectories=[SimpleNamespace(prompt_id=1)])
    with pytest.raises(TypeError, match=r"SampleRecord, but SimpleNamespace has no `sample_index`, `version`"):
        samples.on_train_batch_end(_trainer(0), None, None, broken, 0)


@pytest.mark.parametrize("setting", [{"every_n_iterations": 0}, {"prompts": 0}])
def test_bad_settings_are_refused(setting):
    with pytest.raises(ValueError, match=f"CompletionSamples\\({next(iter(setting))}=0\\)"):
        CompletionSamples(**setting)
