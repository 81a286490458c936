"""The GRPO family under streaming: the update equals a straightforward full-batch implementation,
whatever the arrival order and micro-batch split, for every loss aggregation, with mini-batches and
several passes; dynamic sampling keeps the group count and loses no prompt."""

from __future__ import annotations

import copy
import functools
import random

import lightning
import pytest
import torch
from lightning.pytorch import Callback

from lit_parl import GRPOModule, GRPOObjective, IterationShape, Packing, RolloutDataModule, tiny_qwen2
from lit_parl.callbacks import WeightSync
from lit_parl.rollout import RolloutPool
from lit_parl.rollout.records import GroupCompletions, SamplingParams
from lit_parl.tasks import CopyTask
from lit_parl.trainer.grpo_objective import LOSS_AGGREGATIONS

PROMPTS, G, MAX_NEW = 8, 4, 6
LR = 0.5


class ScriptedTask(CopyTask):
    """Prompt i's answer spells i, so the scripted reward can depend on the prompt: prompts whose id is a
    multiple of ``equal_every`` give all-equal rewards, the others a fixed function of the completion."""

    def __init__(self, equal_every: int = 3) -> None:
        super().__init__()
        self.equal_every = equal_every

    def make(self, index: int) -> tuple[str, str]:
        return super().make(index)[0], str(index)

    def reward(self, answer_ids, completion_ids, eos_id) -> float:
        prompt_id = int("".join(str(token - 3) for token in answer_ids))  # the character tokenizer: "0" is id 3
        if prompt_id % self.equal_every == 0:
            return 0.5
        return random.Random(f"{prompt_id}/{list(completion_ids)}").random()


class ScriptedPool(RolloutPool):
    """An in-process pool whose rollouts are a fixed function of (prompt_id, version): ragged completions,
    handed out in a seeded order (as if some groups were slow)."""

    backend = "scripted"

    def __init__(self, order_seed: int = 0) -> None:
        super().__init__()
        self.order_seed = order_seed
        self.requests = []
        self.calls = 0  # generate calls: one per round of requests
        self.eos_id = None

    def _start(self, spec):
        self.eos_id = spec.eos_id

    def _sync_weights(self, buckets, version):
        for _ in buckets:
            pass

    def _generate(self, requests, sampling):
        self.calls += 1
        self.requests.extend(requests)
        groups = [self.rollout(r.prompt_id, r.version) for r in requests]
        random.Random(self.order_seed + 1000 * self.version).shuffle(groups)
        yield from groups

    def rollout(self, prompt_id: int, version: int) -> GroupCompletions:
        rng = random.Random(f"{prompt_id}/{version}")
        completions, reasons = [], []
        for _ in range(G):
            length = rng.randint(1, MAX_NEW)
            tokens = [rng.randrange(3, 13) for _ in range(length)]
            stop = rng.random() < 0.5
            if stop:
                tokens[-1] = self.eos_id
            completions.append(tokens)
            reasons.append("stop" if stop else "length")
        return GroupCompletions(
            prompt_id, version, list(range(G)), completions, [[-1.0] * len(c) for c in completions], reasons
        )

    def _worker_counts(self):
        return (1, 1)

    def _close(self):
        pass

    def logprob_tolerance(self):
        return None  # scripted log-probs (-1 per token), not drawn from the policy: nothing to compare with θ_k


def components(
    objective: GRPOObjective,
    pool: ScriptedPool,
    micro_batch_size: int,
    mini_batches: int = 1,
    passes: int = 1,
    task=None,
    packing: str = "auto",
    **module_kwargs,
):
    policy, tokenizer = tiny_qwen2(seed=0)
    shape = IterationShape(PROMPTS, G, micro_batch_size, mini_batches, passes)
    module = GRPOModule(policy, objective, shape, tokenizer=tokenizer, **module_kwargs)
    task = task or ScriptedTask()
    data = RolloutDataModule(
        task,
        [task.reward],
        pool,
        tokenizer,
        shape,
        objective,
        initial_model=policy,
        sampling=SamplingParams(max_new_tokens=MAX_NEW),
        packing=Packing(packing),
        trainer_threads=1,
    )
    return module, data


def train(
    objective_kwargs: dict,
    iterations: int = 1,
    micro_batch_size: int = 8,
    order_seed: int = 0,
    packing: str = "auto",
    mini_batches: int = 1,
    passes: int = 1,
):
    # plain SGD and no clipping: the update is -lr x gradient, so a wrong normaliser (even a uniform
    # factor, which Adam's first step and norm clipping would hide) shows in the weights
    pool = ScriptedPool(order_seed=order_seed)
    module, data = components(
        GRPOObjective(**objective_kwargs),
        pool,
        micro_batch_size,
        mini_batches,
        passes,
        packing=packing,
        max_grad_norm=None,
        optimizer=functools.partial(torch.optim.SGD, lr=LR),
    )
    initial = copy.deepcopy(module.policy)
    trainer = lightning.Trainer(
        accelerator="cpu",
        max_epochs=iterations,
        callbacks=[WeightSync()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return module, initial, pool, data, data.tokenizer


def reference_update(
    initial, pool: ScriptedPool, data: RolloutDataModule, objective: dict, mini_batches: int = 1, passes: int = 1
):
    """One iteration done the plain way: all rollouts first, per-sample unpadded forwards, the loss
    written out per token, one AdamW step per mini-batch of schedule positions."""
    model = copy.deepcopy(initial).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    eps_low = objective.get("clip_eps", 0.2)
    eps_high = objective.get("clip_eps_high") or eps_low
    mode = objective.get("loss_aggregation", "seq-mean-token-mean")
    samples = []  # (slot, prompt ids, completion, advantage)
    for slot in range(PROMPTS):
        drawn = data.schedule.draw([slot], 0)[slot]
        request = drawn.request
        group = pool.rollout(slot, 0)
        r = torch.tensor(
            [data.data.reward(list(drawn.answer_ids), c, pool.eos_id) for c in group.completions], dtype=torch.float64
        )
        adv = torch.zeros(G, dtype=torch.float64) if bool((r == r[0]).all()) else (r - r.mean()) / (r.std() + 1e-6)
        for k in range(G):
            samples.append((slot, list(request.prompt_tokens), group.completions[k], float(adv[k])))

    def logprobs(m, prompt, completion):
        ids = torch.tensor([prompt + completion])
        logits = m(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)]
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]

    with torch.no_grad():
        old = [logprobs(model, p, c) for _, p, c, _ in samples]
    per_block = PROMPTS // mini_batches
    for _ in range(passes):
        for block in range(mini_batches):
            members = [i for i, s in enumerate(samples) if s[0] // per_block == block]
            total, normaliser = 0.0, 0.0
            for i in members:
                _, prompt, completion, adv = samples[i]
                logp = logprobs(model, prompt, completion)
                ratio = torch.exp(logp - old[i])
                per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
                if mode == "token-mean":
                    total, normaliser = total + per_token.sum(), normaliser + len(completion)
                elif mode == "seq-mean-token-sum":
                    total, normaliser = total + per_token.sum(), normaliser + 1
                elif mode == "seq-mean-token-mean":
                    total, normaliser = total + per_token.mean(), normaliser + 1
                else:  # seq-mean-token-sum-norm
                    total, normaliser = total + per_token.sum(), normaliser + objective["max_length"]
            optimizer.zero_grad()
            (total / normaliser).backward()
            optimizer.step()
    return model


def assert_same_weights(model_a, model_b, atol=1e-6):
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values()):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_streamed_update_equals_the_full_batch_update(aggregation):
    objective = {"loss_aggregation": aggregation, "max_length": MAX_NEW}
    reference = None
    for micro_batch_size, order_seed, packing in [(8, 0, "shared_prompt"), (32, 1, "padded"), (4, 2, "auto")]:
        module, initial, pool, data, _ = train(
            objective, micro_batch_size=micro_batch_size, order_seed=order_seed, packing=packing
        )
        if reference is None:
            reference = reference_update(initial, pool, data, objective)
            moved = max((a - b).abs().max() for a, b in zip(reference.parameters(), initial.parameters()))
            assert moved > 1e-3, "the reference step did not move the weights: the comparison would prove nothing"
        assert_same_weights(module.policy, reference)


@pytest.mark.parametrize("mini_batches,passes", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_mini_batches_and_passes_equal_the_full_batch_implementation(mini_batches, passes):
    objective = {"loss_aggregation": "token-mean", "clip_eps": 0.1, "clip_eps_high": 0.15}
    first = None
    for micro_batch_size, order_seed in [(4, 0), (8, 5)]:
        module, initial, pool, data, _ = train(
            objective,
            micro_batch_size=micro_batch_size,
            order_seed=order_seed,
            mini_batches=mini_batches,
            passes=passes,
        )
        assert module.trainer.global_step == mini_batches * passes
        if first is None:
            first = reference_update(initial, pool, data, objective, mini_batches=mini_batches, passes=passes)
        assert_same_weights(module.policy, first)


def test_later_passes_see_clipping_against_the_iteration_snapshot():
    clip_fractions = []

    class Recorder(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clip_fractions.append((batch.pass_index, float(pl_module.metrics["clip_fraction"].mean_value)))

    module, data = components(
        GRPOObjective(clip_eps=0.01, loss_aggregation="token-mean"),
        ScriptedPool(),
        micro_batch_size=32,
        passes=3,
        optimizer=functools.partial(torch.optim.AdamW, lr=3e-2, weight_decay=0.0),
    )
    lightning.Trainer(
        max_epochs=1,
        callbacks=[WeightSync(), Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    assert [p for p, _ in clip_fractions] == [0, 1, 2]
    assert clip_fractions[0][1] == 0.0  # pass 0: the policy is θ_k, ratio 1
    assert clip_fractions[-1][1] > 0.0  # later passes: the policy moved away from θ_k and the clip bites


def test_dynamic_sampling_keeps_the_group_count_and_loses_no_prompt():
    seen = []

    class Recorder(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch)

    pool = ScriptedPool()
    module, data = components(
        GRPOObjective(dynamic_sampling=True, loss_aggregation="token-mean"),
        pool,
        micro_batch_size=8,
        task=ScriptedTask(equal_every=3),
    )  # prompt ids divisible by 3 give all-equal rewards
    lightning.Trainer(
        max_epochs=3,
        callbacks=[WeightSync(), Recorder()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    requested = [r.prompt_id for r in pool.requests]
    assert len(requested) == len(set(requested)), "a prompt was generated twice"
    assert requested == list(range(len(requested))), "the cursor skipped prompts"
    dropped = [p for p in requested if p % 3 == 0]
    for iteration in range(3):
        trained = [(p, s) for b in seen if b.version == iteration for p, s in zip(b.prompt_ids, b.sample_indices)]
        prompts = {p for p, _ in trained}
        assert len(prompts) == PROMPTS and len(trained) == PROMPTS * G, "dynamic sampling changed the group count"
        assert not prompts & set(dropped), "a zero-variance group was trained"
    # every drawn prompt was either trained exactly once or dropped
    trained_ids = sorted(p for b in seen for p in set(b.prompt_ids))
    assert sorted(trained_ids + dropped) == requested
    assert sum(s.dropped_groups for s in data.history) == len(dropped)
    # every round's generation time is booked, not only the last round's
    assert sum(len(s.gen_intervals) for s in data.history) == pool.calls > 3
    assert data.schedule.cursor == len(requested)


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "dapo", "gspo", "rloo"])
def test_every_preset_trains_through_the_cli(tmp_path, preset):
    from hydra import compose, initialize_config_module

    from lit_parl.cli import run

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        cfg = compose(
            config_name="config",
            overrides=[
                f"algorithm={preset}",
                "iterations=2",
                f"run_dir={tmp_path}",
                "checkpoint_every=0",
                "shape.prompts=8",
                "shape.micro_batch_size=16",
                "model.hidden_size=64",
                "model.intermediate_size=128",
            ],
        )
    summary = run(cfg)
    assert summary["iterations"] == 2
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    for column in (
        "reward",
        "reward_std",
        "accuracy",
        "length/mean",
        "length/max",
        "truncation_rate",
        "clip_fraction",
        "entropy",
        "zero_variance_share",
        "approx_kl",
        "grad_norm",
        "mismatch/logprob_abs_diff",
        "mismatch/kl",
    ):
        assert column in header, column


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    """Checkpoint at an iteration boundary, resume in a fresh process state: same prompts, same weights as
    an uninterrupted run (the resume bugs: re-run or skipped prompts, lost cursor)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(iterations, ckpt_path=None, checkpoint_dir=None):
        pool = ScriptedPool()
        module, data = components(
            GRPOObjective(beta=0.04),
            pool,
            micro_batch_size=8,
            mini_batches=2,
            optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0),
        )
        callbacks = [WeightSync()]
        if checkpoint_dir:
            callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, every_n_epochs=1, save_top_k=-1, save_last=True))
        lightning.Trainer(
            max_epochs=iterations,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=bool(checkpoint_dir),
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, pool, data

    straight, straight_pool, _ = run(4)
    run(2, checkpoint_dir=tmp_path)
    resumed, resumed_pool, data = run(4, ckpt_path=str(tmp_path / "last.ckpt"))
    assert [(r.prompt_id, r.version) for r in resumed_pool.requests] == [
        (r.prompt_id, r.version) for r in straight_pool.requests[2 * PROMPTS :]
    ]
    assert data.schedule.cursor == 4 * PROMPTS and data.iterations_done == 4
    assert_same_weights(resumed.policy, straight.policy)
    assert_same_weights(resumed.reference, straight.reference)  # θ_0 survives the checkpoint


def test_the_learning_rate_schedule_is_stepped_once_per_optimizer_step():
    """Manual optimisation: the module steps the schedule itself, after each optimizer step."""
    from lit_parl import WarmupSchedule

    rates = []

    class Rates(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rates.append(pl_module.optimizers().param_groups[0]["lr"])

    module, data = components(
        GRPOObjective(),
        ScriptedPool(),
        micro_batch_size=16,
        mini_batches=2,
        optimizer=functools.partial(torch.optim.SGD, lr=0.4),
        lr_schedule=WarmupSchedule(warmup_steps=2, decay="cosine"),
    )
    lightning.Trainer(
        max_epochs=2,
        callbacks=[WeightSync(), Rates()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module, datamodule=data)
    # 2 iterations x 2 optimizer steps = 4 steps (the fit's length, from max_epochs); one micro-batch per step
    assert [round(r, 6) for r in rates] == [0.2, 0.4, 0.4, 0.2]  # warmup 1/2, 2/2; cosine at 0, then half way
