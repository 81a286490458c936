"""The trainer's runtime checks (lit_parl/trainer/guards.py) on real fits: samples of other weights, and NaN.

The version labels say which weights a worker claims it held; only the log-probs show which it used. A
pool that keeps old weights while reporting each new version passes every label check, so the run must
stop on the log-probs. And a NaN reward, log-prob or gradient must never reach the optimizer.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Callback

from helpers.components import fit, make_components, policy_state, sgd
from helpers.pools import InProcessPool, KeepsFirstWeights, WrappedPool
from lit_parl import OffPolicyError, RolloutDataModule
from lit_parl.rewards import RewardError
from lit_parl.rollout import HFRolloutPool
from lit_parl.rollout.rollout_pool import BF16_LOGPROB_TOLERANCE
from lit_parl.tasks import CopyTask, positional_reward
from lit_parl.trainer.guards import NonFiniteGuard


def _pool() -> HFRolloutPool:
    return HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)


def test_a_pool_that_keeps_old_weights_under_the_new_version_stops_the_run():
    """Even one missed step at lr 1e-5 shows in the log-probs (~1e-3 per token, against ~1e-7 when on-policy)."""
    module, data = make_components(pool=KeepsFirstWeights(_pool()), lr=1e-5)
    steps = []

    class Steps(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            steps.append((trainer.current_epoch, trainer.global_step))

    with pytest.raises(OffPolicyError, match=r"did not sample with the weights of policy version 1"):
        fit(module, data, iterations=3, callbacks=[Steps()])
    assert steps[-1] == (1, 1), "not stopped at iteration 1's first micro-batch"  # iteration 0 (on-policy) trained


def test_the_check_can_be_turned_off_and_then_the_stale_run_completes():
    module, data = make_components(pool=KeepsFirstWeights(InProcessPool()))
    data.logprob_tolerance = None
    fit(module, data, iterations=2)
    assert data.iterations_done == 2


def test_the_tolerance_comes_from_the_pool_and_widens_for_a_low_precision_trainer_or_an_accelerator():
    from types import SimpleNamespace

    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    module, data = make_components(pool=_pool())
    assert data.launcher.logprob_tolerance() == HFRolloutPool().logprob_tolerance() < 1e-3
    data.trainer = SimpleNamespace(precision="32-true", accelerator=CPUAccelerator())
    assert data.launcher.logprob_tolerance() == HFRolloutPool().logprob_tolerance()
    data.trainer = SimpleNamespace(precision="bf16-mixed", accelerator=CPUAccelerator())
    assert data.launcher.logprob_tolerance() == BF16_LOGPROB_TOLERANCE
    data.trainer = SimpleNamespace(
        precision="32-true", accelerator=CUDAAccelerator()
    )  # not measured there: bf16's bound
    assert data.launcher.logprob_tolerance() == BF16_LOGPROB_TOLERANCE
    data.logprob_tolerance = 0.3
    assert data.launcher.logprob_tolerance() == 0.3
    with pytest.raises(ValueError, match=r"logprob_tolerance=-1\): give a number > 0"):
        RolloutDataModule(
            CopyTask(),
            [positional_reward],
            _pool(),
            module.tokenizer,
            module.shape,
            module.objective,
            module.policy,
            logprob_tolerance=-1,
        )


class OneGroupSlightlyOff(WrappedPool):
    """Shifts every log-prob of one group of each iteration after the first by ``shift``: as if one worker of
    several held slightly other weights. The micro-batch's mean stays under the tolerance; the group's does not."""

    def __init__(self, inner, shift: float) -> None:
        super().__init__(inner)
        self.shift = shift

    def transform(self, groups):
        for group in groups:
            if group.version == 1 and group.prompt_id == 9:
                group.logprobs = [[lp + self.shift for lp in sample] for sample in group.logprobs]
            yield group


def test_one_stale_group_is_not_averaged_away_by_the_others_in_its_micro_batch():
    tolerance = InProcessPool().logprob_tolerance()
    module, data = make_components(
        pool=OneGroupSlightlyOff(InProcessPool(), shift=1.5 * tolerance)
    )  # 2 groups per micro-batch
    with pytest.raises(
        OffPolicyError, match=r"log-probs of prompt 9 differ from θ_k's by 1\.\d+e-05 per token \(tolerance 1e-05\)"
    ):
        fit(module, data, iterations=2)


class WeightsAtEpochStart(Callback):
    def __init__(self) -> None:
        self.states = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.states.append(policy_state(pl_module))


class PoisonLogprobs(WrappedPool):
    """Sets one sample's log-prob to NaN in the groups of ``prompt`` (a stand-in for any non-finite value)."""

    def __init__(self, inner, prompt: int) -> None:
        super().__init__(inner)
        self.prompt = prompt

    def transform(self, groups):
        for group in groups:
            if group.prompt_id == self.prompt:
                group.logprobs[0][0] = float("nan")
            yield group


def test_a_non_finite_value_skips_its_optimizer_step_and_counts_it():
    """on_nonfinite=skip: iteration 1's step is dropped (weights unchanged through it), later steps go on."""
    recorder = WeightsAtEpochStart()
    module, data = make_components(pool=PoisonLogprobs(InProcessPool(), prompt=10), on_nonfinite="skip", **sgd(0.5))
    with pytest.warns(
        UserWarning, match=r"optimizer step skipped .* non-finite rollout log-probs on prompts \[10, 11\]"
    ):
        fit(module, data, iterations=3, callbacks=[recorder])
    final = policy_state(module)
    assert module.guard.skipped_steps == 1
    assert all(torch.isfinite(v).all() for v in final.values())
    at_1, at_2 = recorder.states[1], recorder.states[2]
    assert all(torch.equal(at_1[k], at_2[k]) for k in at_1), "iteration 1 stepped although a value was NaN"
    assert any(not torch.equal(at_2[k], final[k]) for k in final), "iteration 2 did not step"
    assert any(not torch.equal(recorder.states[0][k], at_1[k]) for k in at_1), "iteration 0 did not step"


def test_a_non_finite_value_stops_the_run_when_so_configured():
    recorder = WeightsAtEpochStart()
    module, data = make_components(pool=PoisonLogprobs(InProcessPool(), prompt=10), on_nonfinite="raise", **sgd(0.5))
    with pytest.raises(FloatingPointError, match=r"non-finite rollout log-probs on prompts \[10, 11\]"):
        fit(module, data, iterations=3, callbacks=[recorder])
    assert len(recorder.states) == 2, "not stopped in iteration 1"
    final = policy_state(module)
    assert all(torch.equal(recorder.states[1][k], final[k]) for k in final), "a weight moved in the refused step"


class NaNReward(CopyTask):
    def reward(self, answer_ids, completion_ids, eos_id):
        return float("nan") if len(completion_ids) == 1 else super().reward(answer_ids, completion_ids, eos_id)


def test_a_reward_returning_nan_stops_the_run_naming_the_reward():
    """The first line: the scoring policy refuses a NaN reward (``on_error=error``, the default) before any
    advantage."""
    module, data = make_components(pool=InProcessPool(), task=NaNReward(seed=0), **sgd(0.5))
    with pytest.raises(
        RewardError, match=r"reward 'positional' returned a non-finite value .* on prompt \d+, sample \d+"
    ):
        fit(module, data, iterations=3)


def test_non_finite_rewards_past_scoring_never_reach_the_weights():
    """The backstop behind reward handling: NaN rewards (here injected after the scorer) make NaN advantages,
    and no step is taken with them."""
    module, data = make_components(pool=InProcessPool(), on_nonfinite="skip", **sgd(0.5))
    score = data.scorer.score

    def nan_for_one_token_completions(drawn, completions):
        group = score(drawn, completions)
        group.rewards = [float("nan") if len(c) == 1 else r for c, r in zip(group.completions, group.rewards)]
        return group

    data.scorer.score = nan_for_one_token_completions
    with pytest.warns(UserWarning, match="non-finite advantages"):
        fit(module, data, iterations=3)
    assert module.guard.skipped_steps >= 1
    assert all(torch.isfinite(v).all() for v in policy_state(module).values())


def test_a_non_finite_gradient_with_a_finite_loss_is_caught_at_the_step():
    """A gradient can overflow where the loss did not: the step's own check catches it and names the step's prompts."""
    module, data = make_components(pool=InProcessPool(), on_nonfinite="raise", **sgd(0.5))
    weight = next(module.policy.parameters())

    class Overflow(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:
                self.handle = weight.register_hook(lambda grad: grad * float("inf"))

    with pytest.raises(
        FloatingPointError, match=r"non-finite gradient \(norm (inf|nan)\) in the step over prompts \[8, 9, 10"
    ):
        fit(module, data, iterations=2, callbacks=[Overflow()])


def test_a_float16_trainer_is_refused_before_the_strategy_sets_up():
    from types import SimpleNamespace

    module, _ = make_components(pool=InProcessPool())
    module._trainer = SimpleNamespace(precision="16-mixed")
    with pytest.raises(ValueError, match=r"precision='16-mixed'\) is not supported: float16 needs a loss scaler"):
        module.setup("fit")


def test_a_nan_that_does_not_go_away_stops_the_run_after_max_consecutive_skips():
    guard = NonFiniteGuard("skip", max_consecutive_skips=3)
    for _ in range(2):
        guard.inspect({"loss": torch.tensor(float("nan"))}, [1])
        assert not guard.step_is_finite(torch.tensor(0.0))
    assert guard.step_is_finite(torch.tensor(1.0)) and guard.consecutive_skips == 0  # a good step resets the count
    for _ in range(2):
        guard.inspect({"loss": torch.tensor(float("nan"))}, [1])
        guard.step_is_finite(torch.tensor(0.0))
    guard.inspect({"loss": torch.tensor(float("nan"))}, [2])
    with pytest.raises(
        FloatingPointError,
        match=r"3 optimizer steps in a row were skipped, the last for non-finite loss on prompts \[2\]",
    ):
        guard.step_is_finite(torch.tensor(0.0))


def test_the_guard_refuses_an_unknown_policy_and_keeps_its_count_in_checkpoints():
    with pytest.raises(ValueError, match="on_nonfinite='ignore'; choose one of"):
        NonFiniteGuard("ignore")
    guard = NonFiniteGuard("skip")
    guard.inspect({"loss": torch.tensor(float("inf"))}, [1])
    assert not guard.step_is_finite(torch.tensor(0.0))
    restored = NonFiniteGuard("skip")
    restored.load_state_dict(guard.state_dict())
    assert restored.skipped_steps == 1
