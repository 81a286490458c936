"""One thread against two, with and without OpenMP's spin: a chunk's decode and a micro-batch's training step.

Each setting runs in a fresh process (OpenMP reads its environment once, when torch loads): ``GOMP_SPINCOUNT=0``
(a plain passive policy: an idle thread sleeps at once) and ``100000`` (about 1 ms of spin; lit_parl sets 1000).
In each, for the copy task's models h128 and h256 x 4 (benchmarks/vs_trl), it times at 1 and 2 torch threads:
- decode: ``sample_groups`` of one chunk, 8 prompts x G = 8, 12 new tokens (what a rollout worker does);
- train: forward and backward of 64 rows of 40 tokens (a padded micro-batch of the trainer's size).
It prints the median of 5 repetitions per cell, and whether the sampled tokens and their log-probs are the
same on 1 and 2 threads.

    .venv/bin/python benchmarks/costs/thread_scaling.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

MODELS = {"h128": (128, 2), "h256x4": (256, 4)}


def measure() -> dict:
    import torch

    from lit_parl.models import tiny_qwen2
    from lit_parl.rollout.records import GroupRequest, SamplingParams
    from lit_parl.rollout.sampling import sample_groups

    out = {}
    for name, (hidden, layers) in MODELS.items():
        model, tokenizer = tiny_qwen2(hidden_size=hidden, num_layers=layers, intermediate_size=4 * hidden)
        requests = [GroupRequest(i, tuple(range(3, 13 + i % 5)), 0, tuple(range(8 * i, 8 * i + 8))) for i in range(8)]
        sampling = SamplingParams(max_new_tokens=12)
        ids = torch.randint(0, 30, (64, 40), generator=torch.Generator().manual_seed(0))
        samples = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            decode, train = [], []
            for _ in range(5):
                start = time.perf_counter()
                groups = list(sample_groups(model, requests, sampling, tokenizer.eos_token_id, tokenizer.pad_token_id))
                decode.append(time.perf_counter() - start)
                start = time.perf_counter()
                model(ids).logits.float().logsumexp(-1).mean().backward()
                train.append(time.perf_counter() - start)
                model.zero_grad()
            samples[threads] = [(g.completions, g.logprobs) for g in groups]
            out[f"{name} decode {threads}t ms"] = round(1e3 * statistics.median(decode), 1)
            out[f"{name} train {threads}t ms"] = round(1e3 * statistics.median(train), 1)
        out[f"{name} same tokens on 1 and 2 threads"] = [c for c, _ in samples[1]] == [c for c, _ in samples[2]]
        out[f"{name} same log-probs on 1 and 2 threads"] = samples[1] == samples[2]
    return out


def main() -> None:
    if os.environ.get("THREAD_SCALING_CHILD"):
        print(json.dumps(measure()))
        return
    results = {}
    for spin in ("0", "100000"):
        env = {**os.environ, "GOMP_SPINCOUNT": spin, "OMP_WAIT_POLICY": "PASSIVE", "THREAD_SCALING_CHILD": "1"}
        run = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=True)
        results[spin] = json.loads(run.stdout.strip().splitlines()[-1])
    print("| measurement | GOMP_SPINCOUNT=0 | GOMP_SPINCOUNT=100000 |")
    print("|---|---|---|")
    for key in results["0"]:
        print(f"| {key} | {results['0'][key]} | {results['100000'][key]} |")


if __name__ == "__main__":
    main()
