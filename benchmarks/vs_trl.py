"""lit_parl against Hugging Face TRL's ``GRPOTrainer``: same model, task, batch, sampling, objective and cores.

Usage (from the repository root, after ``make install`` and ``benchmarks/setup_trl_env.sh``)::

    .venv/bin/python benchmarks/vs_trl.py --quick                      # smoke run: 3 steps per side and workload
    .venv/bin/python benchmarks/vs_trl.py --out vs_trl.json             # 300 steps of (a), 40 of (b)
    .venv/bin/python benchmarks/vs_trl.py --workloads a --steps-a 200 --reps 2 --trl-threads 2,1
    .venv/bin/python benchmarks/vs_trl.py --workloads a --seeds 0,1,2,3,4   # the reward, seed by seed

Workloads:
  a  the default job: copy task, 32 prompts x G=8 per step, at most 6 new tokens, lr 5e-4, beta 0.
  b  the same with a shared preamble of ``--preamble-chars`` (200) characters, one token each, before every
     prompt (``benchmarks/vs_trl_task.py``), so every prompt is ~200 tokens long.

Each side runs in its own interpreter, one after the other (never at the same time); with ``--reps`` > 1 the
order alternates (lit_parl first, then TRL first, ...), since this machine is noisy. Both sides start from
the same weights: ``lit_parl.model.tiny_qwen2`` (the default job's sizes) is written once with
``save_pretrained`` and loaded by both (lit_parl: ``model=pretrained``).

The two sides run the same number of optimizer steps, so the same number of completions (steps x 256).
Workload (b) costs about 10x (a) per step, hence separate step counts (``--steps-a``, ``--steps-b``; ``--steps``
sets both):

- **lit_parl**: ``lit-parl iterations=N`` with the default config: async mode, one rollout worker of 1 thread,
  the trainer on 1 thread, shared-prompt packing (auto). ``checkpoint_every=0`` and ``trainer.max_time=null``
  (TRL saves nothing and has no time cap). Its ``wall_s`` runs from Lightning's ``on_fit_start`` to
  ``on_fit_end``: the worker's start-up and the final export are outside it.
- **TRL**: ``benchmarks/trl_side.py`` in ``.venv-trl``: ``GRPOTrainer`` in one process, torch threads 2
  (``--trl-threads``; ``2,1`` runs TRL once with each), generation with ``model.generate``
  (``use_vllm=False``), fp32. Its ``wall_s`` is ``trainer.train()``: model loading and the trainer's
  construction are outside it.

  OpenMP: both sides' processes get ``OMP_WAIT_POLICY=PASSIVE`` (``--omp-wait-policy``). With the default
  (spinning) policy, a 2-thread torch process slowed down up to 10x here whenever anything else ran on the
  2 cores: each op's barrier waits for a descheduled thread while the idle one spins. Measured side by side
  while other jobs ran, TRL on 2 threads did 133-538 completions/s by default and 745-759 with PASSIVE.
  lit_parl's async processes are single-threaded and barely affected; its sync mode (2 threads per process,
  ``--lit-sync``) is affected the same way. ``--trl-threads 2,1`` adds a 1-thread TRL run as a reference.

What is matched (``trl_side.py`` comments each setting): the weights at step 0; the prompts and their order
(TRL ``shuffle_dataset=False``: step k trains prompts 32k..32k+31 of the task, as lit_parl's iteration k);
the reward (``lit_parl.tasks.positional_reward`` on the completion's token ids, end token included);
G=8, 6 new tokens, temperature 1, top-p 1, no top-k; one optimizer step per 32 x 8 completions, in 4
micro-batches of 64 (TRL ``per_device_train_batch_size=64``, ``gradient_accumulation_steps=4``,
``num_iterations=1``); the objective (TRL ``loss_type="grpo"``, a per-sequence token mean averaged over
sequences, is lit_parl's ``seq-mean-token-mean``; clip 0.2; group std scaling; beta 0); AdamW(5e-4,
(0.9, 0.999), 1e-8, no weight decay), gradient clip 1.0, constant learning rate; fp32; no checkpointing.

What differs:
- the advantage's epsilon: (r - mean) / (std + 1e-4) in TRL, + 1e-6 in lit_parl (both unbiased std);
- the samples: both are seeded, but by different samplers (TRL: ``model.generate``; lit_parl: one seeded
  generator per sample), so the completions differ. The reward curves agree within noise (measured: 0.536
  against 0.558 over the last 30 of 300 steps);
- the design being measured: TRL prefills every prompt once per completion (G times) and trains on G full
  ``[prompt, completion]`` rows, its LM head over every position (it keeps only completion positions on
  Triton devices alone). lit_parl prefills each prompt once and repeats its KV cache, packs a group's prompt
  once for training, and overlaps generation with training in two processes. The preamble workload (b)
  exists to show the prompt-sharing part;
- TRL computes per-token entropies on every step (its logging); lit_parl computes its own statistics.

For each side the table gives completions/s and completion tokens/s (over ``wall_s``), the mean reward of
the first step and of the last ~10% of steps (at least one), and lit_parl / TRL. ``proc_s`` is each
subprocess's whole wall time, imports and start-up included. ``--out`` writes everything as JSON, the
per-step rewards included.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

# the default job's sizes (conf/model/tiny_qwen2.yaml) and settings (conf/config.yaml, conf/pool/hf.yaml, conf/algorithm/grpo.yaml)
MODEL = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512)
PROMPTS_PER_STEP, GROUP_SIZE, MICRO_BATCH, MAX_NEW_TOKENS, LR, BETA = 32, 8, 64, 6, 5e-4, 0.0
WORKLOADS = {"a": "copy task (default job)", "b": "copy task + shared preamble"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per side for every workload (sets --steps-a and --steps-b)")
    p.add_argument("--steps-a", type=int, default=300, help="workload a: optimizer steps per side (lit_parl iterations), 256 completions each")
    p.add_argument("--steps-b", type=int, default=40, help="workload b: optimizer steps per side")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 steps per workload, one rep")
    p.add_argument("--workloads", default="a,b", help="comma-separated: a (copy task), b (copy task + preamble)")
    p.add_argument("--reps", type=int, default=1, help="repetitions; the side order alternates between them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, help="comma-separated seeds (weights at step 0, task, sampling): every "
                   "workload and rep runs once per seed, and the rewards are compared seed by seed and on average")
    p.add_argument("--preamble-chars", type=int, default=200, help="workload b: preamble length in tokens (characters)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    p.add_argument("--lit-parl", default=str(ROOT / ".venv" / "bin" / "lit-parl"))
    p.add_argument("--lit-overrides", default="", help="extra Hydra overrides for lit_parl, space-separated")
    p.add_argument("--lit-sync", action="store_true",
                   help="also run lit_parl with datamodule.mode=sync (colocated: generate, then train, on 2 threads)")
    p.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "inherit"),
                   help="OMP_WAIT_POLICY of both sides' processes (inherit: leave the environment's)")
    p.add_argument("--trl-threads", default="2", help="torch threads of the TRL process; a comma list (2,1) runs TRL once per value")
    p.add_argument("--work-dir", default=None, help="model, run directories and logs (default: a new temporary directory)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps is not None:
        args.steps_a = args.steps_b = args.steps
    if args.quick:
        args.steps_a, args.steps_b, args.reps = 3, 3, 1
    args.trl_threads = [int(t) for t in str(args.trl_threads).split(",") if t.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    if min(args.steps_a, args.steps_b, args.reps, *args.trl_threads) < 1:
        p.error("steps, --reps and --trl-threads must be >= 1")
    return args


def save_model(directory: Path, seed: int) -> None:
    from lit_parl.model import tiny_qwen2

    model, tokenizer = tiny_qwen2(**MODEL, seed=seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def last_share(values: list[float], share: float = 0.1) -> float:
    """Mean of the last ``share`` of ``values`` (at least one value)."""
    n = max(1, math.ceil(len(values) * share))
    tail = values[-n:]
    return sum(tail) / len(tail)


def child_env(omp_wait_policy: str) -> dict:
    env = dict(os.environ)
    if omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = omp_wait_policy
    # vs_trl_task (workload b) must import in the trainer and in lit_parl's spawned rollout worker
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_logged(cmd: list[str], log: Path, omp_wait_policy: str) -> float:
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(omp_wait_policy), stdout=f, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; log {log}:\n{tail}")
    return elapsed


def lit_parl_side(args, workload: str, steps: int, mode: str, model_dir: Path, run_dir: Path) -> dict:
    cmd = [
        args.lit_parl,
        f"iterations={steps}",
        f"datamodule.mode={mode}",
        f"seed={args.seed}",
        "model=pretrained",
        f"model.path={model_dir}",
        f"run_dir={run_dir}",
        "checkpoint_every=0",
        "trainer.max_time=null",
        # spelled out, though they are the defaults: what the TRL side is set to
        f"shape.prompts={PROMPTS_PER_STEP}",
        f"shape.group_size={GROUP_SIZE}",
        f"shape.micro_batch_size={MICRO_BATCH}",
        f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        f"optimizer.lr={LR}",
        f"algorithm.objective.beta={BETA}",
    ]
    if workload == "b":
        cmd += ["data._target_=vs_trl_task.PreambleCopyTask", f"+data.preamble_chars={args.preamble_chars}"]
    cmd += args.lit_overrides.split()
    proc_s = run_logged(cmd, run_dir.with_suffix(".log"), args.omp_wait_policy)
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = []
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("reward") not in (None, ""):
                rewards.append((int(row["epoch"]), float(row["reward"])))
    rewards = [r for _, r in sorted(rewards)]
    if len(rewards) != steps or summary["completions"] != steps * PROMPTS_PER_STEP * GROUP_SIZE:
        raise RuntimeError(f"lit_parl ran {len(rewards)} iterations / {summary['completions']} completions, expected {steps}")
    return {
        "side": "lit_parl" if mode == "async" else f"lit_parl_{mode}",
        "steps": len(rewards),
        "completions": summary["completions"],
        "wall_s": summary["wall_s"],
        "proc_s": round(proc_s, 2),
        "completions_per_s": summary["completions_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "gen_busy_s": summary["gen_busy_s"],
        "train_busy_s": summary["train_busy_s"],
        "reward_first": rewards[0],
        "reward_last": last_share(rewards),
        "rewards": rewards,
        "command": cmd,
    }


def trl_side(args, workload: str, steps: int, threads: int, model_dir: Path, out: Path) -> dict:
    cmd = [
        args.trl_python,
        str(BENCH / "trl_side.py"),
        f"--model-dir={model_dir}",
        f"--task={'copy' if workload == 'a' else 'preamble'}",
        f"--preamble-chars={args.preamble_chars}",
        f"--steps={steps}",
        f"--seed={args.seed}",
        f"--prompts-per-step={PROMPTS_PER_STEP}",
        f"--group-size={GROUP_SIZE}",
        f"--micro-batch-size={MICRO_BATCH}",
        f"--max-new-tokens={MAX_NEW_TOKENS}",
        f"--lr={LR}",
        f"--beta={BETA}",
        f"--threads={threads}",
        f"--out={out}",
    ]
    proc_s = run_logged(cmd, out.with_suffix(".log"), args.omp_wait_policy)
    result = json.loads(out.read_text())
    result.update(
        proc_s=round(proc_s, 2),
        reward_first=result["rewards"][0],
        reward_last=last_share(result["rewards"]),
        command=cmd,
    )
    return result


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


KEYS = [("completions_per_s", "completions/s", "{:.1f}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
        ("reward_first", "reward, first step", "{:.3f}"), ("reward_last", "reward, last 10% of steps", "{:.3f}"),
        ("wall_s", "wall_s", "{:.1f}"), ("proc_s", "proc_s (whole process)", "{:.1f}")]


LABELS = {"lit_parl": "lit_parl", "lit_parl_sync": "lit_parl sync"}


def label(side: str) -> str:
    return LABELS.get(side) or f"TRL {side.removeprefix('trl_t')} thr"


def table(results: list[dict], sides: list[str]) -> str:
    """Markdown: one row per workload, rep and metric; one column per side, then each lit_parl side / each TRL side."""
    lits = [s for s in sides if s.startswith("lit_parl")]
    trls = [s for s in sides if s.startswith("trl")]
    pairs = [(a, b) for a in lits for b in trls]
    head = ["workload", "steps", "rep", "metric", *map(label, lits + trls), *(f"{label(a)} / {label(b)}" for a, b in pairs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(workload, steps, rep, name, fmt, values: dict):
        ratios = [f"{values[a] / values[b]:.2f}x" if values[b] else "n/a" for a, b in pairs]
        cells = [workload, str(steps), str(rep), name, *(fmt.format(values[x]) for x in lits + trls), *ratios]
        lines.append("| " + " | ".join(cells) + " |")

    for r in results:
        for key, name, fmt in KEYS:
            row(r["workload"], r["steps"], f"seed {r.get('seed', 0)}, rep {r['rep']}", name, fmt, {x: r[x][key] for x in lits + trls})
    if len(results) > len({r["workload"] for r in results}):
        for workload in dict.fromkeys(r["workload"] for r in results):
            rows = [r for r in results if r["workload"] == workload]
            for key, name, fmt in KEYS[:2]:
                row(workload, rows[0]["steps"], "median", name, fmt, {x: median([y[x][key] for y in rows]) for x in lits + trls})
            row(workload, rows[0]["steps"], "mean", "reward, last 10% of steps", "{:.3f}",
                {x: sum(y[x]["reward_last"] for y in rows) / len(rows) for x in lits + trls})
            for a, b in pairs:
                wins = sum(y[a]["reward_last"] >= y[b]["reward_last"] for y in rows)
                lines.append(f"\n{workload}: {label(a)} reached at least {label(b)}'s last-10% reward in {wins} of {len(rows)} runs")
            steps, width = rows[0]["steps"], max(1, rows[0]["steps"] // 10)
            lines.append(f"{workload}: mean reward per {width} steps over these runs, " + ", ".join(map(label, lits + trls)) + ":")
            for start in range(0, steps, width):
                means = [sum(sum(y[x]["rewards"][start : start + width]) / width for y in rows) / len(rows) for x in lits + trls]
                lines.append(f"  steps {start}-{start + width - 1}: " + "  ".join(f"{m:.3f}" for m in means))
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    for exe in (args.trl_python, args.lit_parl):
        if not Path(exe).exists():
            hint = "benchmarks/setup_trl_env.sh" if exe == args.trl_python else "make install"
            raise SystemExit(f"{exe} not found: run {hint} first")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    steps_of = {"a": args.steps_a, "b": args.steps_b}
    print(f"vs_trl: work dir {work}; steps {({w: steps_of[w] for w in args.workloads})} x "
          f"{PROMPTS_PER_STEP * GROUP_SIZE} completions per side; TRL threads {args.trl_threads}", flush=True)
    sides = ["lit_parl", *(["lit_parl_sync"] if args.lit_sync else []), *(f"trl_t{t}" for t in args.trl_threads)]
    results = []
    for run_index, (seed, rep) in enumerate((seed, rep) for seed in seeds for rep in range(args.reps)):
        args.seed = seed  # read by both sides' command lines
        model_dir = work / f"tiny_qwen2_seed{seed}"
        if not model_dir.exists():
            save_model(model_dir, seed)
        for workload in args.workloads:
            steps = steps_of[workload]
            order = sides if run_index % 2 == 0 else sides[::-1]  # A/B interleaved across reps and seeds
            entry = {"workload": workload, "steps": steps, "rep": rep, "seed": seed, "order": list(order)}
            for side in order:
                tag = f"{workload}_seed{seed}_rep{rep}_{side}"
                print(f"vs_trl: workload {workload} seed {seed} rep {rep}: {side} ({steps} steps) ...", flush=True)
                if side.startswith("lit_parl"):
                    mode = "sync" if side == "lit_parl_sync" else "async"
                    entry[side] = lit_parl_side(args, workload, steps, mode, model_dir, work / tag)
                else:
                    threads = int(side.removeprefix("trl_t"))
                    entry[side] = trl_side(args, workload, steps, threads, model_dir, work / f"{tag}.json")
                s = entry[side]
                print(f"vs_trl:   {side}: {s['completions_per_s']:.1f} completions/s, wall {s['wall_s']:.1f} s, "
                      f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, load avg {os.getloadavg()[0]:.2f}", flush=True)
                s["load_avg_after"] = os.getloadavg()
            results.append(entry)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": {"steps": steps_of, "reps": args.reps, "seeds": seeds, "prompts_per_step": PROMPTS_PER_STEP,
                     "group_size": GROUP_SIZE, "micro_batch_size": MICRO_BATCH, "max_new_tokens": MAX_NEW_TOKENS,
                     "lr": LR, "beta": BETA, "preamble_chars": args.preamble_chars, "model": MODEL,
                     "trl_threads": args.trl_threads, "lit_overrides": args.lit_overrides, "sides": sides,
                     "omp_wait_policy": args.omp_wait_policy},
        "workloads": {w: WORKLOADS[w] for w in args.workloads},
        "results": results,
        "table": table(results, sides),
        "work_dir": str(work),
    }
    print(report["table"], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"vs_trl: wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
