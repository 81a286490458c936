"""Exactly once (docs/design.md, invariant 3) through real fits with a pool that misbehaves.

Each fault (a group dropped, an unrequested prompt, a group twice, a missing or duplicated sample, a sample
with a log-prob fewer than its tokens, a group of the previous iteration delivered late) must stop the fit with
an error naming the prompt, and no sample may be trained twice, trained from a refused group, or lost without
that error. Two layers check:
the pool base class (``RolloutPool.generate``) and the trainer (``GroupAcceptor``, ``IterationBatcher``).
Every fault runs twice: as a real pool returns it (the base must refuse it) and with the base's result
checks skipped (the trainer must refuse it on its own), so removing either layer's check fails a test
(docs/testing.md lists which).
"""

from __future__ import annotations

import copy
import re

import pytest
from lightning.pytorch import Callback

from helpers.components import BatchRecorder, fit, make_components
from helpers.pools import InProcessPool, WrappedPool
from lit_parl import OffPolicyError
from lit_parl.rollout import HFRolloutPool

PROMPTS, GROUP = 4, 4


class FaultyPool(WrappedPool):
    """Injects one fault (``inject``) into the stream of a real pool.

    Args:
        inner: the real pool.
        layer: ``"pool"``: results pass the base class's checks, as from any backend; ``"trainer"``: those
            checks are skipped, so only the trainer's own can catch the fault.
    """

    def __init__(self, inner, layer: str) -> None:
        super().__init__(inner)
        self.layer = layer
        self.calls = 0  # generate calls so far: one per iteration here
        self.target: int | None = None  # the prompt the fault concerns

    def generate(self, requests, sampling):
        # Overrides a @final method on purpose: the "trainer" layer emulates a base class whose result checks
        # are gone, to prove that the acceptor and the batcher refuse each fault by themselves.
        if self.layer == "pool":
            yield from super().generate(requests, sampling)
        else:
            self.check_requests(requests)
            yield from self._generate(requests, sampling)

    def transform(self, groups):
        self.calls += 1
        yield from self.inject(self.calls - 1, groups)

    def inject(self, call: int, groups):
        raise NotImplementedError


class DropsAGroup(FaultyPool):
    def inject(self, call, groups):
        for i, group in enumerate(groups):
            if i == 1:
                self.target = group.prompt_id
                continue  # never returned
            yield group


class ReturnsAnUnrequestedPrompt(FaultyPool):
    def inject(self, call, groups):
        for i, group in enumerate(groups):
            yield group
            if i == 0:
                stray = copy.deepcopy(group)
                stray.prompt_id = self.target = group.prompt_id + 1000
                yield stray


class ReturnsAGroupTwice(FaultyPool):
    """The second copy comes right after the first, or (``last=True``) after the round is complete."""

    def __init__(self, inner, layer: str, last: bool = False) -> None:
        super().__init__(inner, layer)
        self.last = last

    def inject(self, call, groups):
        first = None
        for group in groups:
            yield group
            if first is None:
                first, self.target = copy.deepcopy(group), group.prompt_id
                if not self.last:
                    yield copy.deepcopy(first)
        if self.last:
            yield first


class LosesASample(FaultyPool):
    def inject(self, call, groups):
        for i, group in enumerate(groups):
            if i == 1:
                self.target = group.prompt_id
                for field in ("sample_indices", "completions", "logprobs", "finish_reasons"):
                    del getattr(group, field)[2]
            yield group


class DuplicatesASample(FaultyPool):
    def inject(self, call, groups):
        for i, group in enumerate(groups):
            if i == 1:  # sample 1 twice, sample 2 never
                self.target = group.prompt_id
                for field in ("sample_indices", "completions", "logprobs", "finish_reasons"):
                    values = getattr(group, field)
                    values[2] = copy.deepcopy(values[1])
            yield group


class LosesALogprob(FaultyPool):
    """Sample 2 of one group carries one log-prob fewer than its tokens (kept, it would be trained as 0.0)."""

    def inject(self, call, groups):
        for i, group in enumerate(groups):
            if i == 1:
                self.target = group.prompt_id
                group.logprobs[2] = group.logprobs[2][:-1]
            yield group


class DeliversALateGroup(FaultyPool):
    """Keeps a copy of a group of iteration 0 (which still gets it) and delivers it again in iteration 1."""

    kept = None

    def inject(self, call, groups):
        for i, group in enumerate(groups):
            if call == 0 and i == 0:
                self.kept, self.target = copy.deepcopy(group), group.prompt_id
            yield group
            if call == 1 and i == 0:
                yield self.kept


class StepsAtFailure(Callback):
    def __init__(self) -> None:
        self.global_step = None

    def on_exception(self, trainer, pl_module, exception):
        self.global_step = trainer.global_step


UNREQUESTED = {
    "pool": r"the wrapped pool returned prompt_id {t}, which was not requested or already returned",
    "trainer": r"the pool returned prompt_id {t}, which this iteration did not request or already received",
}
FAULTS = {  # fault -> (pool, the iteration it stops, {layer: the error message, naming the prompt {t}})
    "dropped": (
        DropsAGroup,
        0,
        {
            "pool": r"the wrapped pool ended its stream with prompts \[{t}\] \(1 in all\) never returned",
            "trainer": (
                r"the pool stopped with prompts \[{t}\] \(1 in all\) never returned: "
                r"refusing to lose trajectories"
            ),
        },
    ),
    "unrequested": (ReturnsAnUnrequestedPrompt, 0, UNREQUESTED),
    "twice": (ReturnsAGroupTwice, 0, UNREQUESTED),
    "twice_after_the_round": (
        lambda inner, layer: ReturnsAGroupTwice(inner, layer, last=True),
        0,
        {"pool": UNREQUESTED["pool"], "trainer": r"the pool returned prompt_id {t} after the round was complete"},
    ),
    "missing_sample": (
        LosesASample,
        0,
        {
            "pool": r"the wrapped pool returned samples \[0, 1, 3\] for prompt {t}; expected 0\.\.3",
            "trainer": r"prompt {t}: expected samples 0\.\.3, got \[0, 1, 3\]",
        },
    ),
    "duplicated_sample": (
        DuplicatesASample,
        0,
        {
            "pool": r"the wrapped pool returned samples \[0, 1, 1, 3\] for prompt {t}; expected 0\.\.3",
            "trainer": r"prompt {t}: expected samples 0\.\.3, got \[0, 1, 1, 3\]",
        },
    ),
    "short_logprobs": (
        LosesALogprob,
        0,
        {
            "pool": (
                r"the wrapped pool returned (\d+) log-probs for the (\d+) tokens of prompt {t} sample 2: "
                r"one per token expected"
            ),
            "trainer": r"prompt {t} sample 2: (\d+) tokens but (\d+) log-probs",
        },
    ),
    "late": (
        DeliversALateGroup,
        1,
        {
            "pool": UNREQUESTED["pool"],
            "trainer": r"prompt {t} came back generated by policy version 0, but the iteration trains version 1",
        },
    ),
}


# The faults are injected after the inner pool, so any real pool will do: the in-process one saves a worker's
# start-up per fit; the spawned hf pool (two workers) runs the late group, the fault real workers could make.
CASES = [(fault, layer, "in-process") for fault in FAULTS for layer in ("pool", "trainer")] + [("late", "pool", "hf")]


@pytest.mark.parametrize("fault, layer, backend", CASES)
def test_a_faulty_pool_stops_the_fit_and_no_sample_is_trained_twice_or_lost(fault, layer, backend):
    make_pool, failing, messages = FAULTS[fault]
    if backend == "hf":
        inner = HFRolloutPool(num_workers=2, threads_per_worker=1, prompts_per_request=1, colocated_threads=1)
    else:
        inner = InProcessPool()
    pool = make_pool(inner, layer)
    module, data = make_components(pool=pool, prompts=PROMPTS, group_size=GROUP, micro_batch_size=GROUP)
    recorder, steps = BatchRecorder(), StepsAtFailure()
    with pytest.raises(RuntimeError) as failure:
        fit(module, data, iterations=failing + 1, callbacks=[recorder, steps])
    if layer == "trainer" and fault == "late":
        assert isinstance(failure.value, OffPolicyError)
    assert pool.target is not None, "the fault was never injected"
    assert re.search(messages[layer].format(t=pool.target), str(failure.value)), str(failure.value)

    trained = recorder.samples()
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    for iteration, prompt_id, _ in trained:
        assert iteration * PROMPTS <= prompt_id < (iteration + 1) * PROMPTS, (
            f"iteration {iteration} trained prompt {prompt_id}"
        )
    # the iterations before the fault trained every sample of every scheduled prompt; the refused group none
    done = [(i, p, s) for i, p, s in trained if i < failing]
    assert sorted(done) == [
        (i, i * PROMPTS + p, s) for i in range(failing) for p in range(PROMPTS) for s in range(GROUP)
    ]
    if fault.endswith(("_sample", "_logprobs")):
        assert all(p != pool.target for i, p, _ in trained if i == failing), "a sample of the refused group was trained"
    # and the failing iteration took no optimizer step: its partial gradient never reached the weights
    assert data.iterations_done == failing and steps.global_step == failing
