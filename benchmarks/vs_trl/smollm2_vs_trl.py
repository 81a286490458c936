"""SmolLM2-135M-Instruct: lit_parl against TRL's ``GRPOTrainer`` on the ``smollm2_reverse`` recipe (issue 41, item 1).

Both sides load one model directory (SmolLM2-135M-Instruct converted once from its GGUF file and saved with
``save_pretrained``: ``model=smollm2``'s cache, ``--model-dir``) and train the recipe
(``conf/experiment/smollm2_reverse.yaml``): reverse 2-4 digits, every prompt through the chat template with the
recipe's system prompt (lit_parl's ``PromptFormat`` renders the TRL side's prompt text too, so both sample from the
same tokens), 16 prompts x G = 8 per step, at most 8 new tokens, temperature 1, the positional reward on token ids,
GRPO (clip 0.2, beta 0, group-scaled advantages, per-sequence token mean), AdamW at lr 1e-5, gradient clip 1.0, one
optimizer step per iteration, float32, the machine's 2 cores, no evaluation on either side, OpenMP as
``vs_trl.py`` sets it for both (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=100000``).

- lit_parl at the planner's choice for this recipe here (docs/planner.md: sync, the iteration in one chunk and one
  micro-batch, each phase on both cores): ``datamodule.mode=sync pool.prompts_per_request=16
  shape.micro_batch_size=128`` (``--lit-overrides`` to change);
- TRL in its layouts ``--trl-configs`` (default ``128x1``: the step's 128 completions in one batch, and ``64x2``).

Per run: completions/s and tokens/s over the training loop, the per-step rewards, and for lit_parl where its time
went (generation and training, from its summary). Seeds interleaved. Prints a table and writes JSON (``--out``).

    .venv/bin/python benchmarks/vs_trl/smollm2_vs_trl.py --steps 8 --seeds 0 1 2 --trl-configs 128x1 \
        --out smollm2_vs_trl.json --plot docs/smollm2_vs_trl.png
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from vs_trl import last_share, run_logged  # noqa: E402

ROOT = BENCH.parents[1]
SYSTEM_PROMPT = "Reverse the digits before the '=' sign. Reply with the reversed digits only."
PROMPTS, GROUP, MAX_NEW_TOKENS, LR = 16, 8, 8, 1e-5
LIT_BEST = "datamodule.mode=sync pool.prompts_per_request=16 shape.micro_batch_size=128"
OMP = ("PASSIVE", "100000")


def lit_parl_side(args, seed: int, run_dir: Path) -> dict:
    cmd = [
        str(ROOT / ".venv" / "bin" / "lit-parl"),
        "+experiment=smollm2_reverse",
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
        f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "sampling.temperature=1.0",
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


def trl_side(args, seed: int, layout: str, out: Path) -> dict:
    batch, accum = (int(n) for n in layout.split("x"))
    if batch * accum != PROMPTS * GROUP:
        raise ValueError(f"--trl-configs {layout}: batch x accumulation must be {PROMPTS * GROUP}")
    cmd = [
        str(ROOT / ".venv-trl" / "bin" / "python"),
        str(BENCH / "trl_side.py"),
        f"--model-dir={args.model_dir}",
        "--task=reverse",
        f"--system-prompt={SYSTEM_PROMPT}",
        f"--steps={args.steps}",
        f"--seed={seed}",
        f"--prompts-per-step={PROMPTS}",
        f"--group-size={GROUP}",
        f"--batch-size={batch}",
        f"--grad-accum={accum}",
        f"--max-new-tokens={MAX_NEW_TOKENS}",
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


def plot(runs: dict[str, list[dict]], path: Path) -> None:
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
    axis.set_title("SmolLM2-135M-Instruct, smollm2_reverse: lit_parl and TRL, one line per seed")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: model=smollm2's converted directory")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--trl-configs", nargs="+", default=["128x1", "64x2"])
    parser.add_argument("--lit-overrides", default=LIT_BEST)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None, help="the reward curves as a PNG")
    parser.add_argument("--from-json", type=Path, default=None, help="plot an earlier --out instead of running")
    args = parser.parse_args()
    if args.from_json is not None:
        plot(json.loads(args.from_json.read_text()), args.plot)
        return
    if args.model_dir is None:
        from lit_parl.models.local_files import cache_root

        args.model_dir = next((cache_root() / "gguf").glob("SmolLM2-135M-Instruct*"))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="smollm2_vs_trl_") as work:
        for seed in args.seeds:
            found = [lit_parl_side(args, seed, Path(work) / f"lit_parl_{seed}")]
            for layout in args.trl_configs:
                found.append(trl_side(args, seed, layout, Path(work) / f"trl_{layout}_{seed}.json"))
            for run in found:
                runs.setdefault(run["side"], []).append(run | {"seed": seed})
                shown = {k: v for k, v in run.items() if k != "rewards"}
                print(f"seed {seed}: {json.dumps(shown)} rewards {[round(r, 3) for r in run['rewards']]}", flush=True)
    print(f"\nSmolLM2-135M-Instruct, smollm2_reverse, {args.steps} steps, seeds {args.seeds}\n")
    print("| side | completions/s (seeds) | tokens/s (median) | reward, first step (mean) | reward, last 10% (mean) |")
    print("|---|---|---|---|---|")
    for side, rs in runs.items():
        rates = " ".join(f"{r['completions_per_s']:.2f}" for r in rs)
        tokens = statistics.median(r["tokens_per_s"] for r in rs)
        first = statistics.mean(r["rewards"][0] for r in rs)
        last = statistics.mean(last_share(r["rewards"]) for r in rs)
        print(f"| {side} | {rates} | {tokens:.1f} | {first:.3f} | {last:.3f} |")
    for side in (s for s in runs if s != "lit_parl"):
        ratios = [lp["completions_per_s"] / t["completions_per_s"] for lp, t in zip(runs["lit_parl"], runs[side])]
        print(f"lit_parl / {side}: " + " ".join(f"{r:.2f}x" for r in ratios))
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
