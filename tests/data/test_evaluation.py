"""Evaluation during training: held-out prompts through the same pool with the weights of the iteration
just trained (no extra sync, under the version gate), logged as validation metrics, never mixed into the
training data; the metrics are what their definitions say."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from helpers.components import BatchRecorder, fit, make_components, policy_state, sgd
from helpers.pools import InProcessPool, WrappedPool
from lit_parl.data.evaluator import EvalSettings
from lit_parl.rewards import Reward
from lit_parl.tasks import CopyTask


class RecordingPool(WrappedPool):
    """Records each generate call: (the version the pool holds, request versions, group size, temperature)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls = []
        self.groups_per_call = []
        self.syncs = []

    def _sync_weights(self, buckets, version):
        self.syncs.append(version)
        super()._sync_weights(buckets, version)

    def _generate(self, requests, sampling):
        self.calls.append(
            (
                self.inner.version,
                {r.version for r in requests},
                requests[0].group_size,
                sampling.temperature,
                [r.prompt_id for r in requests],
            )
        )
        self.groups_per_call.append([])
        for group in super()._generate(requests, sampling):
            self.groups_per_call[-1].append(group)
            yield group


class ValidationMetrics(Callback):
    """What each validation run measured (the batch the module's validation_step logs), by iteration."""

    def __init__(self):
        self.by_epoch = {}

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.by_epoch[trainer.current_epoch] = dict(batch)


EVAL = {"evaluation": EvalSettings(every_n_iterations=2, prompts=6, samples=3)}


def test_evaluation_runs_on_the_iterations_weights_and_never_touches_training():
    pool = RecordingPool(InProcessPool())
    module, data = make_components(
        pool=pool, prompts=4, group_size=4, micro_batch_size=8, datamodule_kwargs=EVAL, **sgd(0.5)
    )
    recorder, metrics = BatchRecorder(), ValidationMetrics()
    fit(module, data, iterations=3, callbacks=[recorder, metrics])

    assert pool.syncs == [0, 1, 2]  # no extra sync for the evaluations
    evals = [call for call in pool.calls if call[3] == 0.0 or call[2] == 3]
    # after iterations 1 (every 2nd) and 2 (the last): greedy (1 sample, T=0) then k=3 at the training temperature,
    # in calls of at most the iteration's N x G = 16 samples (6 prompts x 3 samples: 5 prompts, then 1)
    assert [(held, versions, size, temperature, len(ids)) for held, versions, size, temperature, ids in evals] == [
        (1, {1}, 1, 0.0, 6),
        (1, {1}, 3, 1.0, 5),
        (1, {1}, 3, 1.0, 1),
        (2, {2}, 1, 0.0, 6),
        (2, {2}, 3, 1.0, 5),
        (2, {2}, 3, 1.0, 1),
    ]
    assert sorted(evals[1][4] + evals[2][4]) == sorted(evals[0][4])  # the same held-out prompts in both passes
    assert sorted(metrics.by_epoch) == [1, 2]
    names = {"val/greedy_accuracy", "val/greedy_reward", "val/mean@3", "val/pass@3", "val/reward@3"}
    assert set(metrics.by_epoch[1]) == names and names <= set(trainer_metrics := module.trainer.callback_metrics)
    assert float(trainer_metrics["val/greedy_accuracy"]) == pytest.approx(metrics.by_epoch[2]["val/greedy_accuracy"])

    # the same run without evaluation trains the same batches to the same weights
    plain_module, plain_data = make_components(
        pool=InProcessPool(), prompts=4, group_size=4, micro_batch_size=8, **sgd(0.5)
    )
    plain_recorder = BatchRecorder()
    fit(plain_module, plain_data, iterations=3, callbacks=[plain_recorder])
    assert recorder.samples() == plain_recorder.samples()
    for name, tensor in policy_state(module).items():
        torch.testing.assert_close(tensor, policy_state(plain_module)[name], rtol=0, atol=0)


def test_the_metrics_follow_their_definitions():
    """Reward 1 for a completion whose first token is even: greedy accuracy, mean@k and pass@k recomputed from
    the groups the pool returned for the evaluation's two calls."""
    pool = RecordingPool(InProcessPool())

    def even_start(completion_ids):
        return float(completion_ids[0] % 2 == 0)

    module, data = make_components(pool=pool, prompts=4, group_size=4, micro_batch_size=8, datamodule_kwargs=EVAL)
    data.scorer.rewards = [Reward(even_start)]  # one scorer serves training and evaluation
    metrics = ValidationMetrics()
    fit(module, data, iterations=2, callbacks=[metrics])
    greedy_call, *sampled_calls = [i for i, call in enumerate(pool.calls) if call[3] == 0.0 or call[2] == 3]
    per_call = pool.groups_per_call
    greedy = [float(g.completions[0][0] % 2 == 0) for g in per_call[greedy_call]]
    sampled = [[float(c[0] % 2 == 0) for c in g.completions] for call in sampled_calls for g in per_call[call]]
    assert len(greedy) == len(sampled) == 6
    got = metrics.by_epoch[1]
    assert got["val/greedy_accuracy"] == pytest.approx(sum(greedy) / 6)
    assert got["val/mean@3"] == pytest.approx(sum(sum(s) / 3 for s in sampled) / 6)
    assert got["val/pass@3"] == pytest.approx(sum(max(s) for s in sampled) / 6)
    assert got["val/mean@3"] != got["val/pass@3"]  # the seeds give a prompt with mixed samples: the two differ
    # the held-out prompts are not the training prompts
    trained = {d.request.prompt_tokens for d in data.schedule.draw(list(range(8)), version=0).values()}
    held_out = {d.request.prompt_tokens for d in data.evaluator.schedule.draw(list(range(6)), version=0).values()}
    assert len(trained & held_out) <= 1  # digit strings of 2-4 digits: a repeat by chance is possible, not the rule


class StopAt(Callback):
    """Stops the fit after micro-batch ``batch`` of iteration ``epoch``, as max_time or max_steps would."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            trainer.should_stop = True


@pytest.mark.parametrize(
    "stop_batch, evaluated", [(0, [0]), (1, [1])], ids=["mid-iteration", "after-its-last-micro-batch"]
)
def test_a_stopped_fit_evaluates_only_finished_iterations_and_its_last_one(stop_batch, evaluated):
    """Lightning validates at once when a fit is stopped: mid-iteration there is nothing to evaluate (the pool
    may hold the next version); after an iteration's last micro-batch it is the run's last evaluation."""
    pool = RecordingPool(InProcessPool())
    settings = {"evaluation": EvalSettings(every_n_iterations=1 if stop_batch == 0 else 5, prompts=2)}
    module, data = make_components(pool=pool, prompts=4, group_size=4, micro_batch_size=8, datamodule_kwargs=settings)
    metrics = ValidationMetrics()
    fit(module, data, iterations=4, callbacks=[metrics, StopAt(epoch=1, batch=stop_batch)])
    assert sorted(metrics.by_epoch) == evaluated


def test_bad_evaluation_settings_name_the_setting():
    with pytest.raises(ValueError, match="evaluation.prompts is needed with a procedural task"):
        make_components(pool=InProcessPool(), datamodule_kwargs={"evaluation": {"every_n_iterations": 1}})
    with pytest.raises(ValueError, match="no held-out prompts"):
        make_components(
            pool=InProcessPool(),
            datamodule_kwargs={
                "evaluation": {"every_n_iterations": 1, "prompts": 4},
                "eval_data": None,
            },
            task=_NoEvalTask(),
        )
    with pytest.raises(ValueError, match=r"evaluation needs samples >= 1 or greedy=true"):
        EvalSettings(every_n_iterations=1, samples=0, greedy=False)
    with pytest.raises(ValueError, match=r"evaluation.prompts=10 is more than the 6 rows of the eval set"):
        make_components(
            pool=InProcessPool(),
            task=_ListTask(),
            datamodule_kwargs={"evaluation": {"every_n_iterations": 1, "prompts": 10}},
        )
    with pytest.raises(ValueError, match=r"sampling.temperature=0 \(greedy\) cannot train"):
        make_components(pool=InProcessPool(), datamodule_kwargs={"sampling": {"temperature": 0.0}})


class _ListTask(CopyTask):
    """A finite source of 12 rows whose evaluation() is a finite source of 6."""

    num_rows = 12

    def evaluation(self):
        held_out = CopyTask(seed=1)
        held_out.num_rows = 6
        return held_out


class _NoEvalTask(CopyTask):
    def evaluation(self):
        return None
