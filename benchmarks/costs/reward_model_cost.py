"""What a reward model costs the trainer's process: samples scored per second through the run's own path
(``GroupScorer`` with a ``RewardModel``), one sample per forward against batches of a group and of several groups.

Two reward models: the benchmark's tiny digit model (``lit_parl.tiny_reward_model``, 0.1M parameters, the default
job's shapes: groups of 8 copy-task completions of up to 6 characters) and a SmolLM2-135M backbone with a one-logit
head (its chat template; completions of ``--smollm2-chars`` characters of digits and words), both in float32 on this
CPU. Settings are run interleaved, ``--repeats`` times each; the table gives the median and the ratio to one sample
per forward.

Usage: ``.venv/bin/python benchmarks/costs/reward_model_cost.py [--groups 64] [--repeats 3] [--models tiny smollm2]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from lit_parl import tiny_reward_model
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rewards import RewardModel
from lit_parl.rollout.records import GroupCompletions
from lit_parl.tasks import CopyTask

# (label, batch_size, concurrent groups): one sample per forward; a group per forward; several groups per forward
SETTINGS = (
    ("1 sample / forward", 1, 1),
    ("1 group (8) / forward", 8, 1),
    ("4 groups (32) / forward", 32, 4),
    ("8 groups (64) / forward", 64, 8),
)


def saved_reward_model(which: str) -> str:
    path = tempfile.mkdtemp(prefix=f"rm_cost_{which}_")
    if which == "tiny":
        model, tokenizer = tiny_reward_model(seed=0)
    else:
        from transformers import AutoModelForSequenceClassification

        from lit_parl.models.smollm2 import smollm2_instruct

        policy, tokenizer = smollm2_instruct()
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_pretrained(policy.name_or_path, num_labels=1)
        model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def groups_for(which: str, count: int, chars: int):
    tokenizer = build_char_tokenizer()
    drawn = PromptSchedule(CopyTask(seed=0), tokenizer, group_size=8).draw(list(range(count)), version=0)
    rng = random.Random(0)
    words = ["the", "digits", "reversed", "are", "so", "answer", "is", "then"]
    groups = []
    for prompt_id in range(count):
        if which == "tiny":
            texts = ["".join(rng.choice("0123456789") for _ in range(rng.randint(1, 6))) for _ in range(8)]
        else:
            texts = [
                " ".join(rng.choice(words + [str(rng.randrange(10))]) for _ in range(chars // 4))[:chars]
                for _ in range(8)
            ]
        completions = [tokenizer(t).input_ids + [tokenizer.eos_token_id] for t in texts]
        groups.append(
            GroupCompletions(
                prompt_id, 0, list(range(8)), completions, [[0.0] * len(c) for c in completions], ["stop"] * 8
            )
        )
    return tokenizer, drawn, groups


def samples_per_s(path: str, batch_size: int, concurrent: int, tokenizer, drawn, groups) -> float:
    reward = RewardModel(path, batch_size=batch_size, max_wait_s=0.02, concurrent_groups=concurrent)
    scorer = GroupScorer([reward], tokenizer)  # workers: the reward's concurrent_groups, as a run sets them
    start = time.perf_counter()
    scored = sum(len(g.rewards) for g in scorer.stream(iter(groups), drawn))
    elapsed = time.perf_counter() - start
    scorer.close()
    return scored / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--smollm2-chars", type=int, default=200)
    args = parser.parse_args()
    print(
        f"torch threads {torch.get_num_threads()}; {args.groups} groups of 8 per measurement; median of {args.repeats}"
    )
    for which in args.models:
        path = saved_reward_model(which)
        tokenizer, drawn, groups = groups_for(which, args.groups, args.smollm2_chars)
        results = {label: [] for label, _, _ in SETTINGS}
        for _ in range(args.repeats):
            for label, batch_size, concurrent in SETTINGS:
                results[label].append(samples_per_s(path, batch_size, concurrent, tokenizer, drawn, groups))
        base = statistics.median(results[SETTINGS[0][0]])
        print(f"\n{which}: | setting | samples/s (median) | runs | vs one per forward |")
        for label, values in results.items():
            median = statistics.median(values)
            print(f"| {label} | {median:.1f} | {' '.join(f'{v:.1f}' for v in values)} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
