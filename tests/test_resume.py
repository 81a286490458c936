"""Resume anywhere: from a checkpoint written at any optimizer step, inside an iteration or at its end, a fit
ends with the weights of an uninterrupted one and trains every sample once; a checkpoint that cannot resume
exactly (between the micro-batches of one step) is refused when it is loaded."""

from __future__ import annotations

import lightning
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from conftest import BatchRecorder, InProcessPool, make_components, policy_state, sgd
from lit_parl import GRPOObjective
from lit_parl.callbacks import WeightSync

ITERATIONS = 3
STEPS_PER_ITERATION = 4  # mini_batches=2 x passes=2


def run(tmp_path, *, ckpt_path=None, save_every_step=False, callbacks=(), dynamic=False):
    objective = GRPOObjective(beta=0.04, dynamic_sampling=dynamic)
    module, datamodule = make_components(
        pool=InProcessPool(), prompts=8, group_size=4, micro_batch_size=8, mini_batches=2, passes=2, objective=objective, **sgd(0.5)
    )
    recorder = BatchRecorder()
    checkpoints = [ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)] if save_every_step else []
    trainer = lightning.Trainer(
        accelerator="cpu", max_epochs=ITERATIONS, callbacks=[WeightSync(), recorder, *checkpoints, *callbacks], logger=False,
        enable_checkpointing=save_every_step, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return module, datamodule, recorder


@pytest.mark.parametrize("dynamic", [False, True], ids=["grpo", "dynamic_sampling"])
def test_resume_at_any_optimizer_step_ends_with_the_uninterrupted_weights(tmp_path, dynamic):
    straight, straight_data, straight_batches = run(tmp_path / "straight", dynamic=dynamic)
    run(tmp_path / "saved", save_every_step=True, dynamic=dynamic)
    trained_before = {}  # step -> samples trained up to that checkpoint, in the uninterrupted run's order
    samples = straight_batches.samples()
    per_step = len(samples) // (ITERATIONS * 2)  # first-pass samples per optimizer step of pass 0
    for step in (1, 4, 5, 6):  # inside iteration 0, at its end, after the first step of iteration 1, in its second pass
        resumed, resumed_data, resumed_batches = run(tmp_path / f"resume{step}", ckpt_path=str(tmp_path / "saved" / f"step={step}.ckpt"), dynamic=dynamic)
        for name, tensor in policy_state(straight).items():
            torch.testing.assert_close(resumed.policy.state_dict()[name], tensor, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}")
        assert resumed_data.schedule.cursor == straight_data.schedule.cursor, step
        iteration, in_iteration = divmod(step, STEPS_PER_ITERATION)
        first_pass_steps = min(in_iteration, 2)  # steps 3 and 4 of an iteration are its second pass: no new samples
        trained_before[step] = samples[: (iteration * 2 + first_pass_steps) * per_step]
        assert trained_before[step] + resumed_batches.samples() == samples, f"step {step}: a sample replayed or skipped"


def test_the_resumed_iteration_generates_from_its_starting_weights(tmp_path):
    """The pool gets θ_k (the module's snapshot), not the policy the checkpoint holds after a step."""
    run(tmp_path / "saved", save_every_step=True)
    pushed = []

    class Recording(WeightSync):
        def _push(self, named_tensors, version):
            named_tensors = [(name, tensor.clone()) for name, tensor in named_tensors]
            pushed.append((version, dict(named_tensors)))
            super()._push(named_tensors, version)

    checkpoint = torch.load(tmp_path / "saved" / "step=5.ckpt", weights_only=False)
    module, datamodule = make_components(pool=InProcessPool(), prompts=8, group_size=4, micro_batch_size=8, mini_batches=2, passes=2,
                                         objective=GRPOObjective(beta=0.04), **sgd(0.5))
    lightning.Trainer(accelerator="cpu", max_epochs=2, callbacks=[Recording()], logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(module, datamodule=datamodule, ckpt_path=str(tmp_path / "saved" / "step=5.ckpt"))
    version, weights = pushed[0]
    assert version == 1
    state = checkpoint["state_dict"]
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, state[f"old.{name}"], rtol=0, atol=0)
    assert any(not torch.equal(state[f"old.{name}"], state[f"policy.{name}"]) for name in weights)  # θ_k is not the policy


def test_a_checkpoint_between_the_micro_batches_of_one_step_is_refused_at_load(tmp_path):
    class SaveAfterFirstMicroBatch(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.current_epoch == 1 and batch_idx == 0:
                trainer.save_checkpoint(tmp_path / "mid_step.ckpt")

    run(tmp_path, callbacks=[SaveAfterFirstMicroBatch()])
    with pytest.raises(ValueError, match=r"between two micro-batches of one optimizer step .*every_n_train_steps"):
        run(tmp_path / "resumed", ckpt_path=str(tmp_path / "mid_step.ckpt"))


def test_checkpoints_leave_out_the_models_the_module_rebuilds(tmp_path):
    """θ_0 is rebuilt from the initial model (and checked against it); θ_k is stored only inside an iteration."""
    run(tmp_path, save_every_step=True)
    boundary = torch.load(tmp_path / "step=4.ckpt", weights_only=False)["state_dict"]
    inside = torch.load(tmp_path / "step=5.ckpt", weights_only=False)["state_dict"]
    assert not any(name.startswith(("reference.", "old.")) for name in boundary)
    assert any(name.startswith("old.") for name in inside) and not any(name.startswith("reference.") for name in inside)

    module, datamodule = make_components(pool=InProcessPool(), prompts=8, group_size=4, micro_batch_size=8, mini_batches=2, passes=2,
                                         objective=GRPOObjective(beta=0.04), seed=1, **sgd(0.5))  # another initial model
    trainer = lightning.Trainer(accelerator="cpu", max_epochs=ITERATIONS, callbacks=[WeightSync()], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="another reference model"):
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(tmp_path / "step=4.ckpt"))
