"""CoreShare: the pool's cores train an iteration's tail once the pool is idle, and come back for the next one."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback

from lit_parl import tiny_qwen2
from lit_parl.data.core_share import LEND_FROM_PARAMETERS, cores_to_lend, worth_lending
from lit_parl.rollout import HFRolloutPool
from tests.helpers.components import BatchRecorder, fit, make_components, policy_state, sgd


class ThreadsPerStep(Callback):
    """The trainer's torch threads at each micro-batch, per iteration, and after the fit."""

    def __init__(self) -> None:
        self.threads: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.threads.setdefault(trainer.current_epoch, []).append(torch.get_num_threads())


def lending_fit(lend: bool, iterations: int = 3, prefetch: bool = True):
    threads, recorder = ThreadsPerStep(), BatchRecorder()
    # one worker of one thread (the pool's reserved core), chunks of 2 prompts: 4 micro-batches an iteration
    pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)
    module, datamodule = make_components(
        pool=pool, trainer_threads=1, datamodule_kwargs={"lend_cores": lend, "prefetch": prefetch}, **sgd(0.5)
    )
    before = torch.get_num_threads()
    try:
        fit(module, datamodule, iterations, callbacks=[threads, recorder])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return threads.threads, after, recorder, policy_state(module)


def test_the_trainer_takes_the_pools_core_for_the_tail_and_gives_it_back():
    """The last micro-batch of every iteration comes after the pool's last group, so it always trains on the
    trainer's thread and the pool's; every iteration's first micro-batch (the pool generating beside it) and the
    end of the fit are back on the trainer's one. Inline too (no prefetch thread): there the last group is seen
    only when the last micro-batch is cut."""
    for prefetch in (True, False):
        threads, after, _, _ = lending_fit(lend=True, prefetch=prefetch)
        assert sorted(threads) == [0, 1, 2] and all(len(steps) == 4 for steps in threads.values()), threads
        for steps in threads.values():
            assert steps[0] == 1 and steps[-1] == 2, (prefetch, threads)
            assert steps == sorted(steps), threads  # once lent, lent until the iteration ends
        assert after == 1


def test_lending_trains_the_same_samples_to_the_same_weights_within_summation_order():
    """What is trained does not change: the same samples in the same order, and weights after three SGD
    iterations equal to float32 summation order (two threads sum a weight gradient's tokens in another order:
    about 1e-8 relative per step; SGD so that a wrong scale would show)."""
    threads, _, lent_batches, lent = lending_fit(lend=True)
    assert any(2 in steps for steps in threads.values())
    plain_threads, _, plain_batches, plain = lending_fit(lend=False)
    assert all(set(steps) == {1} for steps in plain_threads.values())
    assert lent_batches.samples() == plain_batches.samples()
    for (_, a), (_, b) in zip(lent_batches.batches, plain_batches.batches, strict=True):  # the same tokens
        torch.testing.assert_close(a.rollout_logprobs, b.rollout_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(a.rewards, b.rewards)
    start = tiny_qwen2(seed=0)[0].state_dict()  # the policy make_components starts from
    moved = max((plain[name] - start[name]).abs().max().item() for name in plain)
    assert moved > 1e-3  # the fit did move the weights, so the comparison below means something
    for name in plain:
        torch.testing.assert_close(lent[name], plain[name], rtol=1e-5, atol=1e-6)


def test_lending_is_on_by_default_only_where_it_pays():
    """Measured on two cores: lending slowed the 0.5M-parameter default job and sped up a 4.2M one."""
    tiny, _ = tiny_qwen2(hidden_size=128, num_layers=2, intermediate_size=512)  # the default job's policy
    large, _ = tiny_qwen2(hidden_size=256, num_layers=4, intermediate_size=1024)
    sizes = [sum(p.numel() for p in model.parameters()) for model in (tiny, large)]
    assert sizes[0] < LEND_FROM_PARAMETERS <= sizes[1]
    assert not worth_lending(tiny, on_cpu=True)
    assert worth_lending(large, on_cpu=True)
    assert not worth_lending(large, on_cpu=False)  # on an accelerator the CPU threads do not train
    assert not worth_lending(None, on_cpu=True)


def test_the_trainer_never_takes_more_threads_than_its_process_has_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cores_to_lend(reserved=1, trainer_threads=1) == 1  # the default split: the pool's one core
    assert cores_to_lend(reserved=2, trainer_threads=1) == 1  # two workers on two cores: one more, not two
    assert cores_to_lend(reserved=2, trainer_threads=2) == 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert cores_to_lend(reserved=4, trainer_threads=8) == 4
    # a trainer pinned to one core of two (taskset -c 1), its pool pinned to the other: nothing to lend
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {1})
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert cores_to_lend(reserved=1, trainer_threads=1) == 0
