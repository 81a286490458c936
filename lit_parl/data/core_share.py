"""CoreShare: on the CPU, the pool's cores go to the trainer for the part of an iteration the pool has no work in.

Periodic asynchrony splits a machine's cores between the pool's workers and the trainer. Once the pool has
returned the last group of the iteration it idles until the next weight sync, while the trainer still has
the iteration's tail to train (every micro-batch after the last group's arrival). ``CoreShare`` raises the
trainer's intra-op threads to its own plus the pool's for that tail, and lowers them again when the next
iteration's requests go out. The workers' threads stay as they are: while the pool generates the first
chunk the trainer is not idle (Lightning's epoch end and start run then), and a worker that decoded it on
the trainer's core too took 1.4x longer (``benchmarks/pipeline/fill_threads.py``; ``docs/performance.md``,
"Cores follow the work").

The change is applied on the trainer's own thread, before each micro-batch leaves for a step:
``torch.set_num_threads`` sets the calling thread's OpenMP team, and the batcher may run in another thread.
What is trained is unchanged up to the order of floating-point sums: a weight gradient summed over a
micro-batch's tokens by two threads differs from one thread's in the last bits (about 1e-8 relative on the
copy task's models); ``tests/data/test_core_share.py`` bounds what a fit with the switch differs by.

Example::

    >>> import torch
    >>> from lit_parl.data.iteration_stats import IterationStats
    >>> before = torch.get_num_threads()
    >>> cores = CoreShare(trainer_threads=1, pool_threads=1)
    >>> stats = IterationStats()
    >>> cores.follow(stats), torch.get_num_threads()
    (1, 1)
    >>> stats.generation_done = True  # the batcher received the iteration's last group
    >>> cores.follow(stats), torch.get_num_threads()
    (2, 2)
    >>> torch.set_num_threads(before)
"""

from __future__ import annotations

import os

import torch

from lit_parl.data.iteration_stats import IterationStats

# Measured on two cores (benchmarks/RESULTS.md, "Cores follow the work"): lending made the 0.5M-parameter
# default job 3% slower (its steps are too small for a second thread) and a 4.2M one 14% faster.
LEND_FROM_PARAMETERS = 2_000_000


def cores_to_lend(reserved: int, trainer_threads: int) -> int:
    """The pool's threads the trainer may take: its reserved ones, but never past the cores the trainer's process
    may run on (its CPU affinity: all of the machine's, or those ``taskset`` gave it). A team of more OpenMP
    threads than cores waits at every barrier for a thread that is not running (measured: two workers lending
    both their threads to a one-thread trainer on two cores, 432 completions/s against 709)."""
    return max(0, min(reserved, len(os.sched_getaffinity(0)) - trainer_threads))


def worth_lending(policy: torch.nn.Module | None, on_cpu: bool) -> bool:
    """Whether lending the pool's cores pays by default: a CPU trainer whose policy's steps are big enough
    for a second thread (``LEND_FROM_PARAMETERS`` parameters or more)."""
    return on_cpu and policy is not None and sum(p.numel() for p in policy.parameters()) >= LEND_FROM_PARAMETERS


class CoreShare:
    """The trainer's threads for the next micro-batch: its own, or its own and the pool's once the pool is done.

    Args:
        trainer_threads: the trainer's threads while the pool generates beside it.
        pool_threads: the threads the pool's workers hold on this machine (``RolloutPool.reserved_cpus``),
            lent to the trainer while the pool is idle; 0 lends nothing.
    """

    def __init__(self, trainer_threads: int, pool_threads: int) -> None:
        if trainer_threads < 1 or pool_threads < 0:
            raise ValueError(
                f"CoreShare(trainer_threads={trainer_threads}, pool_threads={pool_threads}): the trainer needs "
                "at least one thread and the pool lends zero or more"
            )
        self.trainer_threads, self.pool_threads = trainer_threads, pool_threads

    def threads(self, stats: IterationStats) -> int:
        """Override to lend differently: the threads the trainer takes for its next micro-batch."""
        return self.trainer_threads + (self.pool_threads if stats.generation_done else 0)

    def follow(self, stats: IterationStats) -> int:
        """Set the calling thread's torch threads for the next micro-batch of the iteration ``stats`` describes."""
        threads = self.threads(stats)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def release(self) -> None:
        """Back to the trainer's own threads when the fit ends (within a fit ``follow`` gives them back)."""
        if torch.get_num_threads() != self.trainer_threads:
            torch.set_num_threads(self.trainer_threads)
