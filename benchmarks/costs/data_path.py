"""The trainer's data work per micro-batch of the default job, old code against new, side by side.

Between two training steps the trainer's thread scores, accepts (checks and advantages) and collates the
next micro-batch: 8 groups of 8 completions (``CopyTask`` prompts through the character tokenizer,
completions of 1-6 tokens, the positional reward, GRPO's advantages, shared-prompt packing). This times
each part with the code of a baseline commit (``--baseline``, loaded from ``git show``) and with the
working tree's, interleaved, and checks first that both give the same micro-batches bit for bit (every
tensor's dtype, shape, strides and values; every trajectory field). Scoring did not change: its row, the
same code on both sides, shows the timing's noise floor.

Two conditions, since a torch op's fixed cost grows after a training step has run through the caches:
``warm`` (the parts back to back) and ``after a step`` (a forward and backward of the default model,
hidden 128, over 64 samples before each timed micro-batch, as in a run). Medians over ``--reps`` rounds.

Usage: ``.venv/bin/python benchmarks/costs/data_path.py [--baseline 976f034] [--reps 30]``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lit_parl.data.group_acceptor import GroupAcceptor
from lit_parl.data.group_scorer import GroupScorer
from lit_parl.data.micro_batch import collate
from lit_parl.data.prompt_schedule import PromptSchedule
from lit_parl.models import tiny_qwen2
from lit_parl.models.char_tokenizer import build_char_tokenizer
from lit_parl.rollout.records import GroupCompletions
from lit_parl.tasks import CopyTask, positional_reward
from lit_parl.trainer.grpo_objective import GRPOObjective

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "976f034"  # the data path before issue 29's item 2 (torch-op packing, per-group torch checks)


def baseline_modules(rev: str):
    """(GRPOObjective, GroupAcceptor, collate) of commit ``rev``, loaded from git into private modules."""

    def module(path: str, name: str, **globals_):
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True)
        mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
        sys.modules[name] = mod  # dataclasses look their module up
        exec(compile(source.stdout, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 - this repository's own code
        mod.__dict__.update(globals_)  # the baseline's own neighbours in place of the working tree's
        return mod

    packing = module("kernels/packing.py", "_old_packing")
    micro_batch = module("lit_parl/data/micro_batch.py", "_old_micro_batch", pack=packing.pack)
    acceptor = module("lit_parl/data/group_acceptor.py", "_old_group_acceptor", Trajectory=micro_batch.Trajectory)
    objective = module("lit_parl/trainer/grpo_objective.py", "_old_grpo_objective")
    return objective.GRPOObjective, acceptor.GroupAcceptor, micro_batch.collate


def micro_batches(count: int, seed: int = 0):
    """``count`` micro-batches of the default job: (drawn prompts, unscored groups) of 8 prompts each."""
    tokenizer = build_char_tokenizer()
    schedule = PromptSchedule(CopyTask(seed=seed), tokenizer, group_size=8, seed=seed)
    rng = random.Random(seed)
    out = []
    for b in range(count):
        drawn = schedule.draw(list(range(8 * b, 8 * b + 8)), version=0)
        groups = []
        for prompt_id, d in drawn.items():
            answer = list(d.answer_ids) + [tokenizer.eos_token_id]
            completions = []
            for _ in range(8):  # right answers, wrong ones, cut ones: rewards in [0, 1], some groups all equal
                n = rng.randint(1, 6)
                completions.append(answer[:n] if rng.random() < 0.5 else [rng.randrange(3, 40) for _ in range(n)])
            logprobs = [[-rng.expovariate(1.0) for _ in c] for c in completions]
            reasons = ["stop" if c[-1] == tokenizer.eos_token_id else "length" for c in completions]
            groups.append(GroupCompletions(prompt_id, 0, list(range(8)), completions, logprobs, reasons))
        out.append((drawn, groups))
    return tokenizer, out


def identical(a, b, path: str = "batch") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), path
        assert torch.equal(a, b), path
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            identical(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b)):
            identical(x, y, f"{path}[{k}]")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), (path, a, b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the old code (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=30, help="timing rounds (medians are printed)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the trainer's threads in the default job
    old_objective, old_acceptor, old_collate = baseline_modules(args.baseline)
    tokenizer, batches = micro_batches(40)
    scorer = GroupScorer([positional_reward], tokenizer)
    sides = {
        "old": (old_acceptor(old_objective(), group_size=8, max_new_tokens=6), old_collate),
        "new": (GroupAcceptor(GRPOObjective(), group_size=8, max_new_tokens=6), collate),
    }
    scored = [[scorer.score(drawn[g.prompt_id], g) for g in groups] for drawn, groups in batches]

    def accept(side: str, b: int):
        acceptor = sides[side][0]
        waiting = {prompt_id: d.request for prompt_id, d in batches[b][0].items()}
        return [t for group in scored[b] for t in acceptor.accept(group, waiting, 0)]

    accepted = {side: [accept(side, b) for b in range(len(batches))] for side in sides}

    def collated(side: str, b: int):
        return sides[side][1](accepted[side][b], tokenizer.pad_token_id, 0, "auto", 1.5, None, 8)

    for b in range(len(batches)):  # bit for bit before timing
        identical(accepted["new"][b], accepted["old"][b], f"micro-batch {b} trajectories")
        identical(collated("new", b), collated("old", b), f"micro-batch {b}")
    print(f"{len(batches)} micro-batches identical, old ({args.baseline}) and new")

    model, _ = tiny_qwen2(hidden_size=128, intermediate_size=512)  # conf/model/tiny_qwen2.yaml
    step_input = torch.randint(0, 40, (1, 64 * 12))

    def training_step() -> None:
        model(step_input).logits.float().logsumexp(-1).mean().backward()

    parts = {
        "score (unchanged)": lambda side, b: [scorer.score(batches[b][0][g.prompt_id], g) for g in batches[b][1]],
        "accept (8 groups)": accept,
        "collate": collated,
    }
    print(f"ms per micro-batch, median of {args.reps} rounds over {len(batches)} micro-batches, 1 thread")
    print(f"{'condition':12s} {'part':18s} {'old':>7s} {'new':>7s} {'old/new':>8s}")
    for condition in ("warm", "after a step"):
        times = {(part, side): [] for part in [*parts, "total"] for side in sides}
        for _ in range(args.reps):
            for side in sides:
                spent = dict.fromkeys(parts, 0.0)
                for b in range(len(batches)):
                    if condition != "warm":
                        training_step()
                    for part, fn in parts.items():
                        start = time.perf_counter()
                        fn(side, b)
                        spent[part] += time.perf_counter() - start
                for part, seconds in spent.items():
                    times[part, side].append(seconds / len(batches) * 1e3)
                times["total", side].append(sum(spent.values()) / len(batches) * 1e3)
        for part in [*parts, "total"]:
            old, new = (statistics.median(times[part, side]) for side in sides)
            print(f"{condition:12s} {part:18s} {old:7.3f} {new:7.3f} {old / new:7.2f}x")


if __name__ == "__main__":
    main()
