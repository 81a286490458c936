"""lit_parl's callbacks in a foreign Lightning project: they work with any module and datamodule that meet
their contracts (``lit_parl.callbacks.contracts``), and fail when fit starts, saying what is missing, when
one does not.

Nothing here uses lit_parl's own module or datamodule: the project below is written from scratch.
"""

from __future__ import annotations

import ast
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning
import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule
from torch.utils.data import DataLoader, IterableDataset

import lit_parl.callbacks
from lit_parl.callbacks import HFExport, PipelineTimeline, RunSummary, WeightSync, load_timeline

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),  # few workers
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),  # resumed without ModelCheckpoint
]

BATCHES = 3  # per epoch
COMPLETIONS = 8  # per iteration record
TOKENS_PER_COMPLETION = 5


# -- the foreign project ---------------------------------------------------------------------------------
class FakePool:
    """A weight receiver: records every push as (version, [[(name, bytes), ...] per bucket]) and a copy."""

    def __init__(self, log: list | None = None) -> None:
        self.received: list[tuple[int, list[list[tuple[str, int]]]]] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}
        self.version: int | None = None
        self.log = log if log is not None else []

    def sync_weights(self, buckets, version: int) -> None:
        layout, copies = [], {}
        for bucket in buckets:
            layout.append([(name, tensor.numel() * tensor.element_size()) for name, tensor in bucket])
            copies.update({name: tensor.clone() for name, tensor in bucket})
        self.received.append((version, layout))
        self.weights[version] = copies
        self.version = version
        self.log.append(("sync", version))

    @property
    def versions(self) -> list[int]:
        return [version for version, _ in self.received]


@dataclass
class Record:
    """This project's own per-iteration record (not lit_parl's IterationStats), with the same fields."""

    version: int
    requested_at: float
    completed_at: float
    completions: int
    completion_tokens: int
    reward_sum: float
    prompts_drawn: int
    dropped_groups: int
    gen_intervals: list[tuple[float, float]] = field(default_factory=list)

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / max(self.completions, 1)

    @property
    def gen_busy_s(self) -> float:
        return sum(end - start for start, end in self.gen_intervals)


class Stream(IterableDataset):
    """One epoch of batches; books the iteration's record once the last batch was produced."""

    def __init__(self, datamodule: ForeignData) -> None:
        self.datamodule = datamodule

    def __iter__(self):
        dm = self.datamodule
        requested, gen = time.monotonic(), []
        for _ in range(BATCHES):
            start = time.monotonic()
            batch = torch.randn(4, 8)
            gen.append((start, time.monotonic()))
            yield batch
        if dm.record_history:
            iteration = len(dm.history)
            dm.history.append(
                dm.make_record(
                    version=dm.opened[-1] if dm.opened else iteration,
                    requested_at=requested,
                    completed_at=time.monotonic(),
                    completions=COMPLETIONS,
                    completion_tokens=COMPLETIONS * TOKENS_PER_COMPLETION,
                    reward_sum=float(iteration + 1),
                    prompts_drawn=2,
                    dropped_groups=iteration % 2,
                    gen_intervals=gen,
                )
            )


class ForeignData(LightningDataModule):
    """A datamodule with a `pool`, a `history` of records and an `open_iteration` gate."""

    def __init__(self, pool: FakePool | None = None, log: list | None = None) -> None:
        super().__init__()
        self.pool = pool
        self.history: list[Record] = []
        self.opened: list[int] = []
        self.log = log if log is not None else []
        self.record_history = True

    def make_record(self, **fields):
        return Record(**fields)

    def open_iteration(self, version: int) -> None:
        assert self.pool.version == version, "the gate opened before the pool held the weights"
        self.opened.append(version)
        self.log.append(("open", version))

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Stream(self), batch_size=None)


class PlainData(LightningDataModule):
    """A datamodule with nothing but data: no pool, no gate, no history."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader([torch.randn(4, 8) for _ in range(BATCHES)], batch_size=None)


class NoHistoryData(ForeignData):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self.history
        self.record_history = False


class PolicyModel(LightningModule):
    """A LightningModule with a `policy` and the `train_intervals` of the current epoch."""

    def __init__(self, policy: torch.nn.Module | None = None, log: list | None = None) -> None:
        super().__init__()
        self.policy = (
            policy
            if policy is not None
            else torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        )
        self.train_intervals: list[tuple[float, float]] = []
        self.log_ = log if log is not None else []
        self.at_epoch_start: dict[int, dict[str, torch.Tensor]] = {}

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self.policy(batch).pow(2).mean()

    def on_train_epoch_start(self) -> None:
        self.train_intervals = []
        self.at_epoch_start[self.current_epoch] = {n: p.detach().clone() for n, p in self.policy.named_parameters()}

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if batch_idx == 0:
            self.log_.append(("batch", self.current_epoch))
        start = time.monotonic()
        loss = self.loss(batch)
        self.train_intervals.append((start, time.monotonic()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoPolicyModel(PolicyModel):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.body = self.policy
        del self.policy

    def loss(self, batch):
        return self.body(batch).pow(2).mean()

    def on_train_epoch_start(self) -> None:
        self.train_intervals = []


class SelfFedModel(PolicyModel):
    """Brings its own data: fit gets no datamodule."""

    def train_dataloader(self) -> DataLoader:
        return PlainData().train_dataloader()


class NoIntervalsModel(PolicyModel):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self.train_intervals

    def on_train_epoch_start(self) -> None:
        pass

    def training_step(self, batch, batch_idx):
        self.log_.append(("batch", self.current_epoch))
        return self.loss(batch)


def tiny_qwen2(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.Qwen2ForCausalLM(config)


class QwenModel(PolicyModel):
    def loss(self, batch):  # trains every layer but the embedding, on the stream's float batches
        return self.policy(inputs_embeds=batch[:, None, :]).logits.pow(2).mean()


def fit(
    model, data=None, callbacks=(), epochs: int = 3, root: Path | None = None, ckpt_path=None, **kwargs
) -> lightning.Trainer:
    options = dict(
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=list(callbacks),
        default_root_dir=str(root) if root else None,
    )
    trainer = lightning.Trainer(**{**options, **kwargs})
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def checkpointed_then_resumed(tmp_path, first: list, then: list, epochs: int) -> ForeignData:
    """Fit 2 epochs with `first` callbacks, saving checkpoints; resume from the last one to `epochs` with `then`.

    Returns the resumed fit's datamodule."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_epochs=1)
    fit(
        PolicyModel(),
        ForeignData(FakePool()),
        [*first, checkpoints],
        epochs=2,
        root=tmp_path,
        enable_checkpointing=True,
    )
    data = ForeignData(FakePool())
    fit(PolicyModel(), data, then, epochs=epochs, root=tmp_path, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    return data


# -- WeightSync ------------------------------------------------------------------------------------------
def test_weight_sync_pushes_each_epoch_before_its_first_batch_then_opens_the_gate():
    log: list = []
    pool = FakePool(log)
    model, data = PolicyModel(log=log), ForeignData(pool, log)
    sync = WeightSync()
    fit(model, data, [sync], epochs=3)

    assert pool.versions == [0, 1, 2]
    assert data.opened == [0, 1, 2]
    assert log == [(event, epoch) for epoch in range(3) for event in ("sync", "open", "batch")]
    for version in range(3):  # version k is θ_k: the weights the module starts epoch k with
        sent, held = pool.weights[version], model.at_epoch_start[version]
        assert sent.keys() == held.keys()
        assert all(torch.equal(sent[name], held[name]) for name in held)
    assert not torch.equal(pool.weights[0]["0.weight"], pool.weights[2]["0.weight"]), "training changed nothing"
    assert len(sync.sync_intervals) == 3 and all(end >= start for start, end in sync.sync_intervals)


def test_weight_sync_buckets_respect_bucket_bytes_and_name_every_parameter_once():
    # parameters: 0.weight 512 B, 0.bias 64 B, 2.weight 64 B, 2.bias 4 B
    names = [name for name, _ in PolicyModel().policy.named_parameters()]
    expected = {
        10**9: [["0.weight", "0.bias", "2.weight", "2.bias"]],
        600: [["0.weight", "0.bias"], ["2.weight", "2.bias"]],
        576: [["0.weight", "0.bias"], ["2.weight", "2.bias"]],  # exactly full
        100: [["0.weight"], ["0.bias"], ["2.weight", "2.bias"]],  # 0.weight is larger than a bucket: alone
        1: [["0.weight"], ["0.bias"], ["2.weight"], ["2.bias"]],
    }
    for bucket_bytes, layout in expected.items():
        pool = FakePool()
        fit(PolicyModel(), ForeignData(pool), [WeightSync(bucket_bytes=bucket_bytes)], epochs=1)
        ((version, buckets),) = pool.received
        assert [[name for name, _ in bucket] for bucket in buckets] == layout, bucket_bytes
        assert [name for bucket in buckets for name, _ in bucket] == names  # every parameter, once, in order
        for bucket, following in zip(buckets, buckets[1:] + [None]):
            size = sum(nbytes for _, nbytes in bucket)
            assert size <= bucket_bytes or len(bucket) == 1
            if following:  # greedy: the next tensor did not fit
                assert size + following[0][1] > bucket_bytes


def test_weight_sync_buckets_are_a_lazy_stream():
    """A sharded strategy gathers a tensor only when the receiver asks for the bucket that holds it."""
    gathered = []

    def tensors():
        for index in range(4):
            gathered.append(index)
            yield f"t{index}", torch.zeros(4)  # 16 bytes each

    buckets = WeightSync(bucket_bytes=32).buckets(tensors())
    assert [name for name, _ in next(buckets)] == ["t0", "t1"]
    assert gathered == [0, 1, 2]  # t2 was read to learn the bucket was full, t3 not yet
    assert [[name for name, _ in b] for b in buckets] == [["t2", "t3"]]


def test_weight_sync_with_a_given_pool_and_a_plain_datamodule():
    pool = FakePool()
    model = PolicyModel()
    fit(model, PlainData(), [WeightSync(pool=pool)], epochs=2)
    assert pool.versions == [0, 1]
    # a given pool wins over the datamodule's
    given, data = FakePool(), PlainData()
    data.pool = FakePool()
    fit(PolicyModel(), data, [WeightSync(pool=given)], epochs=2)
    assert given.versions == [0, 1] and data.pool.versions == []


def test_weight_sync_resumes_at_the_checkpointed_epoch(tmp_path):
    data = checkpointed_then_resumed(tmp_path, [WeightSync()], [WeightSync()], epochs=4)
    assert data.pool.versions == [2, 3] and data.opened == [2, 3]  # the version is the epoch, not a counter


def test_weight_sync_override_policy_tensors_needs_no_policy_attribute():
    class BodySync(WeightSync):
        def policy_tensors(self, trainer, pl_module):
            return ((f"body.{name}", p.detach()) for name, p in pl_module.body.named_parameters())

    pool = FakePool()
    fit(NoPolicyModel(), ForeignData(pool), [BodySync()], epochs=1)
    ((_, buckets),) = pool.received
    assert [name for bucket in buckets for name, _ in bucket] == [
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
    ]


def test_weight_sync_fails_at_fit_start_without_a_pool():
    model = PolicyModel()
    with pytest.raises(
        TypeError, match=r"ForeignData has no `pool`.*WeightSync\(pool=\.\.\.\).*lit_parl\.RolloutDataModule"
    ):
        data = ForeignData(None)
        del data.pool
        fit(model, data, [WeightSync()])
    assert model.log_ == [], "trained before the contract was checked"
    model = SelfFedModel()
    with pytest.raises(TypeError, match=r"fit was given no datamodule.*WeightSync\(pool=\.\.\.\)"):
        fit(model, None, [WeightSync()])
    assert model.log_ == []


def test_weight_sync_fails_at_fit_start_with_a_pool_that_cannot_take_weights():
    class NotAPool:
        pass

    model = PolicyModel()
    with pytest.raises(
        TypeError,
        match=r"WeightSync needs the datamodule to satisfy lit_parl\.callbacks\.HasRolloutPool, "
        r"but ForeignData has no `pool\.sync_weights`.*WeightSync\(pool=\.\.\.\)",
    ):
        fit(model, ForeignData(NotAPool()), [WeightSync()])
    with pytest.raises(TypeError, match=r"its `pool` argument.*NotAPool has no `sync_weights`"):
        WeightSync(pool=NotAPool())  # given directly: refused at once
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        WeightSync(bucket_bytes=0)
    assert model.log_ == []


def test_weight_sync_fails_at_fit_start_without_a_policy():
    pool, model = FakePool(), NoPolicyModel()
    with pytest.raises(
        TypeError,
        match=r"WeightSync needs the LightningModule to satisfy lit_parl\.callbacks\.HasPolicy, "
        r"but NoPolicyModel has no `policy`\..*self\.policy.*override `policy_tensors`",
    ):
        fit(model, ForeignData(pool), [WeightSync()])
    model = NoPolicyModel()
    model.policy = "not a module"
    with pytest.raises(TypeError, match=r"NoPolicyModel has `policy` of type str, not Module"):
        fit(model, ForeignData(pool), [WeightSync()])
    assert pool.received == [] and model.log_ == []


# -- RunSummary ------------------------------------------------------------------------------------------
def test_run_summary_writes_the_counts(tmp_path, capsys):
    pool = FakePool()
    data = ForeignData(pool)
    summary = RunSummary(dirpath=str(tmp_path), last_n=2)
    fit(PolicyModel(), data, [WeightSync(), summary], epochs=3)

    written = json.loads((tmp_path / "summary.json").read_text())
    assert written == summary.summary
    rewards = [r.reward_mean for r in data.history]  # 1/8, 2/8, 3/8
    assert written["iterations"] == 3
    assert written["completions"] == 3 * COMPLETIONS
    assert written["reward_first"] == pytest.approx(rewards[0])
    assert written["reward_last2"] == pytest.approx(sum(rewards[-2:]) / 2)  # the key names last_n
    assert written["gen_busy_s"] == pytest.approx(sum(r.gen_busy_s for r in data.history), abs=1e-3)
    assert summary.train_busy_s > 0 and written["wall_s"] > 0  # (written: rounded to ms)
    assert written["tokens_per_s"] == pytest.approx(3 * COMPLETIONS * TOKENS_PER_COMPLETION / summary.wall_s, abs=0.01)
    assert written["mode"] is None  # optional: this datamodule has no `mode`
    assert f"lit_parl summary: {json.dumps(written)}" in capsys.readouterr().out


def test_run_summary_totals_survive_a_checkpoint(tmp_path):
    first, summary = RunSummary(), RunSummary()
    checkpointed_then_resumed(tmp_path, [WeightSync(), first], [WeightSync(), summary], epochs=3)
    assert summary.summary["iterations"] == 3 and summary.summary["completions"] == 3 * COMPLETIONS
    assert summary.summary["reward_first"] == first.summary["reward_first"]
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]["RunSummary"]
    assert 0 < saved["wall_s"] <= first.summary["wall_s"]  # a mid-fit checkpoint counts the fit's time so far
    assert summary.summary["wall_s"] > saved["wall_s"]


def test_run_summary_fails_at_fit_start_without_history_or_intervals():
    model = PolicyModel()
    with pytest.raises(
        TypeError,
        match=r"RunSummary needs the datamodule to satisfy lit_parl\.callbacks\.IterationHistory, "
        r"but NoHistoryData has no `history`\. .*append one record per iteration",
    ):
        fit(model, NoHistoryData(FakePool()), [WeightSync(), RunSummary()])
    assert model.log_ == []
    model = SelfFedModel()
    with pytest.raises(TypeError, match=r"RunSummary needs the datamodule.*but there is none"):
        fit(model, None, [RunSummary()])
    assert model.log_ == []
    model = NoIntervalsModel()
    with pytest.raises(
        TypeError,
        match=r"RunSummary needs the LightningModule to satisfy lit_parl\.callbacks\.TrainIntervals, "
        r"but NoIntervalsModel has no `train_intervals`\. .*time\.monotonic",
    ):
        fit(model, ForeignData(FakePool()), [WeightSync(), RunSummary()])
    assert model.log_ == []


def test_run_summary_refuses_records_without_the_fields():
    @dataclass
    class ShortRecord:
        version: int
        completions: int

    data = ForeignData(FakePool())
    data.make_record = lambda **fields: ShortRecord(fields["version"], fields["completions"])
    with pytest.raises(
        TypeError,
        match=r"each record of the datamodule's `history`.*ShortRecord has no `requested_at`, "
        r"`completed_at`, `completion_tokens`, `reward_sum`, `prompts_drawn`, `dropped_groups`, `gen_intervals`, "
        r"`reward_mean`, `gen_busy_s`\. Append records",
    ):
        fit(PolicyModel(), data, [WeightSync(), RunSummary()], epochs=1)


def test_run_summary_warns_about_an_epoch_without_a_new_record(tmp_path):
    class OneRecordData(ForeignData):  # books iteration 0 only: epoch 1 ends on iteration 0's record
        def open_iteration(self, version):
            super().open_iteration(version)
            self.record_history = version == 0

    data = OneRecordData(FakePool())
    summary = RunSummary(dirpath=str(tmp_path))
    with pytest.warns(UserWarning, match=r"iteration 1 ended without a new record in OneRecordData\.history"):
        fit(PolicyModel(), data, [WeightSync(), summary], epochs=2)
    assert len(data.history) == 1
    assert summary.summary["iterations"] == 1 and summary.summary["completions"] == COMPLETIONS  # not counted twice


# -- PipelineTimeline ------------------------------------------------------------------------------------
def test_pipeline_timeline_writes_json_and_png(tmp_path):
    sync = WeightSync()
    timeline = PipelineTimeline(dirpath=str(tmp_path))
    fit(PolicyModel(), ForeignData(FakePool()), [sync, timeline], epochs=3)

    iterations = load_timeline(tmp_path / "timeline.jsonl")
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [it["iteration"] for it in iterations] == [0, 1, 2]
    origin = timeline._origin
    for it, (start, end) in zip(iterations, sync.sync_intervals):  # the one SyncTimes callback: WeightSync's
        assert it["sync"] == [pytest.approx([start - origin, end - origin])]
    for it in iterations:
        assert len(it["generate"]) == BATCHES and len(it["train"]) == BATCHES
        assert it["gen_busy_s"] > 0 and it["train_busy_s"] > 0 and it["wall_s"] > 0


def test_pipeline_timeline_without_a_sync_callback_has_no_sync_row(tmp_path):
    timeline = PipelineTimeline(dirpath=str(tmp_path))
    fit(
        PolicyModel(), ForeignData(FakePool()), [timeline], epochs=2
    )  # no WeightSync: the datamodule has no gate to open
    iterations = load_timeline(tmp_path / "timeline.jsonl")
    assert len(iterations) == 2 and all(it["sync"] == [] for it in iterations)
    assert (tmp_path / "timeline.png").exists()


def test_pipeline_timeline_continues_after_a_resume(tmp_path):
    timeline = PipelineTimeline()
    checkpointed_then_resumed(tmp_path, [WeightSync(), PipelineTimeline()], [WeightSync(), timeline], epochs=3)
    iterations = timeline.iterations
    assert [it["iteration"] for it in iterations] == [0, 1, 2]
    assert iterations[2]["start"] >= iterations[1]["end"], "the resumed iteration is drawn over the restored ones"


def test_pipeline_timeline_fails_at_fit_start_when_a_contract_is_not_met():
    model = PolicyModel()
    with pytest.raises(
        TypeError,
        match=r"PipelineTimeline needs the datamodule to satisfy lit_parl\.callbacks\.IterationHistory, "
        r"but NoHistoryData has no `history`",
    ):
        fit(model, NoHistoryData(FakePool()), [WeightSync(), PipelineTimeline()])
    assert model.log_ == []
    model = NoIntervalsModel()
    with pytest.raises(
        TypeError, match=r"PipelineTimeline needs the LightningModule.*NoIntervalsModel has no `train_intervals`"
    ):
        fit(model, ForeignData(FakePool()), [WeightSync(), PipelineTimeline()])
    with pytest.raises(ValueError, match=r"2 callbacks have `sync_intervals`: WeightSync, WeightSync\. Keep one"):
        fit(
            model := PolicyModel(),
            ForeignData(FakePool()),
            [WeightSync(), WeightSync(pool=FakePool()), PipelineTimeline()],
        )
    assert model.log_ == []


# -- HFExport --------------------------------------------------------------------------------------------
def test_hf_export_saves_a_loadable_transformers_model(tmp_path):
    import transformers

    model = QwenModel(policy=tiny_qwen2())
    initial = {k: v.clone() for k, v in model.policy.state_dict().items()}
    export = HFExport(dirpath=str(tmp_path / "export"))
    fit(model, ForeignData(FakePool()), [WeightSync(), export], epochs=2)

    assert export.saved_to == tmp_path / "export"
    assert (tmp_path / "export" / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    trained = model.policy.state_dict()
    assert loaded.state_dict().keys() == trained.keys()
    assert all(torch.equal(loaded.state_dict()[k], trained[k]) for k in trained)
    assert any(not torch.equal(initial[k], trained[k]) for k in trained), "the export is of an untrained policy"
    # default directory: <default_root_dir>/policy
    default = HFExport()
    fit(QwenModel(policy=tiny_qwen2()), PlainData(), [default], epochs=1, root=tmp_path / "run")
    assert default.saved_to == tmp_path / "run" / "policy"
    assert transformers.AutoModelForCausalLM.from_pretrained(default.saved_to) is not None


def test_hf_export_every_n_iterations_saves_each_iterations_policy(tmp_path):
    import transformers

    class Snapshots(Callback):  # the policy after each epoch, to compare with what was exported then
        def __init__(self):
            self.after = {}

        def on_train_epoch_end(self, trainer, pl_module):
            self.after[trainer.current_epoch + 1] = {k: v.clone() for k, v in pl_module.policy.state_dict().items()}

    snapshots, export = Snapshots(), HFExport(dirpath=str(tmp_path / "export"), every_n_iterations=2)
    fit(QwenModel(policy=tiny_qwen2()), ForeignData(FakePool()), [WeightSync(), snapshots, export], epochs=5)
    assert sorted(p.name for p in (tmp_path / "export").iterdir() if p.is_dir()) == ["iteration-2", "iteration-4"]
    for done in (2, 4):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "export" / f"iteration-{done}"
        ).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in snapshots.after[done].items()), done
    assert not all(torch.equal(snapshots.after[2][k], v) for k, v in snapshots.after[4].items()), (
        "the policy did not move"
    )
    assert export.saved_to == tmp_path / "export" and (tmp_path / "export" / "model.safetensors").exists()
    with pytest.raises(ValueError, match="every_n_iterations=-1"):
        HFExport(every_n_iterations=-1)


def test_hf_export_fails_at_fit_start_when_the_policy_cannot_be_saved():
    model = PolicyModel()  # a torch.nn.Sequential policy: no save_pretrained
    with pytest.raises(
        TypeError,
        match=r"HFExport needs the module's `policy` to satisfy lit_parl\.callbacks\.SavesPretrained, "
        r"but Sequential has no `save_pretrained`\. Keep a transformers PreTrainedModel",
    ):
        fit(model, PlainData(), [HFExport()])
    with pytest.raises(TypeError, match=r"HFExport needs the LightningModule.*NoPolicyModel has no `policy`"):
        fit(NoPolicyModel(log=model.log_), PlainData(), [HFExport()])
    model = QwenModel(policy=tiny_qwen2(), log=model.log_)
    model.tokenizer = object()
    with pytest.raises(TypeError, match=r"`tokenizer`.*object has no `save_pretrained`"):
        fit(model, PlainData(), [HFExport()])
    assert model.log_ == [], "trained before the contract was checked"


# -- the contracts themselves ---------------------------------------------------------------------------
def test_contract_problems_reads_like_lightning_objects_are_built():
    from lit_parl.callbacks.contracts import HasPolicy, HasRolloutPool, IterationRecord, contract_problems

    assert contract_problems(PolicyModel(), HasPolicy) == []  # a submodule, kept in nn.Module._modules
    pool = FakePool()
    pool.sync_weights = None
    assert contract_problems(ForeignData(pool), HasRolloutPool) == ["has `pool.sync_weights` that is not callable"]
    # numbers are duck-typed: ints where floats are declared are fine
    record = Record(
        version=0,
        requested_at=0,
        completed_at=1,
        completions=8,
        completion_tokens=40,
        reward_sum=3,
        prompts_drawn=2,
        dropped_groups=0,
    )
    assert contract_problems(record, IterationRecord) == []
    record.gen_intervals = None
    assert contract_problems(record, IterationRecord) == [
        "has `gen_intervals` of type NoneType, not Sequence",
        "has `gen_busy_s` that raised TypeError: 'NoneType' object is not iterable",
    ]


# -- the package -----------------------------------------------------------------------------------------
def test_callbacks_import_nothing_of_lit_parl():
    """The callbacks stand alone: they state what they need as protocols instead of importing lit_parl's classes."""
    folder = Path(lit_parl.callbacks.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert not any(alias.name.split(".")[0] == "lit_parl" for alias in node.names), path.name
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module.split(".")[0] != "lit_parl", f"{path.name} imports {node.module}"
