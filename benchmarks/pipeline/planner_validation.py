"""The capacity planner against measurements: one short profile per model, predictions for configurations it
did not see, each then run and measured. Prints predicted against measured side by side, writes the rows as
JSON and draws docs/planner_validation.png.

For each model the profile is ``lit-parl`` at the default shape (32 prompts x 8, micro-batches of 64, one
worker of one thread, the trainer on the other core; lending as the CPU default decides). Each validation run
changes one thing: prompts per iteration, micro-batch size, the worker count, lending, or the model. A run's
iteration time is the median, over its iterations after ``--warmup``, of the time from one weight sync's start
to the next one's; the planner predicts the same span (``lit_parl.planner.pipeline_model.simulate``).

    .venv/bin/python benchmarks/pipeline/planner_validation.py --json benchmarks/logs/planner_validation.json

``--modes`` validates the choice of mode and chunking instead: four profiles of the default model (async and
sync, each at chunks of 8 prompts with micro-batches of 64 and at chunks of 16 with micro-batches of 128),
from which the planner fits each mode's fixed costs per call (``fit_fixed_costs``); then configurations of
both modes at chunkings it did not see, and whether the fastest it predicts is the fastest measured.
``--modes smollm2`` does the same on SmolLM2-135M-Instruct (the ``smollm2_reverse`` recipe, 16 prompts x 8).

    .venv/bin/python benchmarks/pipeline/planner_validation.py --modes --json benchmarks/logs/planner_modes.json
    .venv/bin/python benchmarks/pipeline/planner_validation.py --modes smollm2 --warmup 2
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

from lit_parl.planner.phase_costs import measure_costs, measure_modes  # noqa: E402
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

# --modes: per job, its iterations, its profiles and the configurations predicted from them, each as (mode,
# prompts per chunk, micro-batch size)
MODE_JOBS = {
    "h128": (
        60,
        [("async", 8, 64), ("async", 16, 128), ("sync", 8, 64), ("sync", 16, 128)],
        [
            ("async", 4, 32),
            ("async", 32, 128),
            ("async", 32, 256),
            ("sync", 4, 32),
            ("sync", 32, 128),
            ("sync", 32, 256),
        ],
    ),
    "smollm2": (
        10,
        [("async", 4, 32), ("async", 8, 64), ("sync", 4, 32), ("sync", 8, 64)],
        [("async", 16, 64), ("sync", 16, 64), ("sync", 16, 128)],
    ),
}
SMOLLM2 = ["+experiment=smollm2_reverse", "datamodule.evaluation.every_n_iterations=0"]


def chunking(mode: str, chunk: int, micro: int) -> tuple[str, list[str]]:
    """A configuration's label and overrides."""
    overrides = [f"datamodule.mode={mode}", f"pool.prompts_per_request={chunk}", f"shape.micro_batch_size={micro}"]
    return f"{mode} c{chunk} m{micro}", overrides


def iteration_times(run_dir: Path, warmup: int) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    starts = [it["sync"][0][0] for it in lines if it["sync"]]
    return [later - earlier for earlier, later in zip(starts, starts[1:])][warmup:]


def run(model_dir: Path | None, run_dir: Path, iterations: int, overrides: list[str]) -> None:
    """``lit-parl`` on the model saved in ``model_dir``; ``None``: SmolLM2's recipe."""
    model = SMOLLM2 if model_dir is None else ["model=pretrained", f"model.path={model_dir}"]
    cmd = [str(ROOT / ".venv" / "bin" / "lit-parl"), f"iterations={iterations}", *model]
    cmd += [f"run_dir={run_dir}", "checkpoint_every=0", "trainer.max_time=null", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=dict(os.environ))


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=str(ROOT / "docs" / "planner_validation.png"))
    p.add_argument("--modes", nargs="?", const="h128", choices=list(MODE_JOBS), help="validate the mode and chunking")
    args = p.parse_args(argv)
    import vs_trl

    with tempfile.TemporaryDirectory(prefix="lit_parl_planner_") as work:
        work = Path(work)
        if args.modes:
            rows, profiles = mode_rows(work, args.warmup, vs_trl, args.modes)
        else:
            rows, profiles = split_rows(work, args.warmup, vs_trl)
    errors = [abs(r["error"]) for r in rows if not r.get("profiled")]
    print("\n| model | configuration | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|")
    for r in rows:
        label = r["configuration"] + (" (profiled)" if r.get("profiled") else "")
        cells = [r["model"], label, f"{r['predicted_ms']:.1f}", f"{r['measured_ms']:.1f}", f"{r['error']:+.1%}"]
        print("| " + " | ".join(cells) + " |")
    unseen = len(errors)
    print(f"\nmedian |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} over {unseen} configurations")
    if args.modes:
        fastest = {k: min(rows, key=lambda r: r[k])["configuration"] for k in ("predicted_ms", "measured_ms")}
        print(f"fastest predicted: {fastest['predicted_ms']}; fastest measured: {fastest['measured_ms']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "profiles": profiles}, indent=1))
    if not args.modes:
        plot(rows, Path(args.plot))
    return rows


def row(model: str, label: str, overrides: list[str], predicted: float, run_dir: Path, warmup: int) -> dict:
    measured = statistics.median(iteration_times(run_dir, warmup))
    found = {
        "model": model,
        "configuration": label,
        "overrides": overrides,
        "predicted_ms": round(predicted * 1e3, 2),
        "measured_ms": round(measured * 1e3, 2),
        "error": round(predicted / measured - 1, 4),
    }
    print(json.dumps(found), flush=True)
    return found


def split_rows(work: Path, warmup: int, vs_trl) -> tuple[list[dict], dict]:
    """One profile per model; each validation run changes one thing from it."""
    costs, rows = {}, []
    for name, iterations in MODELS.items():
        vs_trl.save_model(work / name, name, seed=0)
        run(work / name, work / f"{name}_profile", iterations, [])
        costs[name] = measure_costs(work / f"{name}_profile", warmup)
        print(f"{name} profile: {costs[name]}", flush=True)
    for name, label, overrides, plan in VALIDATION:
        run_dir = work / f"{name}_{label.replace(' ', '_')}"
        run(work / name, run_dir, MODELS[name], overrides)
        predicted = simulate(costs[name], plan, os.cpu_count() or 1).iteration_s
        rows.append(row(name, label, overrides, predicted, run_dir, warmup))
    return rows, {k: vars(v) for k, v in costs.items()}


def mode_rows(work: Path, warmup: int, vs_trl, name: str) -> tuple[list[dict], dict]:
    """A job's four profiles, each mode's fixed costs fitted from two; then chunkings unseen."""
    cores, (iterations, profiled, unseen) = os.cpu_count() or 1, MODE_JOBS[name]
    model_dir = None if name == "smollm2" else work / name
    if model_dir is not None:
        vs_trl.save_model(model_dir, name, seed=0)
    runs = {}
    for configuration in profiled + unseen:
        label, overrides = chunking(*configuration)
        runs[configuration] = work / label.replace(" ", "_")
        run(model_dir, runs[configuration], iterations, overrides)
    profiles = [str(runs[configuration]) for configuration in profiled]
    fitted = {costs.mode: costs for costs in measure_modes(profiles, warmup, cores)}
    print(f"fitted: {fitted}", flush=True)
    rows = []
    for configuration, run_dir in runs.items():  # the profiles too: how the fitted costs play their shapes back
        mode, chunk, micro = configuration
        plan = Plan(prompts_per_request=chunk, micro_batch_size=micro)  # lending as the profile ran
        predicted = simulate(fitted[mode], plan, cores).iteration_s
        label, overrides = chunking(*configuration)
        rows.append({**row(name, label, overrides, predicted, run_dir, warmup), "profiled": configuration in profiled})
    return rows, {k: vars(v) for k, v in fitted.items()}


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
