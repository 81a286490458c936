"""Per-completion cost of scoring a group in the trainer's process: the token-id reward of the default job
against the same reward over decoded text (``benchmarks/costs/reward_fns.py``), on the default job's shapes
(groups of 8, completions of up to 6 tokens plus the end token, the character tokenizer).

Usage: ``.venv/bin/python benchmarks/costs/scoring_cost.py [--groups 2000] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reward_fns import positional_text  # noqa: E402

from lit_parl.data.group_scorer import GroupScorer  # noqa: E402
from lit_parl.data.prompt_schedule import PromptSchedule  # noqa: E402
from lit_parl.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from lit_parl.rewards import Reward  # noqa: E402
from lit_parl.rollout.records import GroupCompletions  # noqa: E402
from lit_parl.tasks import CopyTask, positional_reward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer()
    drawn = PromptSchedule(CopyTask(seed=0), tokenizer, group_size=8).draw(list(range(args.groups)), version=0)
    rng = random.Random(0)
    groups = []
    for prompt_id in range(args.groups):
        completions = [
            [rng.randrange(3, 13) for _ in range(rng.randint(1, 6))] + [tokenizer.eos_token_id] for _ in range(8)
        ]
        groups.append(
            GroupCompletions(
                prompt_id, 0, list(range(8)), completions, [[0.0] * len(c) for c in completions], ["stop"] * 8
            )
        )
    scorers = {
        "token ids": GroupScorer([positional_reward], tokenizer),
        "text": GroupScorer([positional_text], tokenizer),
        "both": GroupScorer([positional_reward, Reward(positional_text, weight=0.0)], tokenizer),
    }
    per_completion = {name: [] for name in scorers}
    for _ in range(args.repeats):
        for name, scorer in scorers.items():
            start = time.perf_counter()
            for group in groups:
                scorer.score(drawn[group.prompt_id], group)
            per_completion[name].append((time.perf_counter() - start) / (8 * args.groups) * 1e6)
    for name, times in per_completion.items():
        print(
            f"{name:10s} {statistics.median(times):6.2f} us per completion "
            f"(median of {args.repeats}: {', '.join(f'{t:.2f}' for t in times)})"
        )
    extra = statistics.median(per_completion["both"]) - statistics.median(per_completion["token ids"])
    print(
        f"a text reward beside the token one adds {extra:.2f} us per completion: "
        f"{extra * 256 / 1e3:.2f} ms per default-job iteration of 256 completions"
    )


if __name__ == "__main__":
    main()
