"""The on-policy invariants of docs/design.md, each proven on real training runs (tiny model, real pool).

Weight comparisons train with plain SGD and no clipping (``helpers.components.sgd``): the update is then exactly
-lr x gradient, so a wrong gradient scale or a mini-batch assembled from other samples shows in the
weights (AdamW normalises the step's size and clipping caps it, which hides both). They compare updates,
not weights: ``_update_difference`` is |Δa - Δb| / |Δa| over all parameters at once. Float32 reductions
in another order (other micro-batch splits, arrival orders, kernels) differ by ~1e-7 relative per sum;
over these runs' 2-4 steps the updates measured 3e-7 to 5e-7 apart, so the bound ``SAME_UPDATE`` = 1e-5
leaves a margin of 20, while the smallest deliberate bugs tried (a normaliser one too large, a position
off by one in the shared-prompt layout) moved the update by 4e-3 to 6e-3, 400 times the bound.
"""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from lightning.pytorch import Callback

from helpers.components import BatchRecorder, fit, make_components, policy_state, sgd
from helpers.pools import InProcessPool, ShufflingPool, WrappedPool
from lit_parl import GRPOObjective, OffPolicyError, Packing
from lit_parl.callbacks import WeightSync
from lit_parl.rollout import HFRolloutPool, PoolSpec
from lit_parl.tasks import CopyTask

LR = 0.5  # updates of norm ~0.5 over all weights: float32 noise is ~1e-7 of that
SAME_UPDATE = 1e-5


def _pool() -> HFRolloutPool:
    return HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)


def _update_difference(initial: dict, a: dict, b: dict) -> float:
    """|(a - initial) - (b - initial)| / |a - initial|, over all parameters; fails if ``a`` did not move."""
    assert initial.keys() == a.keys() == b.keys()
    moved = torch.cat([(a[k] - initial[k]).flatten() for k in initial]).double()
    apart = torch.cat([(a[k] - b[k]).flatten() for k in initial]).double()
    assert moved.norm() > 1e-3, "training did not move the weights: the comparison would prove nothing"
    return float(apart.norm() / moved.norm())


class ReorderingPool(WrappedPool):
    """Holds back up to ``window`` finished groups and hands out a random one of them: out of order, yet
    streaming (the trainer starts on early groups while later ones are generated)."""

    def __init__(self, inner, seed: int = 0, window: int = 3) -> None:
        super().__init__(inner)
        self.rng, self.window = random.Random(seed), window

    def transform(self, groups):
        held = []
        for group in groups:
            held.append(group)
            if len(held) > self.window:
                yield held.pop(self.rng.randrange(len(held)))
        self.rng.shuffle(held)
        yield from held


class ReversingPool(WrappedPool):
    """Hands the groups out last-finished first (the whole round is awaited: for the synchronous baseline)."""

    def transform(self, groups):
        yield from reversed(list(groups))


class EpochEndWeights(Callback):
    def __init__(self) -> None:
        self.weights = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.weights.append(policy_state(pl_module))


def test_sync_and_async_train_the_same_weights_from_groups_that_arrive_in_another_order():
    """Invariant 5, not equal by construction: two workers, two optimizer steps per iteration, and the two
    modes see each iteration's groups in different orders (async streams them shuffled, sync gets them
    last-finished first), so the mini-batches' micro-batches are assembled differently."""
    weights, first_halves = {}, {}
    for mode, wrap in (("sync", ReversingPool), ("async", lambda inner: ReorderingPool(inner, seed=2))):
        pool = wrap(HFRolloutPool(num_workers=2, threads_per_worker=1, prompts_per_request=1, colocated_threads=1))
        module, data = make_components(
            mode=mode, pool=pool, prompts=8, group_size=4, micro_batch_size=8, mini_batches=2, **sgd(LR)
        )
        initial = policy_state(module)
        trainer = fit(module, data, iterations=2)
        assert data.iterations_done == 2 and trainer.global_step == 4
        weights[mode] = policy_state(module)
        arrivals = [[g.prompt_id for g in pool.returned if g.version == v] for v in range(2)]
        first_halves[mode] = [set(order[:4]) for order in arrivals]
    # a mini-batch is a block of schedule slots; had arrival order decided, the two runs would differ
    assert first_halves["sync"] != first_halves["async"], (
        "both runs saw the groups in the same halves: equal by construction"
    )
    assert _update_difference(initial, weights["sync"], weights["async"]) < SAME_UPDATE


def test_arrival_order_and_micro_batch_split_do_not_change_the_update():
    """Invariant 4: groups arriving shuffled, in micro-batches of another size, give the same weights
    (two mini-batches per iteration: each is a fixed block of schedule slots, not the first groups to arrive)."""
    shape = dict(prompts=8, group_size=4, mini_batches=2)
    module_a, data_a = make_components(pool=InProcessPool(), micro_batch_size=8, **shape, **sgd(LR))
    initial = policy_state(module_a)
    assert fit(module_a, data_a, iterations=2).global_step == 4
    pool_b = ReorderingPool(InProcessPool(), seed=1, window=8)
    module_b, data_b = make_components(pool=pool_b, micro_batch_size=16, **shape, **sgd(LR))
    assert fit(module_b, data_b, iterations=2).global_step == 4
    assert [g.prompt_id for g in pool_b.returned[:8]] != list(range(8)), "the stream was not reordered"
    assert _update_difference(initial, policy_state(module_a), policy_state(module_b)) < SAME_UPDATE


def _token_mean_reference(initial_policy, recorder: BatchRecorder, pool: WrappedPool, data, iteration: int) -> dict:
    """One iteration of token-mean GRPO written out plainly: one unpadded forward per sample, the loss summed
    over every token of the iteration and divided by their count, one SGD step (one mini-batch: ratio 1)."""
    model = copy.deepcopy(initial_policy).train()
    advantages = {
        (prompt_id, sample): float(advantage)
        for epoch, batch in recorder.batches
        if epoch == iteration
        for prompt_id, sample, advantage in zip(batch.prompt_ids, batch.sample_indices, batch.advantages)
    }
    total, tokens = 0.0, 0
    for group in (g for g in pool.returned if g.version == iteration):
        prompt = data.tokenizer(data.data.make(group.prompt_id)[0], add_special_tokens=False).input_ids
        for sample, completion in zip(group.sample_indices, group.completions):
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            logp = logits.float().log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            total = total - (advantages[(group.prompt_id, sample)] * torch.exp(logp - logp.detach())).sum()
            tokens += len(completion)
    assert len(advantages) == 32 and tokens > 32
    (total / tokens).backward()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_token_mean_is_normalised_over_the_whole_iteration_not_per_micro_batch():
    """token-mean divides by the iteration's token count, known only at the step: split-invariant, and equal
    to the update written out plainly (which a uniform scale error, invisible to a comparison of splits, fails)."""
    objective = lambda: GRPOObjective(loss_aggregation="token-mean")  # noqa: E731
    module_a, data_a = make_components(pool=InProcessPool(), micro_batch_size=32, objective=objective(), **sgd(LR))
    initial_policy = copy.deepcopy(module_a.policy)
    initial = policy_state(module_a)
    fit(module_a, data_a, iterations=2)
    pool_b, recorder, ends = ReorderingPool(InProcessPool(), seed=3, window=8), BatchRecorder(), EpochEndWeights()
    module_b, data_b = make_components(pool=pool_b, micro_batch_size=4, objective=objective(), **sgd(LR))
    fit(module_b, data_b, iterations=2, callbacks=[recorder, ends])
    assert _update_difference(initial, policy_state(module_a), policy_state(module_b)) < SAME_UPDATE
    reference = _token_mean_reference(initial_policy, recorder, pool_b, data_b, iteration=0)
    assert _update_difference(initial, reference, ends.weights[0]) < SAME_UPDATE


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
            assert inputs[first - len(prompt_ids) + 1 : first + 1].tolist() == prompt_ids, (
                "completion is not attached to its own prompt"
            )
            answer = data.tokenizer(task.make(prompt_id)[1], add_special_tokens=False).input_ids
            assert batch.rewards[row].item() == pytest.approx(
                task.reward(answer, completion, data.tokenizer.eos_token_id)
            )
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
    module, data = make_components(pool=StaleVersionPool(InProcessPool()))
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
    with pytest.raises(
        RuntimeError, match=r"version gate: requests for policy version\(s\) \[1\] reached a pool holding version 0"
    ):
        list(hf_pool.generate(ahead, data.sampling))
    hf_pool.check_requests = lambda requests: None  # bypass the pool's check: the worker must still refuse
    with pytest.raises(RuntimeError, match=r"worker 0 holds policy version 0 but got requests for \[1\]"):
        list(hf_pool.generate(ahead, data.sampling))


def test_a_stream_pulled_before_the_weights_sync_waits_at_the_gate_and_sends_nothing():
    """Invariant 2 without Lightning's hook order: an iteration pulled before its weights were synced (as a
    prefetching loop would) blocks in the gate, sends no request, and goes on once the pool confirmed them.
    The first iteration finds the gate never opened; the second finds it closed again by the first's end."""
    pool = GateRecorder(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=2)
    data.setup("fit")  # starts the pool
    try:
        for version in (0, 1):
            pulled = {}

            def pull():
                try:
                    stream = iter(data.train_dataloader())
                    pulled["batches"] = [next(stream)]
                    pulled["batches"] += list(stream)  # the whole iteration: its end closes the gate
                except BaseException as error:  # noqa: BLE001 - reported by the assertions below
                    pulled["error"] = error

            thread = threading.Thread(target=pull, daemon=True)
            thread.start()
            thread.join(0.5)
            assert thread.is_alive() and not pulled, f"iteration {version} went ahead of its weights: {pulled}"
            assert [event[0] for event in pool.events] == ["sync_start", "synced", "request"] * version
            pool.sync_weights([list(module.policy.named_parameters())], version=version)
            data.open_iteration(version)
            thread.join(60)
            assert [batch.version for batch in pulled["batches"]] == [version, version], pulled
            assert [event[0] for event in pool.events] == ["sync_start", "synced", "request"] * (version + 1)
    finally:
        data.teardown("fit")


class OpensWithoutSyncing(WeightSync):
    """Iteration 1 opens the gate without pushing θ_1: through the gate's check (``gate``), or past it
    (``datamodule``: the gate is told the pool confirmed version 1)."""

    def __init__(self, bypass: str) -> None:
        super().__init__(push_early=False)  # iteration 1 opens at its epoch's start, where the bypass is
        self.bypass = bypass

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            return super().on_train_epoch_start(trainer, pl_module)
        if self.bypass == "gate":
            trainer.datamodule.open_iteration(1)
        else:
            trainer.datamodule.gate.open(1, confirmed=1)


@pytest.mark.parametrize(
    "bypass, message",
    [
        ("gate", r"the gate was asked to open version 1 but the pool confirmed version 0"),
        ("datamodule", r"the gate opened version 1 but the pool holds version 0"),
    ],
    ids=["gate", "datamodule"],
)
def test_an_iteration_never_starts_on_weights_the_pool_has_not_confirmed(bypass, message):
    """The gate refuses to open for a version the pool has not confirmed; past a gate that was misled, the
    iteration's stream checks the pool's version itself before it sends anything."""
    pool = GateRecorder(InProcessPool())
    module, data = make_components(pool=pool, prompts=2, group_size=2, micro_batch_size=4)
    with pytest.raises(OffPolicyError, match=message):
        fit(module, data, iterations=2, weight_sync=OpensWithoutSyncing(bypass))
    assert data.iterations_done == 1
    assert [e for e in pool.events if e[0] == "request"] == [("request", [0], 0)]


class ConstantTask(CopyTask):
    def reward(self, answer_ids, completion_ids, eos_id):
        return 2 / 3  # not exactly representable: the mean must not leave a rounding residue


def test_all_equal_rewards_give_zero_advantage_and_no_update():
    """Zero-variance groups do not crash (zero grad norm) and move no weight."""
    module, data = make_components(pool=InProcessPool(), task=ConstantTask())
    before = policy_state(module)
    fit(module, data, iterations=2)
    after = policy_state(module)
    for name in before:
        assert torch.equal(before[name], after[name]), f"{name} moved without any advantage"


def test_a_zero_advantage_group_contributes_no_gradient():
    """Invariant check at the loss level: the gradient of a zero-advantage group is exactly zero."""
    from lit_parl.data.micro_batch import Trajectory, collate

    module, data = make_components()
    rewards = torch.full((4,), 2 / 3)
    advantages = module.objective.advantages(
        module.objective.shape_rewards(rewards, torch.tensor([2, 3, 2, 3]), torch.zeros(4, dtype=torch.bool), 6)
    )
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

    module, data = make_components(pool=InProcessPool(), mini_batches=2, micro_batch_size=8)
    trainer = fit(module, data, iterations=2, callbacks=[OldChecker()])
    assert trainer.global_step == 4  # 2 iterations x 2 optimizer steps


def test_shared_prompt_packing_trains_the_same_weights_as_padded_rows():
    """Packing each prompt once changes the cost, not the update."""
    weights = {}
    for packing in ("padded", "shared_prompt"):
        module, data = make_components(pool=InProcessPool(), micro_batch_size=16, **sgd(LR))
        initial = policy_state(module)
        data.packing = Packing(packing)
        recorder = BatchRecorder()
        fit(module, data, iterations=2, callbacks=[recorder])
        assert all((b.tokens.attention is not None) == (packing == "shared_prompt") for _, b in recorder.batches)
        weights[packing] = policy_state(module)
    assert _update_difference(initial, weights["padded"], weights["shared_prompt"]) < SAME_UPDATE


def test_timeline_shows_overlap_inside_iterations_and_none_across(tmp_path):
    """From the workers' own timestamps: generation of iteration k+1 starts only after iteration k's last
    training step, and the trainer starts on iteration k's groups while the pool is still generating them."""
    from lit_parl.callbacks import PipelineTimeline, load_timeline
    from lit_parl.callbacks.pipeline_timeline import _union_length, overlap_efficiency

    assert overlap_efficiency([(0.5, 1.5)], [(0.0, 2.0)]) == 1.0  # generation fully hidden
    assert overlap_efficiency([(0.0, 1.0)], [(1.0, 3.0)]) == 0.0  # took turns
    assert overlap_efficiency([(0.0, 1.0)], [(5.0, 6.0), (6.5, 7.0)]) == 0.0  # took turns, idle in between
    assert _union_length([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0

    timeline = PipelineTimeline(dirpath=str(tmp_path))
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=1, colocated_threads=1)
    module, data = make_components(pool=pool, prompts=8, group_size=4, micro_batch_size=4)
    fit(module, data, iterations=3, callbacks=[timeline])
    iterations = load_timeline(tmp_path / "timeline.jsonl")
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
