"""Faults the spawned-worker pools survive with nothing lost (``lit_parl/rollout/worker_processes.py``,
``generate_call.py``).

A worker killed from outside, one that exits in the middle of a batch, and one that hangs are replaced
by a new process holding the iteration's weights, and their unfinished pieces of work are sent again
with the same seeds: the run trains exactly its prompts and ends with bit-identical weights to an
undisturbed run. Repeated failures stop the run with an error and leave no process behind; a worker
killed while it sends does not disturb the others' messages. A message the pool cannot read, or of a
kind it does not know, stops the call with an error that says so.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import signal
import threading
import time

import pytest
import torch
from lightning.pytorch import Callback

from helpers.components import fit, make_components, policy_state
from helpers.pools import EnginePool, WrappedPool
from lit_parl.rollout import HFRolloutPool, PoolSpec
from lit_parl.rollout.hf_pool import HFEngine
from lit_parl.rollout.processes import process_table
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.spawned_worker_pool import SpawnedWorkerPool

ITERATIONS = 2
PROMPTS, GROUP = 8, 4
# two workers with two pieces of two prompts each per iteration: a piece is a batch, and the hf sampler's
# numerics depend on a batch's composition, so exact equality below also checks that a piece is re-sent whole
POOL = dict(num_workers=2, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)


# -- engines the workers build (module level: the spawned workers import them by name) --------------------
def _claim(marker: str) -> bool:
    """True for the first caller across processes (the marker file is created atomically)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


class CrashOnceEngine:
    """An hf engine that exits right after the first group of the batch that starts with ``prompt_id``, once.

    Prompt 0 (5 tokens) is batched with prompt 1 (3 tokens, left-padded): sampled again alone, prompt 1
    would give other log-probs, so only the whole batch sent again reproduces the undisturbed run.
    """

    def __init__(self, marker: str, prompt_id: int, *hf_args) -> None:
        self.engine, self.marker, self.prompt_id = HFEngine(*hf_args), marker, prompt_id

    def load(self, shared, version):
        self.engine.load(shared, version)

    def sample(self, requests, sampling, version):
        for group in self.engine.sample(requests, sampling, version):
            yield group
            if requests[0].prompt_id == self.prompt_id and _claim(self.marker):
                time.sleep(1.0)  # the group leaves first (the outbox thread sends it): delivered, then lost again
                os._exit(3)


class AlwaysCrashEngine:
    """An hf engine that writes its pid to ``pid_dir`` when built and exits whenever asked to sample.

    From the fourth process on it samples normally, so that a pool that never gives up ends the run
    instead of hanging the test.
    """

    def __init__(self, pid_dir: str, *hf_args) -> None:
        open(os.path.join(pid_dir, str(os.getpid())), "w").close()
        self.crash = len(os.listdir(pid_dir)) <= 3
        self.engine = HFEngine(*hf_args)

    def load(self, shared, version):
        self.engine.load(shared, version)

    def sample(self, requests, sampling, version):
        if self.crash:
            os._exit(5)
        yield from self.engine.sample(requests, sampling, version)


class FloodEngine:
    """Groups of ``length``-token samples (megabytes per message, far more than a pipe holds), no model."""

    def __init__(self, length: int) -> None:
        self.length = length

    def load(self, shared, version):
        pass

    def sample(self, requests, sampling, version):
        for r in requests:
            yield GroupCompletions(
                r.prompt_id,
                version,
                list(range(r.group_size)),
                [list(range(s, s + self.length)) for s in r.seeds],
                [[-1.0] * self.length for _ in r.seeds],
                ["length"] * r.group_size,
            )


def _refuse_unpickling(reason: str):
    raise ValueError(reason)


class UnpicklableHere:
    """Pickled by a worker, but its unpickling raises (as a class the trainer cannot import would)."""

    def __reduce__(self):
        return _refuse_unpickling, ("this object cannot be unpickled in the trainer",)


class UnreadableEngine(FloodEngine):
    """Sends each group with a finish reason the trainer cannot unpickle."""

    def sample(self, requests, sampling, version):
        for group in super().sample(requests, sampling, version):
            group.finish_reasons[0] = UnpicklableHere()
            yield group


class ForeignGroupDone:
    """A message kind the pool does not know."""

    def __init__(self, call, group) -> None:
        self.call, self.group = call, group


class ForeignProtocolEngine(FloodEngine):
    """Built in a worker, it makes that worker's loop send each group as a ``ForeignGroupDone``: a worker
    speaking another protocol than the pool's (as one of another lit_parl version would)."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        from lit_parl.rollout import worker_loop

        worker_loop.GroupDone = ForeignGroupDone  # this process only: the worker's


# -- pools and helpers -------------------------------------------------------------------------------------
class StandInPool(SpawnedWorkerPool):
    """Workers that build ``engine()`` (a model-free stand-in), one request per piece of work, round-robin."""

    backend = "stand-in"

    def __init__(self, engine, **kwargs) -> None:
        defaults = dict(threads_per_worker=1, colocated_threads=None, start_timeout_s=120, response_timeout_s=60)
        super().__init__(**{**defaults, **kwargs})
        self.engine = engine

    def _engine(self, spec, threads):
        return self.engine

    def _assign(self, requests):
        return [(i % self.num_workers, [r]) for i, r in enumerate(requests)]


class FaultPool(WrappedPool):
    """Injects faults into the inner pool: ``faults[(iteration, moment)](inner)`` runs ``"before"`` the
    iteration's requests go out, when its ``"first"`` group arrives, and ``"after"`` its last one.

    Hands each iteration's groups on in prompt order, so the update does not depend on arrival order
    (which a restart changes) and weights can be compared exactly. Records the pool's restart count
    (``health().details["restarts"]``) at the end of each iteration.
    """

    def __init__(self, inner, faults=None) -> None:
        super().__init__(inner)
        self.faults, self.iteration, self.restarts = faults or {}, -1, []

    def transform(self, groups):
        self.iteration += 1
        self._fault("before")
        received = []
        for group in groups:
            if not received:
                self._fault("first")
            received.append(group)
        self._fault("after")
        self.restarts.append(self.inner.health().details["restarts"])
        yield from sorted(received, key=lambda g: g.prompt_id)

    def _fault(self, moment: str) -> None:
        if (self.iteration, moment) in self.faults:
            self.faults[(self.iteration, moment)](self.inner)


class TrainedSamples(Callback):
    """Every (iteration, prompt id, sample index) that reached a training step."""

    def __init__(self) -> None:
        self.samples = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.samples += [(trainer.current_epoch, p, s) for p, s in zip(batch.prompt_ids, batch.sample_indices)]

    def assert_each_scheduled_sample_once(self) -> None:
        expected = [(e, e * PROMPTS + p, s) for e in range(ITERATIONS) for p in range(PROMPTS) for s in range(GROUP)]
        assert sorted(self.samples) == expected


def _train(pool: FaultPool, callbacks=(), prefetch: bool = False) -> dict:
    """Fits; returns the final weights and every group as trained, by (version, prompt id)."""
    module, data = make_components(
        pool=pool,
        prompts=PROMPTS,
        group_size=GROUP,
        micro_batch_size=8,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        max_grad_norm=None,
    )
    data.prefetch = prefetch  # on: each iteration's groups are consumed (and workers replaced) on a thread of its own
    fit(module, data, ITERATIONS, callbacks=callbacks)
    groups = {(g.version, g.prompt_id): (g.completions, g.logprobs, g.finish_reasons) for g in pool.returned}
    assert len(groups) == len(pool.returned) == ITERATIONS * PROMPTS
    return {"weights": policy_state(module), "groups": groups}


def _assert_same_run(run: dict, undisturbed: dict) -> None:
    """Bit-identical samples and log-probs (a re-sent batch of another composition differs) and weights."""
    different = [key for key, group in run["groups"].items() if group != undisturbed["groups"][key]]
    assert not different, f"(version, prompt id) sampled differently from the undisturbed run: {different}"
    a, b = run["weights"], undisturbed["weights"]
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ from the undisturbed run's: {different[:5]}"


def _restart_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lit_parl" and "restarted it" in r.getMessage()]


def _signal_worker(sig: int, index: int):
    def send(inner) -> None:
        os.kill(inner.pids()[index], sig)

    return send


def _spawned_children() -> list[int]:
    """Live spawned-worker processes under this one (not multiprocessing's resource tracker)."""
    pids = []
    for pid, (parent, _) in process_table().items():
        if parent == os.getpid():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" in f.read():
                        pids.append(pid)
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def undisturbed():
    """The run without faults (sorted hand-off, SGD, no clipping): its groups and final weights."""
    initial = policy_state(make_components()[0])
    run = _train(FaultPool(HFRolloutPool(**POOL)))
    assert any(not torch.equal(initial[k], run["weights"][k]) for k in initial), "training changed nothing"
    return run


# -- the tests ---------------------------------------------------------------------------------------------
@pytest.mark.slow  # make test-slow: fault injection, half a minute
def test_killed_and_crashed_workers_are_replaced_and_the_run_trains_what_an_undisturbed_run_trains(
    undisturbed, tmp_path, caplog
):
    """Three faults, each replaced by a worker holding the iteration's weights. Iteration 0: worker 0 exits
    (``os._exit``) right after the first group of its first batch, so that group comes again from the
    re-sent batch and must be dropped. Between the iterations: worker 1 is SIGKILLed while idle (found at the
    sync). Iteration 1: worker 0 is SIGKILLed when the first group arrives, with all its pieces
    unfinished (it was stopped before they went out)."""
    crash = functools.partial(CrashOnceEngine, str(tmp_path / "crashed"), 0)
    faults = {
        (0, "after"): _signal_worker(signal.SIGKILL, 1),
        (1, "before"): _signal_worker(signal.SIGSTOP, 0),
        (1, "first"): _signal_worker(signal.SIGKILL, 0),
    }
    pool = FaultPool(EnginePool(crash, **POOL), faults)
    trained = TrainedSamples()
    with caplog.at_level(logging.WARNING, logger="lit_parl"):
        run = _train(pool, [trained])
    crashed, idle, killed = _restart_warnings(caplog)
    assert "rollout worker 0" in crashed and "exited (exit code 3) while generating" in crashed
    assert "re-issued 4 request(s) in 2 piece(s) (1 of their groups were delivered already" in crashed
    assert "rollout worker 1" in idle and "was killed by SIGKILL (exit code -9) while syncing version 1" in idle
    assert "with version 1 and re-issued 0 request(s)" in idle
    assert "rollout worker 0" in killed and "was killed by SIGKILL (exit code -9) while generating" in killed
    assert "re-issued 4 request(s) in 2 piece(s) (0 of their groups" in killed
    assert pool.restarts == [1, 3]  # health().details["restarts"] at the end of each iteration
    trained.assert_each_scheduled_sample_once()
    _assert_same_run(run, undisturbed)


def test_a_replacement_started_from_the_prefetch_thread_outlives_that_thread(undisturbed, caplog):
    """Linux kills a child whose PR_SET_PDEATHSIG parent *thread* exits: a worker replaced while the
    per-iteration prefetch thread consumes the stream must survive the end of that thread."""
    pool = FaultPool(HFRolloutPool(**POOL), {(0, "first"): _signal_worker(signal.SIGKILL, 0)})
    trained = TrainedSamples()
    with caplog.at_level(logging.WARNING, logger="lit_parl"):
        run = _train(pool, [trained], prefetch=True)
    assert len(_restart_warnings(caplog)) == 1, "the replacement died with the thread that started it"
    assert pool.restarts == [1, 1]
    trained.assert_each_scheduled_sample_once()
    _assert_same_run(run, undisturbed)


@pytest.mark.slow  # make test-slow: waits out a hung worker's timeout
def test_a_hung_worker_is_killed_and_replaced(undisturbed, caplog):
    """Worker 0 is SIGSTOPped as iteration 1 starts: after response_timeout_s of silence it is killed."""
    stopped = {}

    def stop(inner) -> None:
        pid = inner.pids()[0]
        stopped[pid] = process_table()[pid][1]  # its start time: a reused pid is another process
        os.kill(pid, signal.SIGSTOP)
        watchdog.start()

    def resume() -> None:  # if the pool never notices, the run ends (and fails below) instead of hanging
        for pid, start in stopped.items():
            if process_table().get(pid, (None, None))[1] == start:
                os.kill(pid, signal.SIGCONT)

    watchdog = threading.Timer(60.0, resume)
    pool = FaultPool(HFRolloutPool(**POOL, response_timeout_s=4), {(1, "before"): stop})
    trained = TrainedSamples()
    try:
        with caplog.at_level(logging.WARNING, logger="lit_parl"):
            run = _train(pool, [trained])
    finally:
        watchdog.cancel()
    (hung,) = _restart_warnings(caplog)
    assert "was silent for 4 s with work outstanding (hung), so it was killed while generating" in hung
    assert "re-issued 4 request(s) in 2 piece(s)" in hung
    assert pool.restarts == [0, 1]
    trained.assert_each_scheduled_sample_once()
    _assert_same_run(run, undisturbed)
    table = process_table()
    left = [pid for pid, start in stopped.items() if table.get(pid, (None, None))[1] == start]
    assert not left, "the stopped worker is still there"


def test_a_worker_that_keeps_dying_stops_the_run_after_max_restarts_and_leaves_nothing(tmp_path):
    pool = EnginePool(functools.partial(AlwaysCrashEngine, str(tmp_path)), **{**POOL, "num_workers": 1}, max_restarts=1)
    module, data = make_components(pool=pool, prompts=PROMPTS, group_size=GROUP)
    stopping = (
        r"rollout worker 0 \(pid \d+\) exited \(exit code 5\) while generating, after 1 restart\(s\) in this call: "
        r"stopping \(max_restarts=1\)"
    )
    with pytest.raises(RuntimeError, match=stopping):
        fit(module, data, ITERATIONS)
    started = [int(p.name) for p in tmp_path.iterdir()]
    assert len(started) == 2  # the first worker and its one replacement
    table = process_table()
    assert not [pid for pid in started if pid in table], "a worker outlived the failed run"
    assert not _spawned_children()


@pytest.mark.slow  # make test-slow: megabytes of messages
def test_a_worker_killed_while_sending_large_messages_does_not_disturb_the_others():
    """Best effort: the kills land at random moments of a stream of multi-megabyte messages, mostly in the
    middle of one. The dead worker's partial message must be dropped and the other worker's stream stay
    readable (with one shared queue, a partial message corrupts it and the dead writer's lock blocks it)."""
    length = 100_000
    pool = StandInPool(functools.partial(FloodEngine, length), num_workers=2)
    rng = random.Random(0)
    try:
        pool.start(PoolSpec("unused", eos_id=1, pad_id=0))
        pool.sync_weights([[("w", torch.zeros(1))]], version=0)
        requests = [GroupRequest(i, (1,), version=0, seeds=(i, 10_000 + i)) for i in range(20)]
        received = {}
        for group in pool.generate(requests, SamplingParams()):
            received[group.prompt_id] = group
            if len(received) in (3, 6):  # one worker, then the other while the first one's replacement starts
                time.sleep(rng.uniform(0.0, 0.02))
                os.kill(pool.pids()[len(received) // 6], signal.SIGKILL)
        assert sorted(received) == list(range(20))
        for r in requests:
            assert received[r.prompt_id].completions == [list(range(s, s + length)) for s in r.seeds]
        assert pool.health().details["restarts"] == 2
    finally:
        pool.close()
    assert not _spawned_children()


UNREADABLE = r"(?s)worker 0 sent a message the pool cannot read:\n.*ValueError: this object cannot be unpickled"
UNKNOWN = r"worker 0 sent a message of unknown kind while generating: ForeignGroupDone"


@pytest.mark.parametrize(
    "engine,reported", [(UnreadableEngine, UNREADABLE), (ForeignProtocolEngine, UNKNOWN)], ids=["unreadable", "unknown"]
)
def test_a_message_the_pool_cannot_read_or_does_not_know_stops_the_call_and_says_so(engine, reported):
    """Not a fault to restart from: the worker and the pool disagree on what was sent, so the call stops."""
    pool = StandInPool(functools.partial(engine, 4), num_workers=1)
    try:
        pool.start(PoolSpec("unused", eos_id=1, pad_id=0))
        pool.sync_weights([[("w", torch.zeros(1))]], version=0)
        with pytest.raises(RuntimeError, match=reported):
            list(pool.generate([GroupRequest(0, (1,), version=0, seeds=(0,))], SamplingParams()))
    finally:
        pool.close()
    assert not _spawned_children()
