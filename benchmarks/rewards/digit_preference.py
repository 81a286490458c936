"""The property the benchmark's reward model learns to prefer, and the preference pairs that teach it.

The property: the share of a completion's characters that are even digits ("2846" -> 1.0, "3917" -> 0.0, "" -> 0.0).
It is also a reward function (its keyword is a reward field), so a run can log it beside the reward model's score
with weight 0: ``+reward.even_share._target_=lit_parl.rewards.Reward
+reward.even_share.fn=benchmarks/rewards/digit_preference.py:even_share +reward.even_share.weight=0``.
"""

from __future__ import annotations

import random

EVEN = "02468"
ODD = "13579"


def even_share(completion: str) -> float:
    return sum(c in EVEN for c in completion) / len(completion) if completion else 0.0


def random_completion(rng: random.Random) -> str:
    """Digits of a random length (1-6, the default job's max_new_tokens) with a random share of even ones."""
    p_even = rng.random()
    return "".join(rng.choice(EVEN if rng.random() < p_even else ODD) for _ in range(rng.randint(1, 6)))


def preference_pairs(prompts: list[str], count: int, seed: int) -> list[tuple[str, str, str]]:
    """``count`` (prompt, chosen, rejected) triples: chosen has the larger even share (ties are not drawn)."""
    rng = random.Random(seed)
    pairs = []
    while len(pairs) < count:
        prompt = rng.choice(prompts)
        a, b = random_completion(rng), random_completion(rng)
        if even_share(a) == even_share(b):
            continue
        chosen, rejected = (a, b) if even_share(a) > even_share(b) else (b, a)
        pairs.append((prompt, chosen, rejected))
    return pairs
