"""Rewards for benchmarks/costs/text_rewards.py, named by file on the command line
(``fn=benchmarks/costs/reward_fns.py:...``).

Each is added beside the default job's own reward with weight 0, so the total reward, hence everything
trained, stays bit-identical: the runs do equal work, and what differs is the cost of the added reward.
"""

from __future__ import annotations

import time


def positional_text(completion: str, answer: str, stopped: bool) -> float:
    """The digit tasks' positional reward computed from the decoded text instead of token ids."""
    output = list(completion) + (["<end>"] if stopped else [])
    target = list(answer) + ["<end>"]
    return sum(o == t for o, t in zip(output, target)) / max(len(output), len(target))


def slow_verifier(completion_ids: list[list[int]]) -> list[float]:
    """A verifier that answers a group in 10 ms (a remote call, a sandbox): batched, one call per group."""
    time.sleep(0.010)
    return [0.0] * len(completion_ids)


slow_verifier.batched = True
