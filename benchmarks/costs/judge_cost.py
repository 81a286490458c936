"""What a slow LLM judge costs the run: samples judged per second through the run's own path (``GroupScorer`` with a
``JudgeReward``) against a judge server that takes ``--latency-s`` to answer each request, one request at a time
against the overlap the judge's settings give (requests of a group at once; several groups in flight).

The server is the tests' OpenAI-compatible stand-in (``tests/helpers/judge_server.py``) with a fixed stall per
request, so the figures are of the client and the scorer, not of a model: the ideal is ``in-flight / latency``.
Every sample is a distinct request (no cache hits). Settings run interleaved, ``--repeats`` times each.

Usage: ``.venv/bin/python benchmarks/costs/judge_cost.py [--groups 16] [--latency-s 0.2] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers.judge_server import JudgeServer  # noqa: E402
from lit_parl.data.group_scorer import GroupScorer  # noqa: E402
from lit_parl.data.prompt_schedule import PromptSchedule  # noqa: E402
from lit_parl.models.char_tokenizer import build_char_tokenizer  # noqa: E402
from lit_parl.rewards import JudgeReward  # noqa: E402
from lit_parl.rollout.records import GroupCompletions  # noqa: E402
from lit_parl.tasks import CopyTask  # noqa: E402

# (label, requests in flight at most, groups in flight)
SETTINGS = (
    ("1 request at a time", 1, 1),
    ("a group's 8 at once", 8, 1),
    ("4 groups at once (32)", 32, 4),
    ("8 groups at once (64)", 64, 8),
)


def groups_for(count: int, run: int):
    tokenizer = build_char_tokenizer()
    drawn = PromptSchedule(CopyTask(seed=0), tokenizer, group_size=8).draw(list(range(count)), version=0)
    groups = []
    for prompt_id in range(count):  # distinct texts per run and sample: nothing comes from the cache
        completions = [tokenizer(f"{run}{prompt_id}{k}").input_ids + [tokenizer.eos_token_id] for k in range(8)]
        groups.append(
            GroupCompletions(
                prompt_id, 0, list(range(8)), completions, [[0.0] * len(c) for c in completions], ["stop"] * 8
            )
        )
    return tokenizer, drawn, groups


def samples_per_s(url: str, concurrency: int, concurrent_groups: int, groups_and_schedule) -> float:
    tokenizer, drawn, groups = groups_and_schedule
    judge = JudgeReward(url, concurrency=concurrency, concurrent_groups=concurrent_groups, cache_size=0)
    scorer = GroupScorer([judge], tokenizer)  # workers: the judge's concurrent_groups, as a run sets them
    start = time.perf_counter()
    scored = sum(len(g.rewards) for g in scorer.stream(iter(groups), drawn))
    elapsed = time.perf_counter() - start
    scorer.close()
    return scored / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--latency-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    server = JudgeServer(stall_s=args.latency_s).start()
    print(f"{args.groups} groups of 8 per measurement, {args.latency_s} s per request; median of {args.repeats}")
    results = {label: [] for label, _, _ in SETTINGS}
    try:
        for repeat in range(args.repeats):
            for index, (label, concurrency, concurrent_groups) in enumerate(SETTINGS):
                work = groups_for(args.groups, repeat * len(SETTINGS) + index)
                results[label].append(samples_per_s(server.url, concurrency, concurrent_groups, work))
    finally:
        server.stop()
    base = statistics.median(results[SETTINGS[0][0]])
    print("| setting | samples/s (median) | runs | ideal | vs one at a time |")
    print("|---|---|---|---|---|")
    for label, concurrency, concurrent_groups in SETTINGS:
        median = statistics.median(results[label])
        ideal = min(concurrency, 8 * concurrent_groups) / args.latency_s
        runs = " ".join(f"{v:.1f}" for v in results[label])
        print(f"| {label} | {median:.1f} | {runs} | {ideal:.0f} | {median / base:.1f}x |")


if __name__ == "__main__":
    main()
