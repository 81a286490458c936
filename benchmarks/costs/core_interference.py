"""How much one core's work slows down when another core works at the same time (issue 41, item 2).

Periodic asynchrony on two cores can reach 2x over phases taking turns only if a phase runs as fast beside the
other as it runs alone. This measures that on the machine at hand: a fixed piece of work, pinned to core A, timed
alone and then while the same work runs pinned to core B, interleaved ``--rounds`` times. Three kinds of work:

- ``python``: an integer loop in the interpreter (no memory traffic to speak of: slows only if the two cores
  share an execution unit, as SMT siblings do, or the host takes time from one);
- ``matmul``: torch, one thread, [64, 128] x [128, 512] products (the default job's model's shapes: in cache);
- ``stream``: torch, one thread, a 64 MB tensor copied (memory bandwidth).

Prints each one's median time alone and beside the other, and the slowdown.

    .venv/bin/python benchmarks/costs/core_interference.py --rounds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time

WORKS = ("python", "matmul", "stream")


def work(kind: str) -> float:
    """One piece of ``kind`` work; its seconds."""
    import torch

    torch.set_num_threads(1)
    if kind == "matmul":
        a, b = torch.randn(64, 128), torch.randn(128, 512)
    elif kind == "stream":
        a, b = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    start = time.perf_counter()
    if kind == "python":
        total = 0
        for i in range(6_000_000):
            total += i
    elif kind == "matmul":
        for _ in range(6000):
            a @ b
    else:
        for _ in range(40):
            b.copy_(a)
    return time.perf_counter() - start


def pinned(core: int, kind: str, start, out) -> None:
    os.sched_setaffinity(0, {core})
    start.wait()
    out.put(work(kind))


def timed(kind: str, cores: list[int]) -> float:
    """The seconds the piece pinned to ``cores[0]`` took, with the same piece on each other core at once."""
    context = multiprocessing.get_context("spawn")
    start, outs = context.Event(), [context.Queue() for _ in cores]
    processes = [context.Process(target=pinned, args=(core, kind, start, out)) for core, out in zip(cores, outs)]
    for process in processes:
        process.start()
    time.sleep(2.0)  # every process imported torch and waits
    start.set()
    seconds = outs[0].get()
    for process in processes:
        process.join()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1])
    args = parser.parse_args()
    a, b = args.cores
    print(f"| work | alone on core {a}, s | beside the same on core {b}, s | slowdown |")
    print("|---|---|---|---|")
    for kind in WORKS:
        alone, beside = [], []
        for _ in range(args.rounds):
            alone.append(timed(kind, [a]))
            beside.append(timed(kind, [a, b]))
        m_alone, m_beside = statistics.median(alone), statistics.median(beside)
        print(f"| {kind} | {m_alone:.3f} | {m_beside:.3f} | {m_beside / m_alone:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
