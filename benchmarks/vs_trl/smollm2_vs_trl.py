"""SmolLM2-135M-Instruct: lit_parl against TRL's ``GRPOTrainer`` on two recipes (issue 41, item 1).

Both sides load one model directory (SmolLM2-135M-Instruct converted once from its GGUF file and saved with
``save_pretrained``: ``model=smollm2``'s cache, ``--model-dir``) and train one of two tasks (``--task``), every
prompt through the chat template with the task's system prompt (lit_parl's ``PromptFormat`` renders the TRL side's
prompt text too, so both sample from the same tokens):

- ``reverse`` (``conf/experiment/smollm2_reverse.yaml``): reverse 2-4 digits, at most 8 new tokens, the positional
  reward on token ids;
- ``math`` (``data=gsm8k_format`` on a file of two-number sums this script writes, ``reward=math``): at most 16 new
  tokens, math-verify on the reply's last ``\\boxed{}``, else its ``#### x``, else its last number, both sides
  drawing the rows in lit_parl's order. It needs math-verify on both sides: ``pip install -e '.[math]'`` in
  ``.venv`` (``make test`` installs it with the dev extra; ``setup_trl_env.sh`` in ``.venv-trl``).

Both: 16 prompts x G = 8 per step, temperature 1, GRPO (clip 0.2, beta 0, group-scaled advantages, per-sequence
token mean), AdamW at lr 1e-5, gradient clip 1.0, one optimizer step per iteration, float32, the machine's 2
cores, no evaluation on either side, OpenMP as ``vs_trl.py`` sets it for both (``OMP_WAIT_POLICY=PASSIVE``,
``GOMP_SPINCOUNT=100000``).

- lit_parl at the planner's choice for the reverse recipe here (docs/planner.md: sync, the iteration in one chunk
  and one micro-batch, each phase on both cores; the math task runs the same): ``datamodule.mode=sync
  pool.prompts_per_request=16 shape.micro_batch_size=128`` (``--lit-overrides`` to change);
- TRL in its layouts ``--trl-configs`` (default ``128x1``: the step's 128 completions in one batch, and ``64x2``).

Per run: completions/s and tokens/s over the training loop, the per-step rewards, and for lit_parl where its time
went (generation and training, from its summary). Seeds interleaved. Prints a table and writes JSON (``--out``).

    .venv/bin/python benchmarks/vs_trl/smollm2_vs_trl.py --steps 8 --seeds 0 1 2 --trl-configs 128x1 \
        --out smollm2_vs_trl.json --plot docs/smollm2_vs_trl.png
    .venv/bin/python benchmarks/vs_trl/smollm2_vs_trl.py --task math --steps 6 --seeds 0 1 2 --trl-configs 64x2
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from vs_trl import last_share, run_logged  # noqa: E402

ROOT = BENCH.parents[1]
PROMPTS, GROUP, LR = 16, 8, 1e-5


@dataclass(frozen=True)
class Task:
    """One workload of the comparison: lit_parl's recipe and data, TRL's task, and what they share."""

    lit_parl: tuple[str, ...]  # lit-parl overrides (the recipe, its data)
    trl: tuple[str, ...]  # trl_side.py arguments (its task)
    system_prompt: str
    max_new_tokens: int


def reverse_task(work: Path) -> Task:
    """``smollm2_reverse``: reverse 2-4 digits, the positional reward on token ids."""
    system = "Reverse the digits before the '=' sign. Reply with the reversed digits only."
    return Task(("+experiment=smollm2_reverse",), ("--task=reverse",), system, 8)


def math_task(work: Path, rows: int = 512) -> Task:
    """Two-number sums from a file written here (``data=gsm8k_format``'s columns, the answer a bare number), scored
    by ``reward=math`` with its last-number fallback: math-verify on the reply's ``#### x``, else its last number
    (in a probe of 64-96 first replies here SmolLM2-135M never wrote ``####``, even shown an example, so the strict
    GSM8K reward gives no signal; with the fallback 3-5% of them were right). Both sides draw the rows in lit_parl's
    order for the seed (``PromptSchedule``)."""
    path = work / "sums.jsonl"
    pick = random.Random(1234)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = pick.randint(10, 99), pick.randint(10, 99)
            f.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    system = "Add the two numbers. Reply with #### and the sum, nothing else. Example: What is 12 + 30? #### 42"
    reward = "{_target_:lit_parl.rewards.math_answers.math_reward,_partial_:true,fallback_last_number:true}"
    overrides = ("data=gsm8k_format", f"data.path={path}", "data.eval_rows=0", "reward=math")
    overrides += (f"reward.math.fn={reward}",)
    return Task(overrides, ("--task=math", f"--data-file={path}"), system, 16)


TASKS = {"reverse": reverse_task, "math": math_task}
LIT_BEST = "datamodule.mode=sync pool.prompts_per_request=16 shape.micro_batch_size=128"
OMP = ("PASSIVE", "100000")


def hydra_quoted(text: str) -> str:
    """``text`` as one quoted Hydra override value (its quotes, '=' and ':' taken literally)."""
    return "'" + text.replace("'", "\\'") + "'"


def lit_parl_side(args, task: Task, seed: int, run_dir: Path) -> dict:
    cmd = [
        str(ROOT / ".venv" / "bin" / "lit-parl"),
        *task.lit_parl,
        "model=pretrained",
        f"model.path={args.model_dir}",
        f"seed={seed}",
        f"iterations={args.steps}",
        f"run_dir={run_dir}",
        "checkpoint_every=0",
        "trainer.max_time=null",
        "callbacks.progress.refresh_rate=0",
        "datamodule.evaluation.every_n_iterations=0",
        "datamodule.evaluation.at_end=false",
        # spelled out, though the recipe sets them: what the TRL side is given
        f"shape.prompts={PROMPTS}",
        f"shape.group_size={GROUP}",
        f"sampling.max_new_tokens={task.max_new_tokens}",
        "sampling.temperature=1.0",
        "datamodule.prompt_format.chat=true",
        f"datamodule.prompt_format.system_prompt={hydra_quoted(task.system_prompt)}",
        f"optimizer.lr={LR}",
        *args.lit_overrides.split(),
    ]
    run_logged(cmd, run_dir.with_suffix(".log"), *OMP)
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv") as f:
        rows = [(int(r["epoch"]), float(r["reward"])) for r in csv.DictReader(f) if r.get("reward") not in (None, "")]
    rewards = [reward for _, reward in sorted(rows)]
    if len(rewards) != args.steps:
        raise RuntimeError(f"lit_parl logged {len(rewards)} iterations' rewards, expected {args.steps}")
    return {
        "side": "lit_parl",
        "completions_per_s": summary["completions_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "wall_s": summary["wall_s"],
        "gen_busy_s": summary["gen_busy_s"],
        "train_busy_s": summary["train_busy_s"],
        "rewards": rewards,
    }


def trl_side(args, task: Task, seed: int, layout: str, out: Path) -> dict:
    batch, accum = (int(n) for n in layout.split("x"))
    if batch * accum != PROMPTS * GROUP:
        raise ValueError(f"--trl-configs {layout}: batch x accumulation must be {PROMPTS * GROUP}")
    cmd = [
        str(ROOT / ".venv-trl" / "bin" / "python"),
        str(BENCH / "trl_side.py"),
        f"--model-dir={args.model_dir}",
        *task.trl,
        f"--system-prompt={task.system_prompt}",
        f"--steps={args.steps}",
        f"--seed={seed}",
        f"--prompts-per-step={PROMPTS}",
        f"--group-size={GROUP}",
        f"--batch-size={batch}",
        f"--grad-accum={accum}",
        f"--max-new-tokens={task.max_new_tokens}",
        f"--lr={LR}",
        "--beta=0.0",
        "--threads=2",
        f"--out={out}",
    ]
    run_logged(cmd, out.with_suffix(".log"), *OMP)
    result = json.loads(out.read_text())
    return {
        "side": f"trl_{layout}",
        "completions_per_s": result["completions_per_s"],
        "tokens_per_s": result["tokens_per_s"],
        "wall_s": result["wall_s"],
        "gen_busy_s": result.get("generate_s"),
        "train_busy_s": None,  # the rest of its loop: training, scoring, TRL's own work
        "rewards": result["rewards"],
    }


def plot(runs: dict[str, list[dict]], path: Path, task: str) -> None:
    """Per-step rewards, one line per side and seed, each side in one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for (side, rs), colour in zip(runs.items(), ("tab:blue", "tab:orange", "tab:green")):
        for i, r in enumerate(rs):
            steps = range(1, len(r["rewards"]) + 1)
            axis.plot(steps, r["rewards"], color=colour, alpha=0.75, label=side if i == 0 else None)
    axis.set(xlabel="optimizer step (iteration)", ylabel="mean reward of the step's samples")
    axis.set_title(f"SmolLM2-135M-Instruct, task {task}: lit_parl and TRL, one line per seed")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: model=smollm2's converted directory")
    parser.add_argument("--task", choices=sorted(TASKS), default="reverse")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trl-configs", nargs="+", default=["128x1", "64x2"])
    parser.add_argument("--lit-overrides", default=LIT_BEST)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="the reward curves as a PNG")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="report and plot earlier --out files (of one --task, given too) instead of running, their seeds merged",
    )
    args = parser.parse_args()
    if args.from_json is not None:
        runs: dict[str, list[dict]] = {}
        for path in args.from_json:
            for side, rs in json.loads(path.read_text()).items():
                runs.setdefault(side, []).extend(rs)
        report(runs, args.task)
        if args.plot:
            plot(runs, args.plot, args.task)
        return
    if args.model_dir is None:
        from lit_parl.models.local_files import cache_root

        args.model_dir = next((cache_root() / "gguf").glob("SmolLM2-135M-Instruct*"))
    runs = {}
    with tempfile.TemporaryDirectory(prefix="smollm2_vs_trl_") as work:
        task = TASKS[args.task](Path(work))
        for seed in args.seeds:
            found = [lit_parl_side(args, task, seed, Path(work) / f"lit_parl_{seed}")]
            for layout in args.trl_configs:
                found.append(trl_side(args, task, seed, layout, Path(work) / f"trl_{layout}_{seed}.json"))
            for run in found:
                runs.setdefault(run["side"], []).append(run | {"seed": seed})
                shown = {k: v for k, v in run.items() if k != "rewards"}
                print(f"seed {seed}: {json.dumps(shown)} rewards {[round(r, 3) for r in run['rewards']]}", flush=True)
    report(runs, args.task)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    if args.plot:
        plot(runs, args.plot, args.task)


def report(runs: dict[str, list[dict]], task: str) -> None:
    """Speed per side and seed, the ratios run by run, and the reward curves compared seed by seed."""
    steps = len(runs["lit_parl"][0]["rewards"])
    seeds = [r["seed"] for r in runs["lit_parl"]]
    print(f"\nSmolLM2-135M-Instruct, task {task}, {steps} steps, seeds {seeds}\n")
    print("| side | completions/s (seeds) | tokens/s (median) | reward, first step (mean) | reward, last 10% (mean) |")
    print("|---|---|---|---|---|")
    for side, rs in runs.items():
        rates = " ".join(f"{r['completions_per_s']:.2f}" for r in rs)
        tokens = statistics.median(r["tokens_per_s"] for r in rs)
        first = statistics.mean(r["rewards"][0] for r in rs)
        last = statistics.mean(last_share(r["rewards"]) for r in rs)
        print(f"| {side} | {rates} | {tokens:.1f} | {first:.3f} | {last:.3f} |")
    lit = {r["seed"]: r for r in runs["lit_parl"]}
    for side in (s for s in runs if s != "lit_parl"):
        ratios = [lit[t["seed"]]["completions_per_s"] / t["completions_per_s"] for t in runs[side] if t["seed"] in lit]
        print(f"lit_parl / {side}: " + " ".join(f"{r:.2f}x" for r in ratios))
    # the curves: TRL's layouts train the same samples to the same rewards (seen step for step), so one TRL run a seed
    trl = {r["seed"]: r for side, rs in runs.items() if side != "lit_parl" for r in rs}
    paired = [s for s in seeds if s in trl]
    print("\nmean reward per step over seeds " + " ".join(map(str, paired)) + " (lit_parl, TRL):")
    for step in range(steps):
        a = [lit[s]["rewards"][step] for s in paired]
        b = [trl[s]["rewards"][step] for s in paired]
        print(f"  step {step + 1}: {statistics.mean(a):.3f} {statistics.mean(b):.3f}")
    tail = max(1, steps // 3)
    gaps = [statistics.mean(lit[s]["rewards"][-tail:]) - statistics.mean(trl[s]["rewards"][-tail:]) for s in paired]
    spread = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
    print(
        f"last {tail} steps, lit_parl - TRL per seed: {' '.join(f'{g:+.3f}' for g in gaps)}; "
        f"mean {statistics.mean(gaps):+.3f} +- {spread:.3f} (standard error over seeds)"
    )


if __name__ == "__main__":
    main()
