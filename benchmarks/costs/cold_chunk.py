"""What a pause costs the next chunk's decode: a rollout worker's chunk right after another, and after a pause.

A worker decodes its iteration's chunks back to back, then waits through the trainer's last steps and the
weight sync before the next iteration's first chunk. This times a chunk (``sample_groups``, 8 prompts x G = 8,
the default model h128 x 2, one thread) in pairs: the pair's first chunk after a pause of ``--pause-ms``
(sleeping, or spinning in Python), and the second right after the first; for 1, 6 and 12 new tokens. Also
500 ``linear`` calls, the same way: a pause that slows the decode but not these slows the decode's code
path (its many small operations), not arithmetic.

    .venv/bin/python benchmarks/costs/cold_chunk.py
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pause-ms", type=float, default=60.0)
    parser.add_argument("--pairs", type=int, default=15)
    args = parser.parse_args()
    import torch

    from lit_parl.models import tiny_qwen2
    from lit_parl.rollout.records import GroupRequest, SamplingParams
    from lit_parl.rollout.sampling import sample_groups

    torch.set_num_threads(1)
    model, tokenizer = tiny_qwen2(hidden_size=128, num_layers=2, intermediate_size=512)
    requests = [GroupRequest(i, tuple(range(3, 13 + i % 5)), 0, tuple(range(8 * i, 8 * i + 8))) for i in range(8)]
    x, w = torch.randn(64, 128), torch.randn(512, 128)
    pause = args.pause_ms / 1e3

    def chunk(tokens: int) -> None:
        list(
            sample_groups(
                model, requests, SamplingParams(max_new_tokens=tokens), tokenizer.eos_token_id, tokenizer.pad_token_id
            )
        )

    def linears() -> None:
        for _ in range(500):
            torch.nn.functional.linear(x, w)

    def spin() -> None:
        end = time.perf_counter() + pause
        while time.perf_counter() < end:
            pass

    waits = {"none": lambda: None, "sleep": lambda: time.sleep(pause), "spin": spin}
    work = {f"chunk, {n} new tokens": (lambda n=n: chunk(n)) for n in (1, 6, 12)} | {"500 linears": linears}
    print(f"medians of {args.pairs} pairs, ms: first of the pair (after the pause), second (right after the first)")
    for name, job in work.items():
        job()  # warm-up
        for wait_name, wait in waits.items():
            first, second = [], []
            for _ in range(args.pairs):
                wait()
                for times in (first, second):
                    start = time.perf_counter()
                    job()
                    times.append(1e3 * (time.perf_counter() - start))
            print(
                f"{name:24s} pause {wait_name:5s}: {statistics.median(first):6.1f}  {statistics.median(second):6.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
