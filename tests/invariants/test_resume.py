"""Resume anywhere: from a checkpoint written at any optimizer step, inside an iteration or at its end, a fit
ends with the weights of an uninterrupted one and trains every sample once; a checkpoint that cannot resume
exactly (between the micro-batches of one step) is refused when it is loaded."""

from __future__ import annotations

import lightning
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.utils import instantiate
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

import lit_parl.callbacks
from helpers.components import BatchRecorder, make_components, policy_state, sgd
from helpers.pools import InProcessPool
from lit_parl import GRPOObjective
from lit_parl.callbacks import PipelineTimeline, RunSummary, WeightSync, load_timeline

ITERATIONS = 3
STEPS_PER_ITERATION = 4  # mini_batches=2 x passes=2


def run(
    tmp_path,
    *,
    ckpt_path=None,
    save_every_step=False,
    callbacks=(),
    dynamic=False,
    weight_sync=True,
    epochs=ITERATIONS,
    lora=None,
    seed=0,
):
    objective = GRPOObjective(beta=0.04, dynamic_sampling=dynamic)
    torch.manual_seed(0)  # LoRA's initial A matrices are drawn: the same in every run
    module, datamodule = make_components(
        pool=InProcessPool(),
        prompts=8,
        group_size=4,
        micro_batch_size=8,
        mini_batches=2,
        passes=2,
        objective=objective,
        lora=lora,
        seed=seed,
        **sgd(0.5),
    )
    recorder = BatchRecorder()
    checkpoints = (
        [ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1)]
        if save_every_step
        else []
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=[*([WeightSync()] if weight_sync else []), recorder, *checkpoints, *callbacks],
        logger=False,
        enable_checkpointing=save_every_step or any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
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
        resumed, resumed_data, resumed_batches = run(
            tmp_path / f"resume{step}", ckpt_path=str(tmp_path / "saved" / f"step={step}.ckpt"), dynamic=dynamic
        )
        for name, tensor in policy_state(straight).items():
            torch.testing.assert_close(
                resumed.policy.state_dict()[name], tensor, rtol=1e-5, atol=1e-7, msg=f"step {step}: {name}"
            )
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
        def _send(self, load, named_tensors, version):
            named_tensors = [(name, tensor.clone()) for name, tensor in named_tensors]
            pushed.append((version, dict(named_tensors)))
            super()._send(load, named_tensors, version)

    checkpoint = torch.load(tmp_path / "saved" / "step=5.ckpt", weights_only=False)
    module, datamodule = make_components(
        pool=InProcessPool(),
        prompts=8,
        group_size=4,
        micro_batch_size=8,
        mini_batches=2,
        passes=2,
        objective=GRPOObjective(beta=0.04),
        **sgd(0.5),
    )
    lightning.Trainer(
        accelerator="cpu",
        max_epochs=2,
        callbacks=[Recording()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=datamodule, ckpt_path=str(tmp_path / "saved" / "step=5.ckpt"))
    version, weights = pushed[0]
    assert version == 1
    state = checkpoint["state_dict"]
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, state[f"old.{name}"], rtol=0, atol=0)
    assert any(
        not torch.equal(state[f"old.{name}"], state[f"policy.{name}"]) for name in weights
    )  # θ_k is not the policy


def cli_callbacks(run_dir) -> list:
    """The callbacks ``lit-parl`` installs by default (``conf/callbacks/default.yaml``), writing into ``run_dir``;
    its ModelCheckpoint left out (these tests write their own), and Lightning's progress bar (they run without one)."""
    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"run_dir={run_dir}", "checkpoint_every=0"])
    left_out = ("checkpoint", "progress")
    return [instantiate(node) for name, node in cfg.callbacks.items() if node is not None and name not in left_out]


@pytest.mark.parametrize(
    "step", [4, 5, 6], ids=["after_an_iterations_last_step", "inside_an_iteration", "in_its_second_pass"]
)
def test_resume_with_the_callbacks_the_cli_installs(tmp_path, step):
    """Every shipped callback, as the CLI installs it, survives a restart inside an epoch (Lightning skips the epoch's
    start) and after an iteration's last step (Lightning then skips the epoch's end too): the fit ends with the
    uninterrupted weights, and the summary and the timeline count every iteration once."""
    straight, _, _ = run(tmp_path / "straight")
    saved = cli_callbacks(tmp_path / "saved")
    shipped = {getattr(lit_parl.callbacks, name) for name in lit_parl.callbacks.__all__}
    assert {type(c) for c in saved} == {c for c in shipped if isinstance(c, type) and issubclass(c, Callback)}
    run(tmp_path / "saved", save_every_step=True, callbacks=saved, weight_sync=False)
    resumed_callbacks = cli_callbacks(tmp_path / "resumed")
    resumed, _, _ = run(
        tmp_path / "resumed",
        ckpt_path=str(tmp_path / "saved" / f"step={step}.ckpt"),
        callbacks=resumed_callbacks,
        weight_sync=False,
    )
    assert_same_policy(resumed, straight)
    summary = next(c for c in resumed_callbacks if isinstance(c, RunSummary)).summary
    assert (summary["iterations"], summary["completions"]) == (ITERATIONS, ITERATIONS * 8 * 4), summary
    timeline = next(c for c in resumed_callbacks if isinstance(c, PipelineTimeline))
    assert timeline.count == ITERATIONS
    restored = (step - 1) // STEPS_PER_ITERATION + (
        step % STEPS_PER_ITERATION == 0
    )  # iterations booked in the checkpoint
    lines = load_timeline(tmp_path / "resumed" / "timeline.jsonl")
    assert [line["iteration"] for line in lines] == list(range(restored, ITERATIONS))


def test_the_last_checkpoint_of_a_finished_fit_resumes_a_longer_one(tmp_path):
    """The CLI's ModelCheckpoint (``save_last``) writes ``last.ckpt`` as the fit ends, once the loop has counted
    its last epoch: that checkpoint is between iterations, and a longer fit resumed from it (``lit-parl
    iterations=N resume=<run>``) ends on the uninterrupted weights."""
    straight, _, _ = run(tmp_path / "straight")
    last = ModelCheckpoint(dirpath=tmp_path / "short", every_n_epochs=100, save_last=True)
    run(tmp_path / "short", callbacks=[last], epochs=ITERATIONS - 1)
    resumed, _, _ = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "short" / "last.ckpt"))
    assert_same_policy(resumed, straight)


def test_lora_checkpoints_hold_the_adapters_only_and_resume_exactly(tmp_path):
    """With LoRA, θ_k is the snapshot adapter beside the trained one (lit_parl.models.lora), and the frozen base is
    θ_0: a checkpoint holds the adapters and their optimizer state only (θ_k's adapter inside an iteration), and a
    fit resumed at an iteration's end or in iteration 1's second pass (pushing base + θ_k's adapter product) ends on
    the uninterrupted weights; a module built from another base is refused."""
    lora = {"rank": 4, "alpha": 8.0}
    straight, _, _ = run(tmp_path / "straight", lora=lora)
    run(tmp_path / "saved", save_every_step=True, lora=lora)
    boundary = torch.load(tmp_path / "saved" / "step=4.ckpt", weights_only=False)["state_dict"]
    inside = torch.load(tmp_path / "saved" / "step=6.ckpt", weights_only=False)["state_dict"]
    assert boundary and all(".lora_" in name and ".default." in name for name in boundary), "the frozen base was saved"
    assert {name for name in inside if ".theta_k." not in name} == set(boundary)
    assert any(".theta_k." in name for name in inside), "θ_k's adapter is needed inside an iteration"
    for step in (4, 6):
        resumed, _, _ = run(
            tmp_path / f"resumed{step}", ckpt_path=str(tmp_path / "saved" / f"step={step}.ckpt"), lora=lora
        )
        assert_same_policy(resumed, straight)
    with pytest.raises(ValueError, match="another reference model"):  # a module built from another base model
        run(tmp_path / "other", ckpt_path=str(tmp_path / "saved" / "step=4.ckpt"), lora=lora, seed=1)


def assert_same_policy(module, expected, exact: bool = False) -> None:
    """The same policy weights; ``exact``: bit for bit."""
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-7}
    for name, tensor in policy_state(expected).items():
        torch.testing.assert_close(module.policy.state_dict()[name], tensor, **tolerance, msg=name)


class SaveAt(Callback):
    """Writes ``path`` after micro-batch ``batch_idx`` of epoch ``epoch`` (between two micro-batches of one step),
    or, with ``stop=True``, stops the fit there (as max_time does) and writes it at that epoch's end."""

    def __init__(self, path, epoch: int, batch_idx: int, stop: bool = False) -> None:
        self.path, self.epoch, self.batch_idx, self.stop = path, epoch, batch_idx, stop

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch_idx):
            if self.stop:
                trainer.should_stop = True
            else:
                trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer, pl_module):
        if self.stop and trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_between_the_micro_batches_of_one_step_resumes_from_that_steps_start(tmp_path):
    """The weights in it are those of the last step; the micro-batch after it is trained again, from them."""
    straight, _, straight_batches = run(tmp_path / "straight")
    _, _, before = run(
        tmp_path / "saved", callbacks=[SaveAt(tmp_path / "mid_step.ckpt", epoch=1, batch_idx=2)]
    )  # after step 5's first
    resumed, _, resumed_batches = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "mid_step.ckpt"))
    assert_same_policy(resumed, straight)
    per_step = len(straight_batches.samples()) // (ITERATIONS * 2)
    assert straight_batches.samples()[: 3 * per_step] + resumed_batches.samples() == straight_batches.samples()


@pytest.mark.parametrize("batch_idx", [2, 3], ids=["between_micro_batches", "at_a_step"])
def test_a_fit_stopped_inside_an_iteration_resumes_inside_it(tmp_path, batch_idx):
    """max_time stops a fit inside an iteration and `last.ckpt` is written at that epoch's end. Lightning would
    resume at the next epoch (the next iteration, early); the checkpoint says the epoch is unfinished, so the
    resumed fit finishes the interrupted iteration first and ends with the uninterrupted run's weights."""
    straight, straight_data, straight_batches = run(tmp_path / "straight")
    run(tmp_path / "stopped", callbacks=[SaveAt(tmp_path / "last.ckpt", epoch=1, batch_idx=batch_idx, stop=True)])
    resumed, resumed_data, resumed_batches = run(tmp_path / "resumed", ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_policy(resumed, straight)
    assert resumed_data.schedule.cursor == straight_data.schedule.cursor and resumed_data.iterations_done == ITERATIONS
    per_step = len(straight_batches.samples()) // (ITERATIONS * 2)
    steps_before = 2 + (batch_idx + 1) // 2  # iteration 0's two, and iteration 1's whole steps before the stop
    assert (
        straight_batches.samples()[: steps_before * per_step] + resumed_batches.samples() == straight_batches.samples()
    )


def test_a_checkpoint_written_by_a_resumed_fit_resumes_too(tmp_path):
    """Resume from an iteration's last micro-batch (Lightning skips the next epoch's start), save every step, and
    resume again from inside the following iteration: the chain ends with the uninterrupted weights."""
    straight, _, _ = run(tmp_path / "straight")
    run(tmp_path / "first", save_every_step=True)
    run(tmp_path / "second", ckpt_path=str(tmp_path / "first" / "step=4.ckpt"), save_every_step=True)
    resumed, _, _ = run(tmp_path / "third", ckpt_path=str(tmp_path / "second" / "step=6.ckpt"))
    assert_same_policy(resumed, straight)


def test_a_checkpoint_without_its_position_in_the_iteration_is_refused(tmp_path):
    """Written inside an iteration by a version that did not record how far it was: stop, rather than train off."""
    run(tmp_path, save_every_step=True)
    checkpoint = torch.load(tmp_path / "step=5.ckpt", weights_only=False)
    del checkpoint["RolloutDataModule"]["trained_in_iteration"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    with pytest.raises(RuntimeError, match="did not record its position"):
        run(tmp_path / "resumed", ckpt_path=str(tmp_path / "old.ckpt"))


def test_resuming_inside_an_iteration_on_another_number_of_ranks_is_refused():
    from lit_parl.data.iteration_shape import IterationShape
    from lit_parl.data.rank_share import RankShare
    from lit_parl.data.resume_point import ResumePoint

    share = RankShare(IterationShape(prompts=8, group_size=4, micro_batch_size=8, mini_batches=2))
    with pytest.raises(ValueError, match="by 2 rank.*this fit has 1"):
        ResumePoint().load({"iterations_done": 1, "trained_in_iteration": 2, "world": 2}, share)
    ResumePoint().load(
        {"iterations_done": 1, "trained_in_iteration": 0, "world": 2}, share
    )  # between iterations: any number


def test_checkpoints_leave_out_the_models_the_module_rebuilds(tmp_path):
    """θ_0 is rebuilt from the initial model (and checked against it); θ_k is stored only inside an iteration. A
    fit resumed from either checkpoint trains bit for bit as the uninterrupted one, against the rebuilt models."""
    straight, _, _ = run(tmp_path / "straight")
    run(tmp_path, save_every_step=True)
    boundary = torch.load(tmp_path / "step=4.ckpt", weights_only=False)["state_dict"]
    inside = torch.load(tmp_path / "step=5.ckpt", weights_only=False)["state_dict"]
    policy = {name for name in boundary if name.startswith("policy.")}
    assert set(boundary) == policy, "only the policy is stored between iterations"
    assert set(inside) == policy | {f"old.{name[len('policy.') :]}" for name in policy}, "and θ_k inside one"
    for step in (4, 5):
        resumed, _, _ = run(tmp_path / f"resumed{step}", ckpt_path=str(tmp_path / f"step={step}.ckpt"))
        assert_same_policy(resumed, straight, exact=True)
        theta_0 = policy_state(make_components(pool=InProcessPool())[0])  # the reference stays θ_0
        for name, tensor in resumed.reference.state_dict().items():
            assert torch.equal(tensor, theta_0[name]), f"step {step}: reference {name} is not θ_0"

    with pytest.raises(ValueError, match="another reference model"):  # a module built from another initial model
        run(tmp_path / "other", ckpt_path=str(tmp_path / "step=4.ckpt"), seed=1)


def test_resume_takes_a_checkpoint_file_or_a_run_directory(tmp_path):
    """``resume=`` names a file, or a run directory whose newest checkpoint (``checkpoints/last.ckpt``) is taken;
    a directory without one, or a path that does not exist, is refused naming what to pass instead."""
    from lit_parl.cli import checkpoint_to_resume

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    step = run_dir / "checkpoints" / "epoch=2-step=5.ckpt"
    step.write_bytes(b"")
    assert checkpoint_to_resume(None) is None
    assert checkpoint_to_resume(str(step)) == str(step)
    with pytest.raises(
        FileNotFoundError,
        match=r"no checkpoints/last.ckpt or last.ckpt; name one of its checkpoints, quoted: "
        r"\"resume='.*/run/checkpoints/epoch=2-step=5.ckpt'\"",
    ):
        checkpoint_to_resume(str(run_dir))
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    assert checkpoint_to_resume(str(run_dir)) == str(run_dir / "checkpoints" / "last.ckpt")
    with pytest.raises(FileNotFoundError, match="no such checkpoint file or run directory"):
        checkpoint_to_resume(str(tmp_path / "missing"))
