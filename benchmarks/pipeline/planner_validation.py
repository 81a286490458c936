"""The capacity planner against measurements: one short profile per model, predictions for configurations it
did not see, each then run and measured. Prints predicted against measured side by side, writes the rows as
JSON and draws docs/planner_validation.png.

For each model the profile is ``lit-parl`` at the default shape (32 prompts x 8, micro-batches of 64, one
worker of one thread, the trainer on the other core; lending as the CPU default decides). Each validation run
changes one thing: prompts per iteration, micro-batch size, the worker count, lending, or the model. A run's
iteration time is the median, over its iterations after ``--warmup``, of the time from one weight sync's start
to the next one's; the planner predicts the same span (``lit_parl.planner.pipeline_model.simulate``).

    .venv/bin/python benchmarks/pipeline/planner_validation.py --json benchmarks/logs/planner_validation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "vs_trl"))

from lit_parl.planner.phase_costs import measure_costs  # noqa: E402
from lit_parl.planner.pipeline_model import Plan, simulate  # noqa: E402

# the models of benchmarks/vs_trl (h128 is the default job's) and the iterations of each run
MODELS = {"h128": 60, "h256x4": 30, "h64": 60}
# (model, label, overrides, the Plan that describes them)
VALIDATION = [
    ("h128", "64 prompts", ["shape.prompts=64"], Plan(prompts=64)),
    ("h128", "128 prompts", ["shape.prompts=128"], Plan(prompts=128)),
    ("h128", "16 prompts", ["shape.prompts=16"], Plan(prompts=16)),
    ("h128", "micro-batch 32", ["shape.micro_batch_size=32"], Plan(micro_batch_size=32)),
    ("h128", "2 workers", ["pool.num_workers=2"], Plan(workers=2)),
    ("h256x4", "64 prompts", ["shape.prompts=64"], Plan(prompts=64, lend=True)),
    ("h256x4", "micro-batch 32", ["shape.micro_batch_size=32"], Plan(micro_batch_size=32, lend=True)),
    # the prefetch thread kept on, as lending turned it on in the profile: one change
    ("h256x4", "lending off", ["datamodule.lend_cores=false", "datamodule.prefetch=true"], Plan(lend=False)),
    ("h256x4", "2 workers", ["pool.num_workers=2"], Plan(workers=2, lend=True)),
    ("h64", "128 prompts", ["shape.prompts=128"], Plan(prompts=128)),
]


def iteration_times(run_dir: Path, warmup: int) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    starts = [it["sync"][0][0] for it in lines if it["sync"]]
    return [later - earlier for earlier, later in zip(starts, starts[1:])][warmup:]


def run(model_dir: Path, run_dir: Path, iterations: int, overrides: list[str]) -> None:
    cmd = [str(ROOT / ".venv" / "bin" / "lit-parl"), f"iterations={iterations}", "model=pretrained"]
    cmd += [f"model.path={model_dir}", f"run_dir={run_dir}", "checkpoint_every=0", "trainer.max_time=null", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=str(ROOT / "docs" / "planner_validation.png"))
    args = p.parse_args(argv)
    import vs_trl

    rows = []
    with tempfile.TemporaryDirectory(prefix="lit_parl_planner_") as work:
        work = Path(work)
        costs = {}
        for name, iterations in MODELS.items():
            vs_trl.save_model(work / name, name, seed=0)
            run(work / name, work / f"{name}_profile", iterations, [])
            costs[name] = measure_costs(work / f"{name}_profile", args.warmup)
            print(f"{name} profile: {costs[name]}", flush=True)
        for name, label, overrides, plan in VALIDATION:
            run_dir = work / f"{name}_{label.replace(' ', '_')}"
            run(work / name, run_dir, MODELS[name], overrides)
            measured = statistics.median(iteration_times(run_dir, args.warmup))
            predicted = simulate(costs[name], plan, os.cpu_count() or 1).iteration_s
            row = {
                "model": name,
                "configuration": label,
                "overrides": overrides,
                "predicted_ms": round(predicted * 1e3, 2),
                "measured_ms": round(measured * 1e3, 2),
                "error": round(predicted / measured - 1, 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    errors = [abs(r["error"]) for r in rows]
    print("\n| model | configuration (one change from the profile) | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [
            r["model"],
            r["configuration"],
            f"{r['predicted_ms']:.1f}",
            f"{r['measured_ms']:.1f}",
            f"{r['error']:+.1%}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(f"\nmedian |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {len(rows)} configurations")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"rows": rows, "profiles": {k: vars(v) for k, v in costs.items()}}, indent=1)
        )
    plot(rows, Path(args.plot))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for model, marker in zip(MODELS, "os^"):
        mine = [r for r in rows if r["model"] == model]
        ax.scatter([r["measured_ms"] for r in mine], [r["predicted_ms"] for r in mine], marker=marker, label=model)
    values = [r[k] for r in rows for k in ("measured_ms", "predicted_ms")]
    low, top = min(values) * 0.8, max(values) * 1.2
    ax.plot([low, top], [low, top], color="grey", linewidth=1, label="predicted = measured")
    ax.fill_between([low, top], [0.9 * low, 0.9 * top], [1.1 * low, 1.1 * top], color="grey", alpha=0.15, label="±10%")
    ax.set_xlabel("measured iteration, ms")
    ax.set_ylabel("predicted iteration, ms")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("lit-parl-plan: configurations it did not see")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
