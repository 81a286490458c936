"""Soak: the default job for many iterations, watching every process for growth.

Runs the default job (``lit-parl`` as ``make train`` runs it; the only overrides are ``iterations``,
``run_dir`` in a temporary folder, and ``trainer.max_time=null`` so that a loaded machine does not end it
early) in this process through the CLI's own path (``lit_parl.cli.run`` on the composed
``conf/config.yaml``), with one more callback, ``ResourceProbe``, added as a config node the way a user
adds one (``callbacks.soak``). Every ``--every`` iterations (and after the first) it records, for the
trainer and for each rollout worker:

- resident memory (``VmRSS``, and its anonymous and shared-memory parts) from ``/proc/PID/status``;
- open file descriptors (``/proc/PID/fd``) and OS threads (``Threads`` in ``/proc/PID/status``);
- for the trainer also: Python threads (``threading.active_count()``), objects tracked by the garbage
  collector, and live descendant processes.

Workers are labelled by index (``worker0``, ...), not pid, so a worker restarted by the pool keeps its
label; a change of pid is reported. Rows go to ``soak.csv`` as they are taken (a crash keeps them).
At the end a table gives, per process and measure, the value after warm-up (the first sample at
``--every``), the last value, and the least-squares slope per 100 iterations over iterations >= 100,
flagged when it is not ~0: RSS above 1 MiB per 100 iterations, any rise of file descriptors, threads,
Python threads or descendants. ``retained.txt`` lists what the run holds one entry per iteration of
(lists and dicts of the datamodule, the module and the callbacks), with their size.

Usage::

    nice -n 5 .venv/bin/python benchmarks/pipeline/soak.py                      # 1,000 iterations
    .venv/bin/python benchmarks/pipeline/soak.py --iterations 300 --tracemalloc  # + the trainer's allocation growth
    .venv/bin/python benchmarks/pipeline/soak.py --table benchmarks/logs/soak-DATE/soak.csv   # the table again
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import deque
from dataclasses import is_dataclass
from pathlib import Path

from lightning.pytorch.callbacks import Callback

# the console script imports the CLI at top level, and spawned workers import the main script again:
# importing it here too keeps the workers' baseline memory that of `lit-parl`
from lit_parl import cli
from lit_parl.rollout.processes import descendants

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "iteration",
    "process",
    "pid",
    "rss_mib",
    "rss_anon_mib",
    "rss_shmem_mib",
    "fds",
    "threads",
    "py_threads",
    "gc_objects",
    "children",
)
RSS_MIB_PER_100 = 1.0  # flag threshold for the RSS measures; the counts are flagged on any rise


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS``/``RssAnon``/``RssShmem`` (KiB) and ``Threads`` of a process, from ``/proc/PID/status``."""
    wanted = {"VmRSS", "RssAnon", "RssShmem", "Threads"}
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in wanted:
                out[key] = int(value.split()[0])
    return out


def sample(pid: int) -> dict:
    """One process's resident memory (MiB), open file descriptors and OS threads."""
    status = proc_status(pid)
    return {
        "pid": pid,
        "rss_mib": round(status["VmRSS"] / 1024, 2),
        "rss_anon_mib": round(status.get("RssAnon", 0) / 1024, 2),
        "rss_shmem_mib": round(status.get("RssShmem", 0) / 1024, 2),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": status["Threads"],
    }


def deep_size(obj, seen: set[int]) -> int:
    """Bytes of ``obj`` and of the containers and dataclasses it holds, each object counted once."""
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset, deque)):
        children = obj
    elif is_dataclass(obj) and not isinstance(obj, type):
        children = vars(obj).values()
    else:
        children = ()
    return sys.getsizeof(obj) + sum(deep_size(child, seen) for child in children)


def retained_records(trainer, iterations: int) -> list[tuple[str, int, int]]:
    """``(owner.attribute, length, bytes)`` of every list/dict/deque of the datamodule, the module and the
    callbacks that holds at least one entry per two iterations: what a run keeps per iteration."""
    found = []
    for owner in (trainer.datamodule, trainer.lightning_module, *trainer.callbacks):
        for name, value in vars(owner).items():
            if isinstance(value, (list, dict, deque)) and len(value) >= max(iterations // 2, 2):
                found.append((f"{type(owner).__name__}.{name}", len(value), deep_size(value, set())))
    return found


class ResourceProbe(Callback):
    """Every ``every`` iterations (and after the first), one CSV row per process: trainer and each worker.

    Args:
        csv_path: where the rows go (written and flushed as they are taken).
        every: iterations between samples.
        trace_from: with ``tracemalloc`` on, the iteration of the baseline snapshot; the growth of the
            trainer's Python allocations since then is written beside the CSV at the end.
    """

    def __init__(self, csv_path: str, every: int = 50, trace_from: int = 100) -> None:
        self.csv_path, self.every, self.trace_from = Path(csv_path), every, trace_from
        self._file = None
        self._writer = None
        self._pids: dict[str, int] = {}  # label -> last pid seen
        self._baseline = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.csv_path, "w", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=FIELDS)
        self._writer.writeheader()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        iteration = trainer.current_epoch + 1  # one Lightning epoch is one RL iteration
        if iteration != 1 and iteration % self.every:
            return
        trainer_row = sample(os.getpid()) | {
            "process": "trainer",
            "py_threads": threading.active_count(),
            "gc_objects": len(gc.get_objects()),
            "children": len(descendants([os.getpid()])),
        }
        rows = [trainer_row]
        for index, pid in enumerate(trainer.datamodule.pool.health().details.get("pids", [])):
            label = f"worker{index}"
            if pid is None:  # between a worker's death and its restart
                continue
            if self._pids.get(label, pid) != pid:
                print(
                    f"soak: {label} changed pid {self._pids[label]} -> {pid} before iteration {iteration}",
                    file=sys.stderr,
                )
            self._pids[label] = pid
            try:
                rows.append(sample(pid) | {"process": label})
            except (FileNotFoundError, ProcessLookupError):
                print(f"soak: {label} (pid {pid}) gone at iteration {iteration}", file=sys.stderr)
        for row in rows:
            self._writer.writerow({"iteration": iteration} | row)
        self._file.flush()
        if tracemalloc.is_tracing() and iteration == self.trace_from:
            self._baseline = tracemalloc.take_snapshot()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._file is not None:
            self._file.close()
        retained = retained_records(trainer, trainer.current_epoch + 1)
        lines = [
            f"{name}: {length} entries, {size / 1024:.1f} KiB, "
            f"{size / max(trainer.current_epoch + 1, 1):.0f} B per iteration"
            for name, length, size in retained
        ]
        self.csv_path.with_name("retained.txt").write_text("".join(f"{line}\n" for line in lines))
        print("soak: per-iteration records the run holds at its end:\n  " + "\n  ".join(lines or ["none"]))
        if self._baseline is not None:
            growth = tracemalloc.take_snapshot().compare_to(self._baseline, "lineno")
            path = self.csv_path.with_name("tracemalloc_growth.txt")
            path.write_text("".join(f"{stat}\n".replace(f"{ROOT}/", "") for stat in growth[:40]))
            print(f"soak: the trainer's 40 largest Python allocation changes since iteration {self.trace_from}: {path}")


def slope_per_100(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(iteration, value)`` points, per 100 iterations."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx


def table(csv_path: Path, warm_up: int = 50, fit_from: int = 100) -> str:
    """Per process and measure: the value at ``warm_up``, the last value, and the slope from ``fit_from``."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    lines = [f"{'process':9s} {'measure':13s} {f'it {warm_up}':>9s} {'last':>9s} {'slope/100 it':>13s}  flag"]
    for process in dict.fromkeys(r["process"] for r in rows):
        mine = [r for r in rows if r["process"] == process]
        pids = list(dict.fromkeys(r["pid"] for r in mine))
        if len(pids) > 1:  # a restarted worker: fit its current process only
            lines.append(f"{process}: pid changed {' -> '.join(pids)}; the slope covers the last pid only")
            mine = [r for r in mine if r["pid"] == pids[-1]]
        for measure in FIELDS[3:]:
            if mine[0][measure] == "":
                continue
            points = [(int(r["iteration"]), float(r[measure])) for r in mine if int(r["iteration"]) >= fit_from]
            at_warm_up = next((float(r[measure]) for r in mine if int(r["iteration"]) == warm_up), float("nan"))
            slope = slope_per_100(points)
            if measure == "gc_objects":
                flag = ""  # informational: allocation churn moves it; the RSS and tracemalloc tell the growth
            elif measure.endswith("_mib"):
                flag = "GROWS" if slope > RSS_MIB_PER_100 else ""
            else:
                flag = "GROWS" if slope > 0 else ""
            last = mine[-1]
            lines.append(
                f"{process:9s} {measure:13s} {at_warm_up:9.1f} {float(last[measure]):9.1f} {slope:13.3f}  {flag}"
                + ("" if measure != "rss_mib" else f"   (last = it {last['iteration']})")
            )
    return "\n".join(lines)


def run(iterations: int, every: int, out: Path, run_dir: Path, trace: bool, overrides: list[str]) -> dict:
    """Compose the default config, add the probe as ``callbacks.soak``, and run it as the CLI does."""
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
        # no wall-time cap: the default's 4 min 30 s would end a soak on a loaded machine early
        cfg = compose(
            "config", overrides=[f"iterations={iterations}", "trainer.max_time=null", f"run_dir={run_dir}", *overrides]
        )
    with open_dict(cfg):
        cfg.callbacks.soak = {
            "_target_": f"{ResourceProbe.__module__}.ResourceProbe",
            "csv_path": str(out / "soak.csv"),
            "every": every,
        }
    if trace:
        tracemalloc.start(8)
    return cli.run(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50, help="iterations between samples")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: benchmarks/logs/soak-<date>)")
    parser.add_argument("--tracemalloc", action="store_true", help="trace the trainer's Python allocations (slow)")
    parser.add_argument("--table", type=Path, default=None, help="only print the table of an existing soak.csv")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (none for the soak of the default job)")
    args = parser.parse_args()
    if args.table is not None:
        print(table(args.table, warm_up=args.every))
        return
    out = args.out or ROOT / "benchmarks" / "logs" / f"soak-{time.strftime('%Y-%m-%d_%H-%M-%S')}"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="soak-run-") as run_dir:
        start = time.monotonic()
        summary = run(args.iterations, args.every, out, Path(run_dir), args.tracemalloc, args.overrides)
        print(
            f"soak: {summary.get('iterations')} iterations in {time.monotonic() - start:.0f} s; "
            f"rows in {out / 'soak.csv'}"
        )
    report = table(out / "soak.csv", warm_up=args.every)
    (out / "table.txt").write_text(report + "\n")
    print(report)


if __name__ == "__main__":
    main()
