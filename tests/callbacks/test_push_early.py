"""The next iteration starts at the end of the last one (``WeightSync(push_early=True)``, the default): its
weights go out and its requests leave while Lightning runs the rest of the epoch's end, and that changes
nothing that is trained; where no next epoch follows, or the fit stops after the push, nothing is lost."""

from __future__ import annotations

import csv
import threading
import time
from types import SimpleNamespace

import lightning
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
from lightning.pytorch.loggers import CSVLogger

from helpers.components import BatchRecorder, fit, make_components, policy_state, sgd
from helpers.pools import InProcessPool, WrappedPool
from lit_parl.callbacks import PipelineTimeline, RunSummary, WeightSync
from lit_parl.data.head_start import HeadStart
from lit_parl.rollout import HFRolloutPool
from lit_parl.trainer.grpo_module import GRPOModule

SLOW_EPOCH_END_S = 0.3


class TimedPool(WrappedPool):
    """Records when each sync starts and ends and when each request reaches the pool, with versions."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.events: list[tuple[str, int, float]] = []
        self._recorded = threading.Condition()  # the iteration threads record; a test's thread waits on them

    def _record(self, kind: str, version: int) -> None:
        with self._recorded:
            self.events.append((kind, version, time.monotonic()))
            self._recorded.notify_all()

    def _sync_weights(self, buckets, version):
        self._record("sync_start", version)
        super()._sync_weights(buckets, version)
        self._record("synced", version)

    def _generate(self, requests, sampling):
        self._record("request", requests[0].version)
        yield from super()._generate(requests, sampling)

    def times(self, kind: str) -> dict[int, float]:
        return {version: at for event, version, at in self.events if event == kind}

    def wait_for(self, kind: str, version: int, timeout_s: float = 30.0) -> bool:
        """Until ``kind`` is recorded for ``version`` (the deadline only bounds a hang); whether it was."""
        with self._recorded:
            return self._recorded.wait_for(lambda: version in self.times(kind), timeout_s)


class SlowEpochEnd(Callback):
    """An epoch end that takes a while (a logger, a checkpoint): when it started and ended, by epoch."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.ended: dict[int, float] = {}
        self.last_step_end: dict[int, float] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        self.started[trainer.current_epoch] = time.monotonic()
        self.last_step_end[trainer.current_epoch] = pl_module.train_intervals[-1][1]
        time.sleep(SLOW_EPOCH_END_S)
        self.ended[trainer.current_epoch] = time.monotonic()


def test_the_next_iterations_requests_leave_during_the_epoch_end_after_its_last_step():
    pool = TimedPool(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=2)
    slow = SlowEpochEnd()
    fit(module, data, iterations=3, callbacks=[slow])
    syncs, requests = pool.times("sync_start"), pool.times("request")
    assert sorted(syncs) == [0, 1, 2]  # one push per iteration, none after the last
    for k in (0, 1):
        # on-policy: θ_{k+1} leaves after iteration k's last optimizer step, and is confirmed before any request of k+1
        assert syncs[k + 1] >= slow.last_step_end[k]
        assert requests[k + 1] >= pool.times("synced")[k + 1]
        # overlapped: the requests left while the (slow) rest of epoch k's end was still running
        assert requests[k + 1] < slow.ended[k], f"iteration {k + 1}'s requests waited for epoch {k}'s end hooks"
    assert [version for event, version, _ in pool.events if event == "request"] == [0, 1, 2]


def test_pushing_early_trains_exactly_what_pushing_at_the_epochs_start_trains():
    """SGD, no clipping: a changed batch, order or version would show in the weights."""
    trained = {}
    for push_early in (True, False):
        module, data = make_components(pool=InProcessPool(), prompts=4, group_size=4, micro_batch_size=8, **sgd(0.5))
        initial = policy_state(module)
        recorder = BatchRecorder()
        fit(module, data, iterations=3, callbacks=[recorder], weight_sync=WeightSync(push_early=push_early))
        trained[push_early] = (policy_state(module), recorder.samples())
    (early, early_samples), (late, late_samples) = trained[True], trained[False]
    assert early_samples == late_samples
    assert max((early[name] - initial[name]).abs().max().item() for name in early) > 1e-4  # it trained
    for name, tensor in early.items():
        torch.testing.assert_close(tensor, late[name], rtol=0, atol=0)


class StopAfterEpoch(Callback):
    """Stops the fit at the end of ``epoch`` as early stopping would: after WeightSync pushed the next weights
    and so started the next iteration in its thread, and once that iteration's requests reached ``pool``: a
    loaded machine may not have run the thread that far yet, and the fit would then close the pool first."""

    def __init__(self, epoch: int, pool: TimedPool) -> None:
        self.epoch, self.pool = epoch, pool

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            self.pool.wait_for("request", self.epoch + 1)  # the test asserts that they came
            trainer.should_stop = True


@pytest.mark.parametrize("inner", ["in-process", "workers"])
def test_an_iteration_started_for_a_fit_that_then_stops_is_discarded_unbooked(inner):
    pool = TimedPool(
        InProcessPool()
        if inner == "in-process"
        else HFRolloutPool(num_workers=1, threads_per_worker=1, colocated_threads=1)
    )
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=4)
    fit(module, data, iterations=5, callbacks=[StopAfterEpoch(1, pool)])
    assert sorted(pool.times("sync_start")) == [0, 1, 2]  # θ_2 went out at epoch 1's end, before the stop
    assert 2 in pool.times("request")
    # iteration 2 never trained: not booked, its prompts not consumed, its version not the gate's last
    assert data.iterations_done == 2 and data.schedule.cursor == 4 and data.gate.last_version == 1
    assert data.start.pending is None and not data.gate._event.is_set()
    assert not [t for t in threading.enumerate() if t.name.startswith("lit_parl-iteration-")]
    assert not pool.health().started  # closed with the fit


class StopAtLastBatch(Callback):
    """Stops the fit at ``epoch``'s last batch, as a time limit would: before the epoch's end hooks."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == self.epoch and batch_idx + 1 == trainer.num_training_batches:
            trainer.should_stop = True


def test_no_early_push_when_no_epoch_follows():
    pool = TimedPool(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=4)
    fit(module, data, iterations=2)
    assert sorted(pool.times("sync_start")) == [0, 1]
    pool = TimedPool(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=4)
    fit(module, data, iterations=4, callbacks=[StopAtLastBatch(1)])
    assert sorted(pool.times("sync_start")) == [0, 1]
    pool = TimedPool(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=4)
    fit(module, data, iterations=4, max_steps=2)  # one optimizer step per iteration: the fit ends after epoch 1
    assert sorted(pool.times("sync_start")) == [0, 1]


def test_a_head_start_runs_to_its_first_item_in_a_thread_then_in_the_consumers():
    ran_in: list[str] = []

    def items():
        for i in range(3):
            ran_in.append(threading.current_thread().name)
            yield i

    started = HeadStart(items(), "head", to_the_end=False)
    deadline = time.monotonic() + 10
    while not ran_in and time.monotonic() < deadline:  # started without being asked for anything
        time.sleep(0.01)
    assert ran_in == ["head"]
    assert list(started) == [0, 1, 2]
    assert ran_in == ["head", threading.current_thread().name, threading.current_thread().name]

    prefetch_ran_in: list[str] = []

    def prefetched():
        for i in range(3):
            prefetch_ran_in.append(threading.current_thread().name)
            yield i

    assert list(HeadStart(prefetched(), "ahead", to_the_end=True)) == [0, 1, 2]
    assert prefetch_ran_in == ["ahead"] * 3


def test_closing_a_head_start_that_waits_inside_its_generator_leaves_it_to_its_thread():
    """Closed while its thread is blocked (a pool's receive): no error here; the thread ends once unblocked."""
    release = threading.Event()

    def blocked():
        release.wait(10)
        raise RuntimeError("the pool was closed")
        yield  # pragma: no cover

    started = HeadStart(blocked(), "blocked", to_the_end=False)
    started.close()
    release.set()
    assert started._thread.join(10)
    with pytest.raises(StopIteration):
        next(started)


def test_run_summary_and_timeline_log_after_the_next_iterations_push(tmp_path, monkeypatch):
    """Their logged values (half a millisecond a ``log`` call) come after the push, not between the last step and
    it; each iteration's still reaches the logger, one value per epoch."""
    pool = TimedPool(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=2)
    logged: list[tuple[str, int, float]] = []  # (name, epoch, when)
    log = GRPOModule.log

    def recording_log(self, name, *args, **kwargs):
        logged.append((name, self.current_epoch, time.monotonic()))
        return log(self, name, *args, **kwargs)

    monkeypatch.setattr(GRPOModule, "log", recording_log)
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=3,
        callbacks=[WeightSync(), RunSummary(dirpath=str(tmp_path)), PipelineTimeline(dirpath=str(tmp_path))],
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    syncs = pool.times("sync_start")
    for name in ("completions_per_s", "tokens_per_s", "gen_busy_s", "train_busy_s", "dropped_groups"):
        assert [epoch for n, epoch, _ in logged if n == name] == [0, 1, 2], name
    for name, epoch, at in logged:
        if name in ("completions_per_s", "overlap_efficiency") and epoch < 2:
            assert at > syncs[epoch + 1], (name, epoch)  # after the next iteration's push
    rows = list(csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    values = [row["overlap_efficiency"] for row in rows if row.get("overlap_efficiency")]
    assert len(values) == 3 and all(0.0 <= float(v) <= 1.0 for v in values)


class EarlyPushedIterations(BoringModel):
    """Each epoch's record as a slow machine makes it with the push at the previous epoch's end: the requests
    left 1 s before the first training step (that epoch end's hooks ran long), the pool generated 50 ms then
    and 50 ms during the one 200 ms step; no interval of the trainer's covers the time in between."""

    train_intervals = []

    def on_train_epoch_start(self):
        now = time.monotonic()
        self.train_intervals = [(now, now + 0.2)]
        self.trainer.datamodule.history.append(
            SimpleNamespace(
                version=self.current_epoch,
                requested_at=now - 1.0,
                completed_at=now + 0.2,
                completions=8,
                completion_tokens=80,
                reward_sum=4.0,
                reward_mean=0.5,
                prompts_drawn=2,
                dropped_groups=0,
                gen_intervals=[(now - 1.0, now - 0.95), (now + 0.05, now + 0.1)],
                gen_busy_s=0.1,
            )
        )


def test_the_overlap_efficiency_counts_only_time_both_sides_ran_not_the_idle_time_of_a_slow_machine(tmp_path):
    """Half of the pool's 100 ms ran beside a training step: 0.5, where the iteration's wall (1.2 s, mostly
    neither side running) made it (0.1 + 0.2 - 1.2) / 0.1 = -9, below the metric's [0, 1]."""

    class Data(BoringDataModule):
        history = []

    timeline = PipelineTimeline(dirpath=str(tmp_path))
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=CSVLogger(tmp_path),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timeline],
    )
    trainer.fit(EarlyPushedIterations(), datamodule=Data())
    for iteration in timeline.iterations:
        assert iteration["wall_s"] == pytest.approx(1.2, abs=1e-6)
        assert iteration["overlap_efficiency"] == pytest.approx(0.5, abs=1e-6)
    rows = list(csv.DictReader((tmp_path / "lightning_logs" / "version_0" / "metrics.csv").open()))
    assert [float(row["overlap_efficiency"]) for row in rows if row.get("overlap_efficiency")] == pytest.approx(
        [0.5] * 2
    )
