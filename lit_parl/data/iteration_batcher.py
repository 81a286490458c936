"""IterationBatcher: one iteration's groups in, its micro-batches out, each marked where a step falls.

The iteration's N prompt slots are split into ``shape.mini_batches`` fixed blocks by schedule position,
so a mini-batch's content does not depend on arrival order; a mini-batch's micro-batches leave as soon
as its groups are in, and the last micro-batch of each mini-batch carries ``ends_step=True``. With
dynamic sampling, a zero-variance group's slot is refilled by a new prompt in the next round (slots
refilled in schedule order, so the result is order-independent too). Passes after the first replay the
same micro-batches. Every exchange with the pool ends before the last micro-batch of pass 0 leaves.

Under W ranks each rank's batcher requests and trains only its ``RankShare`` of the slots; prompt ids stay
global (slot ``s`` of the iteration drawing from the cursor is prompt ``cursor + s``), and with dynamic
sampling the ranks tell each other which slots are open after each round (``open_slots_everywhere``), so
the refill prompts are numbered as on one device and every prompt is trained once, on one rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from lit_parl.data.group_acceptor import GroupAcceptor
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.iteration_stats import IterationStats
from lit_parl.data.micro_batch import MicroBatch, Packing, Trajectory, collate
from lit_parl.data.prompt_schedule import DrawnPrompt, PromptSchedule
from lit_parl.data.rank_share import RankShare
from lit_parl.episodes.episode_runner import EpisodeRunner
from lit_parl.rollout.records import GroupCompletions, GroupRequest, SamplingParams
from lit_parl.rollout.rollout_pool import RolloutPool


@dataclasses.dataclass
class IterationBatcher:
    """Requests an iteration's groups, checks and scores them, and cuts them into micro-batches.

    Args:
        share: this rank's share of the iteration (``RankShare(shape)`` on one device).
        schedule: prompts, tokens and seeds.
        pool: the rollout pool (generation only).
        scorer: rewards (inline, or on threads of its own).
        acceptor: checks and advantages.
        sampling: sampling parameters for every request.
        packing: the micro-batch layout.
        pad_id: the padding token.
        materialize: wait for every group of a round before the first micro-batch (the synchronous baseline).
        dynamic_sampling: drop zero-variance groups and refill their slots (DAPO).
        max_sampling_rounds: rounds of refills before zero-variance groups are kept after all.
        logprob_tolerance: stamped on every micro-batch: the mean |rollout - θ_k| log-prob per token the
            trainer accepts in a group (``lit_parl.trainer.guards.off_policy_problem``); None: unchecked.
        open_slots_everywhere: with dynamic sampling, this rank's open (global) slots in, every rank's out,
            sorted; one call per refill round on every rank. On one device: the slots given.
        episodes: plays multi-turn episodes over the pool (``None``: one completion per sample).
    """

    share: RankShare
    schedule: PromptSchedule
    pool: RolloutPool
    scorer: GroupScorer
    acceptor: GroupAcceptor
    sampling: SamplingParams
    packing: Packing
    pad_id: int
    materialize: bool = False
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 8
    logprob_tolerance: float | None = None
    open_slots_everywhere: Callable[[list[int]], list[int]] = sorted
    episodes: EpisodeRunner | None = None

    def micro_batches(self, version: int, stats: IterationStats) -> Iterator[MicroBatch]:
        share = self.share
        shape, G = share.local, share.shape.group_size
        N, M, per_block = shape.prompts, shape.mini_batches, shape.prompts_per_step
        slots: dict[int, list[Trajectory]] = {}  # slot -> accepted group's trajectories
        dropped: list[tuple[int, list[Trajectory]]] = []  # (slot, group) with all-equal shaped rewards
        ready: list[list[Trajectory]] = [[] for _ in range(M)]  # per mini-batch, in arrival order
        emitted: list[MicroBatch] = []
        block, offset = 0, 0

        def drain() -> Iterator[MicroBatch]:
            nonlocal block, offset
            while block < M and len(ready[block]) >= shape.micro_batch_size:
                chunk = ready[block][: shape.micro_batch_size]
                del ready[block][: shape.micro_batch_size]
                batch = collate(
                    chunk, self.pad_id, offset, self.packing.mode, self.packing.min_gain, self.packing.max_row_tokens, G
                )
                offset += len(chunk)
                batch.ends_step = offset % shape.samples_per_step == 0
                batch.logprob_tolerance = self.logprob_tolerance
                block += batch.ends_step
                if shape.passes > 1:  # kept for the later passes' replay
                    emitted.append(batch)
                yield batch

        open_slots = list(range(N))  # this rank's (local) slots without an accepted group
        everywhere = list(range(share.shape.prompts))  # every rank's open (global) slots: all of them at first
        for round_index in range(self.max_sampling_rounds if self.dynamic_sampling else 1):
            if round_index:  # the same call on every rank, each round, even a rank with nothing left open
                everywhere = self.open_slots_everywhere([share.global_slot(slot) for slot in open_slots])
            if not everywhere:
                break
            # the round's prompts are numbered over every rank's open slots, in slot order, as on one device
            first = self.schedule.cursor + stats.prompts_drawn
            position = {slot: i for i, slot in enumerate(everywhere)}
            slot_of = {first + position[share.global_slot(slot)]: slot for slot in open_slots}
            stats.prompts_drawn += len(everywhere)
            if not slot_of:
                continue
            drawn = self.schedule.draw(list(slot_of), version)
            requests = {prompt_id: d.request for prompt_id, d in drawn.items()}
            stats.generation_done = False
            groups = self.scorer.stream(self._generate(list(requests.values()), drawn), drawn)
            if self.materialize:  # the colocated baseline: generate everything, then train
                groups = iter(list(groups))
            waiting = dict(requests)
            while waiting:
                group = next(groups, None)
                if group is None:
                    raise RuntimeError(
                        f"iteration of version {version}: the pool stopped with prompts {sorted(waiting)[:10]} "
                        f"({len(waiting)} in all) never returned: refusing to lose trajectories"
                    )
                slot = slot_of.get(group.prompt_id, -1)
                trajectories = self.acceptor.accept(group, waiting, version)
                stats.completions += G
                stats.completion_tokens += sum(len(t.completion_tokens) for t in trajectories)
                stats.reward_sum += float(
                    torch.tensor(group.rewards, dtype=torch.float32).sum()
                )  # as summed since the first release
                if not waiting:  # drain the stream now, so no exchange with the pool runs after the final yield
                    for extra in groups:
                        raise RuntimeError(
                            f"the pool returned prompt_id {extra.prompt_id} after the round was complete"
                        )
                    stats.gen_intervals.extend(self._busy_intervals())  # this round's; the pool keeps only the last
                    stats.generation_done = True
                if self.dynamic_sampling and trajectories[0].zero_variance:
                    dropped.append((slot, trajectories))
                    stats.dropped_groups += 1
                    continue
                slots[slot] = trajectories
                ready[slot // per_block].extend(trajectories)
                yield from drain()
            open_slots = sorted(set(range(N)) - set(slots))
        next_first = self.schedule.cursor + stats.prompts_drawn  # read now: the cursor moves at the last micro-batch
        if open_slots:  # dynamic sampling ran out of rounds: refill with zero-variance groups (no gradient)
            for (_, trajectories), slot in zip(sorted(dropped, key=lambda d: d[0]), open_slots):
                slots[slot] = trajectories
                ready[slot // per_block].extend(trajectories)
            stats.dropped_groups -= len(open_slots)
        yield from drain()
        for pass_index in range(1, shape.passes):  # later passes: the same micro-batches, same steps
            for batch in emitted:
                yield dataclasses.replace(batch, pass_index=pass_index)
        # Only a prefetch thread gets here (Lightning never resumes after the last micro-batch): tokenize the
        # next iteration's prompts while the trainer finishes this one, off the next iteration's critical path.
        self.schedule.tokenize_ahead([next_first + slot for slot in share.slots])

    def _generate(self, requests: list[GroupRequest], drawn: dict[int, DrawnPrompt]) -> Iterator[GroupCompletions]:
        if self.episodes is None:
            return self.pool.generate(requests, self.sampling)
        return self.episodes.generate(self.pool, requests, self.sampling, drawn)

    def _busy_intervals(self) -> list[tuple[float, float]]:
        return self.pool.busy_intervals() if self.episodes is None else self.episodes.busy_intervals()
