"""The on-policy invariants of docs/design.md, each proven on real training runs (tiny model, real pool)."""

from __future__ import annotations

import random

import pytest
import torch
from lightning.pytorch import Callback

from lit_parl import GRPOObjective, OffPolicyError, Packing
from lit_parl.rollout import HFRolloutPool, PoolSpec
from lit_parl.tasks import CopyTask

from conftest import WrappedPool, fit, make_components, policy_state


def _pool() -> HFRolloutPool:
    return HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)


def _assert_same_weights(a: dict, b: dict, atol: float = 1e-6, rtol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


class ShufflingPool(WrappedPool):
    """Hands groups out in a different order than they finished (a pool where some groups are slow)."""

    def __init__(self, inner, seed: int = 0) -> None:
        super().__init__(inner)
        self.rng = random.Random(seed)

    def transform(self, groups):
        groups = list(groups)
        self.rng.shuffle(groups)
        yield from groups


class BatchRecorder(Callback):
    def __init__(self) -> None:
        self.batches = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch))


def test_sync_and_async_end_with_the_same_weights():
    """Invariant 5: the colocated baseline and periodic asynchrony train the same model from the same rollouts."""
    weights = {}
    for mode in ("sync", "async"):
        module, data = make_components(mode=mode, pool=_pool())
        initial = policy_state(module)
        fit(module, data, iterations=3)
        weights[mode] = policy_state(module)
        assert data.iterations_done == 3
    assert any(not torch.equal(initial[k], weights["async"][k]) for k in initial), "training changed nothing"
    _assert_same_weights(weights["sync"], weights["async"])


def test_arrival_order_and_micro_batch_split_do_not_change_the_update():
    """Invariant 4: groups arriving shuffled, in micro-batches of another size, give the same weights."""
    module_a, data_a = make_components(mode="async", pool=_pool(), micro_batch_size=8)
    fit(module_a, data_a, iterations=3)
    module_b, data_b = make_components(mode="async", pool=ShufflingPool(_pool(), seed=1), micro_batch_size=16)
    fit(module_b, data_b, iterations=3)
    _assert_same_weights(policy_state(module_a), policy_state(module_b))


def test_token_mean_is_normalised_over_the_whole_iteration_not_per_micro_batch():
    """token-mean divides by the iteration's token count, known only at the step: split-invariant too."""
    objective = lambda: GRPOObjective(loss_aggregation="token-mean")  # noqa: E731
    module_a, data_a = make_components(pool=_pool(), micro_batch_size=32, objective=objective())
    fit(module_a, data_a, iterations=2)
    module_b, data_b = make_components(pool=ShufflingPool(_pool(), seed=3), micro_batch_size=4, objective=objective())
    fit(module_b, data_b, iterations=2)
    _assert_same_weights(policy_state(module_a), policy_state(module_b))


def test_out_of_order_groups_are_each_trained_exactly_once_with_their_own_completions():
    """Invariant 3: results are paired with prompts by id, never by arrival order."""
    pool = ShufflingPool(_pool(), seed=7)
    recorder = BatchRecorder()
    module, data = make_components(pool=pool, prompts=8, group_size=4, micro_batch_size=8)
    fit(module, data, iterations=3, callbacks=[recorder])

    returned = {(g.version, g.prompt_id): g for g in pool.returned}
    task = CopyTask(seed=0)
    trained = []
    for epoch, batch in recorder.batches:
        for row, (prompt_id, sample) in enumerate(zip(batch.prompt_ids, batch.sample_indices)):
            trained.append((epoch, prompt_id, sample))
            assert batch.version == epoch
            group = returned[(batch.version, prompt_id)]
            prompt_ids = data.tokenizer(task.make(prompt_id)[0], add_special_tokens=False).input_ids
            completion = group.completions[group.sample_indices.index(sample)]
            tokens = batch.tokens
            width = tokens.completion_mask.shape[1]
            labels = tokens.label_slots // width == row
            inputs = tokens.input_ids.reshape(-1)
            assert tokens.label_targets[labels].tolist() == completion, "row carries another prompt's completion"
            first = int(tokens.label_positions[labels][0])  # the prompt's last token predicts completion[0]
            assert inputs[first - len(prompt_ids) + 1 : first + 1].tolist() == prompt_ids, "completion is not attached to its own prompt"
            answer = data.tokenizer(task.make(prompt_id)[1], add_special_tokens=False).input_ids
            assert batch.rewards[row].item() == pytest.approx(task.reward(answer, completion, data.tokenizer.eos_token_id))
    # every scheduled prompt of every iteration, every sample, exactly once
    expected = [(epoch, epoch * 8 + p, s) for epoch in range(3) for p in range(8) for s in range(4)]
    assert sorted(trained) == sorted(expected)
    # and the shuffling really reordered the stream
    arrival = [g.prompt_id for g in pool.returned[:8]]
    assert arrival != sorted(arrival)


class StaleVersionPool(WrappedPool):
    def transform(self, groups):
        for group in groups:
            if self.inner.version == 1:
                group.version = 0  # as if a worker had kept θ_0 for this group
            yield group


def test_a_trajectory_of_another_policy_version_is_an_error():
    """Invariant 1: off-policy data is refused, not warned about."""
    module, data = make_components(pool=StaleVersionPool(_pool()))
    with pytest.raises(OffPolicyError, match=r"generated by policy version 0, but the iteration trains version 1"):
        fit(module, data, iterations=3)
    assert data.iterations_done == 1  # iteration 0 was fine


class GateRecorder(WrappedPool):
    """Records the pool's view: which version it holds when a request arrives."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.events = []

    def _sync_weights(self, buckets, version):
        self.events.append(("sync_start", version, self.inner.version))
        super()._sync_weights(buckets, version)
        self.events.append(("synced", version, self.inner.version))

    def _generate(self, requests, sampling):
        self.events.append(("request", sorted({r.version for r in requests}), self.inner.version))
        yield from super()._generate(requests, sampling)


def test_no_request_reaches_the_pool_before_it_holds_the_new_version():
    """Invariant 2, observed from the pool's side over a real fit (Lightning prefetch included)."""
    pool = GateRecorder(_pool())
    module, data = make_components(pool=pool)
    fit(module, data, iterations=3)
    requests = [e for e in pool.events if e[0] == "request"]
    assert [versions for _, versions, _ in requests] == [[0], [1], [2]]
    for kind, versions, held in requests:
        assert held == versions[0], f"a request for {versions} reached a pool holding {held}"
    # each request comes after the matching sync finished and before the next sync starts
    kinds = [(e[0], e[1] if e[0] != "request" else e[1][0]) for e in pool.events]
    assert kinds == [(k, v) for v in range(3) for k in ("sync_start", "synced", "request")]
    # the workers stamped every group with the version they held
    assert sorted({g.version for g in pool.returned}) == [0, 1, 2]


def test_the_pool_itself_refuses_requests_for_a_version_it_does_not_hold(hf_pool):
    """The gate is enforced inside the pool, and inside each worker, not only by the trainer."""
    module, data = make_components(pool=hf_pool)
    hf_pool.start(PoolSpec(data._model_dir.path(), data.tokenizer.eos_token_id, data.tokenizer.pad_token_id))
    hf_pool.sync_weights([list(module.policy.named_parameters())], version=0)
    ahead = list(data.schedule.requests(list(range(8)), version=1).values())
    with pytest.raises(RuntimeError, match=r"version gate: requests for policy version\(s\) \[1\] reached a pool holding version 0"):
        list(hf_pool.generate(ahead, data.sampling))
    hf_pool.check_requests = lambda requests: None  # bypass the pool's check: the worker must still refuse
    with pytest.raises(RuntimeError, match=r"worker 0 holds policy version 0 but got requests for \[1\]"):
        list(hf_pool.generate(ahead, data.sampling))


class ConstantTask(CopyTask):
    def reward(self, answer_ids, completion_ids, eos_id):
        return 2 / 3  # not exactly representable: the mean must not leave a rounding residue


def test_all_equal_rewards_give_zero_advantage_and_no_update():
    """Zero-variance groups do not crash (zero grad norm) and move no weight."""
    module, data = make_components(pool=_pool(), task=ConstantTask())
    before = policy_state(module)
    fit(module, data, iterations=2)
    after = policy_state(module)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} moved without any advantage"


def test_a_zero_advantage_group_contributes_no_gradient():
    """Invariant check at the loss level: the gradient of a zero-advantage group is exactly zero."""
    from lit_parl.trajectory import Trajectory, collate

    module, data = make_components()
    rewards = torch.full((4,), 2 / 3)
    advantages = module.objective.advantages(module.objective.shape_rewards(rewards, torch.tensor([2, 3, 2, 3]), torch.zeros(4, dtype=torch.bool), 6))
    assert torch.equal(advantages, torch.zeros(4))
    trajectories = [
        Trajectory(0, s, 0, [5, 6, 41], [5, 6, 1][: 2 + s % 2], [-1.0] * (2 + s % 2), 0.25, float(advantages[s]), False)
        for s in range(4)
    ]
    batch = collate(trajectories, pad_id=0, sample_offset=0)
    logp = module.completion_logprobs(module.policy, batch)
    terms = module.objective(logp, logp.detach(), None, batch.advantages, batch.completion_mask)
    terms.loss_sum.backward()
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_several_mini_batches_use_the_exact_snapshot_of_the_iteration_as_old_policy():
    """With two optimizer steps per iteration the old log-probs come from θ_k, not the half-updated policy."""
    seen = []

    class OldChecker(Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            seen.append(("start", {k: v.clone() for k, v in pl_module.policy.state_dict().items()}))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            old = pl_module.old.state_dict()
            assert all(torch.equal(old[k], v) for k, v in seen[-1][1].items()), "old policy is not θ_k"

    module, data = make_components(pool=_pool(), mini_batches=2, micro_batch_size=8)
    trainer = fit(module, data, iterations=2, callbacks=[OldChecker()])
    assert trainer.global_step == 4  # 2 iterations x 2 optimizer steps


def test_shared_prompt_packing_trains_the_same_weights_as_padded_rows():
    """Packing each prompt once changes the cost, not the update."""
    weights = {}
    for packing in ("padded", "shared_prompt"):
        module, data = make_components(pool=_pool(), micro_batch_size=16)
        data.packing = Packing(packing)
        recorder = BatchRecorder()
        fit(module, data, iterations=3, callbacks=[recorder])
        assert all((b.tokens.attention is not None) == (packing == "shared_prompt") for _, b in recorder.batches)
        weights[packing] = policy_state(module)
    # Different kernels sum in different orders (~1e-7 relative). Adam divides by sqrt(v), which magnifies
    # that on near-zero gradient entries, up to a few 1e-6: still under 1% of one step (lr 5e-4).
    _assert_same_weights(weights["padded"], weights["shared_prompt"], atol=1e-5)


def test_timeline_shows_overlap_inside_iterations_and_none_across(tmp_path):
    """From the workers' own timestamps: generation of iteration k+1 starts only after iteration k's last
    training step, and the trainer starts on iteration k's groups while the pool is still generating them."""
    import json

    from lit_parl.callbacks import PipelineTimeline
    from lit_parl.callbacks.pipeline_timeline import _union_length, overlap_efficiency

    assert overlap_efficiency(gen_busy=1.0, train_busy=2.0, wall=2.0) == 1.0  # generation fully hidden
    assert overlap_efficiency(gen_busy=1.0, train_busy=2.0, wall=3.0) == 0.0  # took turns
    assert _union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0

    timeline = PipelineTimeline(dirpath=str(tmp_path))
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=1, colocated_threads=1)
    module, data = make_components(pool=pool, prompts=8, group_size=4, micro_batch_size=4)
    fit(module, data, iterations=3, callbacks=[timeline])
    iterations = json.loads((tmp_path / "timeline.json").read_text())
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(iterations) == 3
    for previous, current in zip(iterations, iterations[1:]):
        assert current["sync"][0][0] >= previous["train"][-1][1], "weights synced before the last step of the iteration"
        assert current["generate"][0][0] >= current["sync"][0][1], "generation started before the sync finished"
    for it in iterations:
        # 8 chunks of one prompt each: the worker generates later chunks while the trainer trains earlier groups
        overlapping = [(g, t) for g in it["generate"] for t in it["train"] if t[0] < g[1] and g[0] < t[1]]
        assert overlapping, f"iteration {it['iteration']}: generation and training never ran at the same time"
        assert it["gen_busy_s"] > 0 and it["train_busy_s"] > 0
