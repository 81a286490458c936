"""The shared SGLang pool's one push against a push per rank, on the CPU with stand-in servers.

Both layouts run the same fit: a 2-rank DDP trainer (gloo), two stand-in SGLang servers in all
(``tests/helpers/sglang_standin.py``, the tests' tiny model, float32), ``tensor`` sync, the tests' job (8
prompts x 4 samples, 2 mini-batches, SGD), ``--iterations`` iterations (``tests/helpers/distributed_fit.py``):

- shared: rank 0 launches both servers and pushes each version to both; rank 1 joins them, reads every
  bucket (as a sharded policy's gathers would need) and adopts the version once the servers report it;
- per rank: each rank launches one server of its own and pushes to it, as each rank does to an embedded pool.

Per run: the seconds each rank spent in a push (median over the run's pushes), the seconds per iteration
(median over the iterations after the first, whose time includes the servers' start; epoch end to epoch end),
the bytes the servers loaded per push (their journal) and the most any one rank sent per push. The layouts
alternate, ``--repeats`` times each; the ratios are shared over per rank.

    .venv/bin/python benchmarks/costs/shared_push.py [--iterations 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from math import prod
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.multi_process import free_port  # noqa: E402

SCRIPT = ROOT / "tests" / "helpers" / "distributed_fit.py"
LAYOUTS = {"shared": [], "per rank": ["--sglang-per-rank"]}


def run(layout: str, iterations: int, out: Path) -> dict:
    out.mkdir(parents=True)
    journal = out / "journal"
    command = [
        *(sys.executable, str(SCRIPT), "--strategy", "ddp", "--devices", "2", "--out", str(out)),
        *("--iterations", str(iterations), "--sglang-port", str(free_port(4)), "--sglang-journal", str(journal)),
        *LAYOUTS[layout],
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"{layout} run failed:\n{result.stderr[-3000:]}")
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]
    loads = [e for e in map(json.loads, journal.read_text().splitlines()) if e["event"] == "load"]
    by_version: dict[str, int] = defaultdict(int)
    for load in loads:
        by_version[load["version"]] += sum(4 * prod(shape) for _, shape in load["tensors"])  # float32
    per_push = statistics.median(by_version.values())
    return {
        "push_s": [statistics.median(rank["sync_seconds"]) for rank in ranks],
        "iteration_s": statistics.median(t for rank in ranks for t in rank["iteration_seconds"]),
        "bytes_per_push": per_push,
        "most_sent_by_a_rank": per_push if layout == "shared" else per_push / len(ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for layout in LAYOUTS:
                row = run(layout, args.iterations, Path(scratch) / f"{layout.replace(' ', '_')}_{repeat}")
                rows[layout].append(row)
                push = ", ".join(f"{s * 1e3:.1f}" for s in row["push_s"])
                print(
                    f"repeat {repeat} {layout:>8}: push ms per rank [{push}], iteration {row['iteration_s']:.3f} s, "
                    f"{row['bytes_per_push'] / 1e6:.2f} MB loaded per push, "
                    f"{row['most_sent_by_a_rank'] / 1e6:.2f} MB sent by the busiest rank",
                    flush=True,
                )

    def median(layout: str, key: str, rank: int | None = None) -> float:
        return statistics.median(row[key][rank] if rank is not None else row[key] for row in rows[layout])

    print(f"\nmedians over {args.repeats} repeats, {args.iterations} iterations each (ratio: shared / per rank)")
    for label, key, rank in [
        ("push, rank 0 (s)", "push_s", 0),
        ("push, rank 1 (s)", "push_s", 1),
        ("iteration (s)", "iteration_s", None),
        ("bytes loaded per push", "bytes_per_push", None),
        ("bytes sent by the busiest rank", "most_sent_by_a_rank", None),
    ]:
        shared, per_rank = median("shared", key, rank), median("per rank", key, rank)
        print(f"{label:>32}: shared {shared:12.4g}   per rank {per_rank:12.4g}   ratio {shared / per_rank:.2f}x")


if __name__ == "__main__":
    main()
