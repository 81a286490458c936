"""lit_parl against Hugging Face TRL's ``GRPOTrainer`` at its best: same weights, task, batch, sampling, objective
and cores.

Usage (from the repository root, after ``make install`` and ``benchmarks/vs_trl/setup_trl_env.sh``)::

    .venv/bin/python benchmarks/vs_trl/vs_trl.py --quick            # smoke run: 3 steps, seed 0, all models and configs
    .venv/bin/python benchmarks/vs_trl/vs_trl.py --out vs_trl.json  # 3 models x 2 workloads x 3 seeds x 3 sides
    .venv/bin/python benchmarks/vs_trl/vs_trl.py --workloads a --models h128 --steps-a 150 --seeds 0,1,2
    .venv/bin/python benchmarks/vs_trl/vs_trl.py --workloads b --models h64 --steps-b 30 --trl-configs 256x1
    .venv/bin/python benchmarks/vs_trl/vs_trl.py --models h256x4 --steps-for h256x4:a=100   # one model's steps

Workloads:
  a  the default job: copy task, 32 prompts x G=8 per step, at most 6 new tokens, lr 5e-4, beta 0.
  b  the same with a shared preamble of ``--preamble-chars`` (200) characters, one token each, before every
     prompt (``benchmarks/vs_trl/vs_trl_task.py``), so every prompt is ~200 tokens long.

Models (``--models``, default all three): random Qwen2 models built by ``lit_parl.models.tiny_qwen2`` with the
project's character tokenizer. 4 attention heads, as many KV heads, MLP width 4x the hidden size, tied
embeddings:
  h64     hidden 64, 2 layers (tiny_qwen2's defaults)
  h128    hidden 128, 2 layers (the default job, ``conf/model/tiny_qwen2.yaml``)
  h256x4  hidden 256, 4 layers
For each model and seed the weights are written once with ``save_pretrained``. Both sides load them
(lit_parl: ``model=pretrained``).

TRL runs in two layouts (``--trl-configs``, default both). Each takes one optimizer step per 32 prompts x 8
completions:
  256x1  all 256 completions of a step in one training batch: ``per_device_train_batch_size=256``, no
         gradient accumulation.
  64x4   four accumulated micro-batches of 64: ``per_device_train_batch_size=64``,
         ``gradient_accumulation_steps=4``. lit_parl's micro-batch size; the layout of the first comparison.
Neither is always faster: it depends on the model, the workload and the machine's load. So lit_parl is
compared with the FASTER of the two, run by run (same model, workload, seed and rep). Every ratio names
the TRL layout it is against. Given the same seed, the two layouts draw the same samples and make the same
updates up to float rounding. Measured: their per-step rewards were identical for the first 14-105 steps
of (a) and for all 30 steps of (b) at h64, until rounding made the trajectories drift apart.

What TRL 1.16 does with these settings (read in ``trl/trainer/grpo_config.py`` and ``grpo_trainer.py``):
- ``steps_per_generation`` defaults to ``gradient_accumulation_steps``; ``trl_side.py`` sets it to that
  explicitly. The generation batch is ``per_device_train_batch_size x steps_per_generation`` = 256 in both
  layouts: 32 prompts, each repeated ``num_generations`` = 8 times. TRL generates it in one
  ``model.generate`` call, scores it, shuffles it and splits it into ``steps_per_generation`` batches. So both
  layouts generate the same 256 completions per step (given the same random state) and take one optimizer
  step on them. ``trl_side.py`` checks the derived ``generation_batch_size`` and the number of reward calls.
- ``gradient_accumulation_steps`` is a multiple of ``steps_per_generation x num_iterations`` in both
  layouts, so TRL skips the old-log-prob forward pass (on-policy: the old log-probs are the current ones).
- The ``grpo`` loss takes each sequence's token mean, averages it over the batch's sequences, and divides by
  ``gradient_accumulation_steps``. With 4 equal micro-batches of 64 this sums to the mean over all 256
  sequences, the same objective as one batch of 256. The gradient differs only by float rounding.

Each side runs in its own interpreter, one after the other, never at the same time. The side order
rotates from one seed or rep to the next (lit_parl, TRL 256x1, TRL 64x4; then TRL 256x1, TRL 64x4,
lit_parl; ...), so each side runs first, second and last equally often over 3 seeds. With two sides this
alternates. Both sides run the same number of optimizer steps, so the same number of completions
(steps x 256). Workload (b) costs about 5-10x (a) per step, hence separate step counts (``--steps-a``, 150;
``--steps-b``, 30; ``--steps`` sets both). ``--steps-for`` sets one model and workload's (default: h256x4
runs 60 steps of a and 10 of b, unless ``--steps`` is given).

- **lit_parl**: ``lit-parl iterations=N`` with the default config: async mode, one rollout worker of 1 thread,
  the trainer on 1 thread, micro-batches of 64, shared-prompt packing (auto). ``checkpoint_every=0`` and
  ``trainer.max_time=null`` (TRL saves nothing and has no time cap). Its ``wall_s`` runs from Lightning's
  ``on_fit_start`` to ``on_fit_end``: the worker's start-up and the final export are outside it.
- **TRL**: ``benchmarks/vs_trl/trl_side.py`` in ``.venv-trl``: ``GRPOTrainer`` in one process, torch threads 2
  (``--trl-threads``; ``2,1`` runs each layout once with each), generation with ``model.generate``
  (``use_vllm=False``), fp32. Its ``wall_s`` is ``trainer.train()``: model loading and the trainer's
  construction are outside it.

  OpenMP: both sides' processes get ``OMP_WAIT_POLICY=PASSIVE`` (``--omp-wait-policy``) and
  ``GOMP_SPINCOUNT=100000`` (``--gomp-spincount``), lit_parl's own defaults: an idle thread spins about a
  millisecond, then sleeps. With the default policy (spinning about 3 ms), a 2-thread torch process slowed
  down up to 10x here whenever anything else ran on the 2 cores; with a plain passive policy (no spin) a
  thread is woken for every operation, and 2-thread steps took up to twice as long.

What is matched (``trl_side.py`` comments each setting):
- the weights at step 0;
- the prompts and their order (TRL ``shuffle_dataset=False``: step k trains prompts 32k..32k+31, as
  lit_parl's iteration k);
- the reward: ``lit_parl.tasks.positional_reward`` on the completion's token ids, end token included;
- G=8, 6 new tokens, temperature 1, top-p 1, no top-k;
- one optimizer step per 32 x 8 completions, ``num_iterations=1``;
- the objective: TRL ``loss_type="grpo"`` is lit_parl's ``seq-mean-token-mean``; clip 0.2; group std scaling;
  beta 0;
- AdamW(5e-4, (0.9, 0.999), 1e-8, no weight decay), gradient clip 1.0, constant learning rate;
- fp32, no checkpointing.

What differs:
- the advantage's epsilon: (r - mean) / (std + 1e-4) in TRL, + 1e-6 in lit_parl (both unbiased std);
- the samples. Both sides are seeded, but by different samplers (TRL: ``model.generate``; lit_parl: one
  seeded generator per sample), so the completions differ and so do the reward curves. Compare rewards
  over seeds, not within one;
- the training batch: lit_parl trains in micro-batches of 64 (its default); TRL in the layout named;
- the design being measured. TRL prefills every prompt once per completion (G times) and trains on G full
  ``[prompt, completion]`` rows, its LM head over every position. lit_parl prefills each prompt once and
  repeats its KV cache, packs a group's prompt once for training, and overlaps generation with training in
  two processes. Workload (b) exists to show the prompt-sharing part;
- TRL computes per-token entropies on every step (its logging); lit_parl computes its own statistics.

Output:
- per run: completions/s of every side, the faster TRL layout, lit_parl / that layout, and the mean
  reward of the last ~10% of steps per side;
- per model and workload, over runs (seeds x reps): completions/s as median [min-max] per side;
  lit_parl / faster TRL as median [min-max], with which layout was faster how often; lit_parl against
  each layout; the reward of the first step and of the last ~10% of steps, mean +- standard error.
``proc_s`` (in the JSON) is each subprocess's whole wall time, imports and start-up included. ``--out``
writes everything as JSON, the per-step rewards included.
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

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "vs_trl"

# lit_parl.models.tiny_qwen2 arguments: 4 heads (= KV heads) and an MLP 4x the hidden size at every size, as
# tiny_qwen2's defaults (h64) and conf/model/tiny_qwen2.yaml (h128, the default job) have them
MODELS = {
    "h64": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=256),
    "h128": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=512),
    "h256x4": dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=1024),
}
# the default job's settings (conf/config.yaml, conf/pool/hf.yaml, conf/algorithm/grpo.yaml)
PROMPTS_PER_STEP, GROUP_SIZE, LIT_MICRO_BATCH, MAX_NEW_TOKENS, LR, BETA = 32, 8, 64, 6, 5e-4, 0.0
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE
WORKLOADS = {"a": "copy task (default job)", "b": "copy task + shared preamble"}


def parse_trl_config(text: str) -> tuple[int, int]:
    """``"256x1"`` -> (per_device_train_batch_size 256, gradient_accumulation_steps 1)."""
    batch, _, accum = text.strip().partition("x")
    batch, accum = int(batch), int(accum or 1)
    if batch * accum != SAMPLES_PER_STEP:
        raise ValueError(f"TRL config {text!r}: batch x accumulation must be {SAMPLES_PER_STEP}")
    return batch, accum


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps per side for every workload (sets --steps-a and --steps-b)",
    )
    p.add_argument(
        "--steps-a",
        type=int,
        default=150,
        help="workload a: optimizer steps per side (lit_parl iterations), 256 completions each",
    )
    p.add_argument("--steps-b", type=int, default=30, help="workload b: optimizer steps per side")
    p.add_argument(
        "--steps-for",
        default=None,
        help="per model and workload step counts, both sides, over --steps-a/-b ('' for none); default, "
        "unless --steps or --quick: h256x4:a=60,h256x4:b=10 (h256x4 costs about 5x h128 per step)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 3 steps per model and workload, one rep, one seed (unless --seeds)",
    )
    p.add_argument("--workloads", default="a,b", help="comma-separated: a (copy task), b (copy task + preamble)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument(
        "--trl-configs",
        default="256x1,64x4",
        help="TRL layouts, BATCHxACCUM (per_device_train_batch_size x gradient_accumulation_steps); product 256",
    )
    p.add_argument("--reps", type=int, default=1, help="repetitions per seed; the side order rotates between runs")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated seeds (weights at step 0, task, sampling); default 0,1,2 (0 with --quick)",
    )
    p.add_argument("--preamble-chars", type=int, default=200, help="workload b: preamble length in tokens (characters)")
    p.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    p.add_argument("--lit-parl", default=str(ROOT / ".venv" / "bin" / "lit-parl"))
    p.add_argument("--lit-overrides", default="", help="extra Hydra overrides for lit_parl, space-separated")
    p.add_argument(
        "--lit-sync",
        action="store_true",
        help="also run lit_parl with datamodule.mode=sync (colocated: generate, then train, on 2 threads)",
    )
    p.add_argument(
        "--omp-wait-policy",
        default="PASSIVE",
        choices=("PASSIVE", "ACTIVE", "inherit", "unset"),
        help="OMP_WAIT_POLICY of both sides' processes (inherit: leave the environment's; unset: remove it)",
    )
    p.add_argument(
        "--gomp-spincount",
        default="100000",
        help="GOMP_SPINCOUNT of both sides' processes (inherit: leave the environment's; unset: remove it)",
    )
    p.add_argument(
        "--trl-threads",
        default="2",
        help="torch threads of the TRL process; a comma list (2,1) runs every layout once per value",
    )
    p.add_argument(
        "--work-dir", default=None, help="models, run directories and logs (default: a new temporary directory)"
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.steps_for is None:
        args.steps_for = "" if args.steps is not None or args.quick else "h256x4:a=60,h256x4:b=10"
    if args.steps is not None:
        args.steps_a = args.steps_b = args.steps
    if args.quick:
        args.steps_a, args.steps_b, args.reps = 3, 3, 1
        args.steps_for = ""
    args.seeds = [int(x) for x in (args.seeds or ("0" if args.quick else "0,1,2")).split(",") if x.strip()]
    args.trl_threads = [int(t) for t in str(args.trl_threads).split(",") if t.strip()]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from {sorted(WORKLOADS)}")
    unknown = set(args.models) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    try:
        args.trl_configs = [f"{b}x{a}" for b, a in map(parse_trl_config, args.trl_configs.split(","))]
    except ValueError as e:
        p.error(str(e))
    args.steps_of = {(m, w): (args.steps_a if w == "a" else args.steps_b) for m in MODELS for w in WORKLOADS}
    for item in filter(None, (x.strip() for x in args.steps_for.split(","))):
        key, _, n = item.partition("=")
        model, _, workload = key.partition(":")
        if (model, workload) not in args.steps_of or not n.isdigit():
            p.error(f"--steps-for: {item!r} is not MODEL:WORKLOAD=STEPS")
        args.steps_of[(model, workload)] = int(n)
    if min(*args.steps_of.values(), args.reps, *args.trl_threads) < 1:
        p.error("steps, --reps and --trl-threads must be >= 1")
    if not args.trl_configs or not args.seeds:
        p.error("need at least one TRL config and one seed")
    return args


def save_model(directory: Path, model: str, seed: int) -> None:
    from lit_parl.models import tiny_qwen2

    policy, tokenizer = tiny_qwen2(**MODELS[model], seed=seed)
    policy.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def last_share(values: list[float], share: float = 0.1) -> float:
    """Mean of the last ``share`` of ``values`` (at least one value)."""
    n = max(1, math.ceil(len(values) * share))
    tail = values[-n:]
    return sum(tail) / len(tail)


def child_env(omp_wait_policy: str, gomp_spincount: str) -> dict:
    env = dict(os.environ)
    # "unset" leaves OpenMP its own defaults (lit_parl's side then sets its own again when it is imported)
    for name, value in (("OMP_WAIT_POLICY", omp_wait_policy), ("GOMP_SPINCOUNT", gomp_spincount)):
        if value == "unset":
            env.pop(name, None)
        elif value != "inherit":
            env[name] = value
    # vs_trl_task (workload b) must import in the trainer and in lit_parl's spawned rollout worker
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_logged(cmd: list[str], log: Path, omp_wait_policy: str, gomp_spincount: str) -> float:
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=child_env(omp_wait_policy, gomp_spincount), stdout=f, stderr=subprocess.STDOUT
        )
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; log {log}:\n{tail}")
    return elapsed


def lit_parl_side(args, workload: str, steps: int, seed: int, mode: str, model_dir: Path, run_dir: Path) -> dict:
    cmd = [
        args.lit_parl,
        f"iterations={steps}",
        f"datamodule.mode={mode}",
        f"seed={seed}",
        "model=pretrained",
        f"model.path={model_dir}",
        f"run_dir={run_dir}",
        "checkpoint_every=0",
        "trainer.max_time=null",
        # spelled out, though they are the defaults: what the TRL side is set to
        f"shape.prompts={PROMPTS_PER_STEP}",
        f"shape.group_size={GROUP_SIZE}",
        f"shape.micro_batch_size={LIT_MICRO_BATCH}",
        f"sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "sampling.temperature=1.0",
        "sampling.top_p=1.0",
        f"optimizer.lr={LR}",
        f"algorithm.objective.beta={BETA}",
    ]
    if workload == "b":
        cmd += ["data._target_=vs_trl_task.PreambleCopyTask", f"+data.preamble_chars={args.preamble_chars}"]
    cmd += args.lit_overrides.split()
    proc_s = run_logged(cmd, run_dir.with_suffix(".log"), args.omp_wait_policy, args.gomp_spincount)
    summary = json.loads((run_dir / "summary.json").read_text())
    rewards = []
    with open(run_dir / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("reward") not in (None, ""):
                rewards.append((int(row["epoch"]), float(row["reward"])))
    rewards = [r for _, r in sorted(rewards)]
    if len(rewards) != steps or summary["completions"] != steps * SAMPLES_PER_STEP:
        raise RuntimeError(
            f"lit_parl ran {len(rewards)} iterations / {summary['completions']} completions, expected {steps}"
        )
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


def trl_side(
    args, workload: str, steps: int, seed: int, trl_config: str, threads: int, model_dir: Path, out: Path
) -> dict:
    batch, accum = parse_trl_config(trl_config)
    cmd = [
        args.trl_python,
        str(BENCH / "trl_side.py"),
        f"--model-dir={model_dir}",
        f"--task={'copy' if workload == 'a' else 'preamble'}",
        f"--preamble-chars={args.preamble_chars}",
        f"--steps={steps}",
        f"--seed={seed}",
        f"--prompts-per-step={PROMPTS_PER_STEP}",
        f"--group-size={GROUP_SIZE}",
        f"--batch-size={batch}",
        f"--grad-accum={accum}",
        f"--max-new-tokens={MAX_NEW_TOKENS}",
        f"--lr={LR}",
        f"--beta={BETA}",
        f"--threads={threads}",
        f"--out={out}",
    ]
    proc_s = run_logged(cmd, out.with_suffix(".log"), args.omp_wait_policy, args.gomp_spincount)
    result = json.loads(out.read_text())
    result.update(
        proc_s=round(proc_s, 2),
        reward_first=result["rewards"][0],
        reward_last=last_share(result["rewards"]),
        command=cmd,
    )
    return result


# ---------------------------------------------------------------------------------------------- statistics


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def mean_se(values: list[float]) -> tuple[float, float | None]:
    """Mean and standard error (sample standard deviation / sqrt(n)); None for one value."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return m, None
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1)
    return m, math.sqrt(var / len(values))


def spread(values: list[float], fmt: str, suffix: str = "") -> str:
    """``median [min-max]``."""
    if len(values) == 1:
        return fmt.format(values[0]) + suffix
    return f"{fmt.format(median(values))}{suffix} [{fmt.format(min(values))}{suffix}–{fmt.format(max(values))}{suffix}]"


def pm(values: list[float]) -> str:
    m, se = mean_se(values)
    return f"{m:.3f}" if se is None else f"{m:.3f} ± {se:.3f}"


# ---------------------------------------------------------------------------------------------- sides and tables

LABELS = {"lit_parl": "lit_parl", "lit_parl_sync": "lit_parl sync"}


def trl_name(trl_config: str, threads: int) -> str:
    return f"trl_{trl_config}_t{threads}"


def label(side: str, threads_shown: bool = False) -> str:
    if side in LABELS:
        return LABELS[side]
    config, _, threads = side.removeprefix("trl_").partition("_t")
    return f"TRL {config}" + (f" ({threads} thr)" if threads_shown else "")


def short(side: str, threads_shown: bool) -> str:
    """The TRL layout named beside a ratio: ``256x1`` (``256x1/2thr`` with several thread counts)."""
    config, _, threads = side.removeprefix("trl_").partition("_t")
    return config + (f"/{threads}thr" if threads_shown else "")


def annotate(entry: dict, lits: list[str], trls: list[str]) -> None:
    """Per run: the faster TRL side and every lit_parl side's ratio against it."""
    fastest = max(trls, key=lambda s: entry[s]["completions_per_s"])
    entry["faster_trl"] = fastest
    entry["ratio_vs_faster_trl"] = {
        a: entry[a]["completions_per_s"] / entry[fastest]["completions_per_s"] for a in lits
    }


def per_run_table(results: list[dict], lits: list[str], trls: list[str], threads_shown: bool) -> str:
    head = [
        "model",
        "workload",
        "steps",
        "seed",
        "rep",
        "order",
        *(f"{label(x, threads_shown)} completions/s" for x in lits + trls),
        "faster TRL",
        *(f"{label(a)} / faster TRL" for a in lits),
        *(f"{label(x, threads_shown)} reward, last 10%" for x in lits + trls),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        fastest = short(r["faster_trl"], threads_shown)
        cells = [
            r["model"],
            r["workload"],
            str(r["steps"]),
            str(r["seed"]),
            str(r["rep"]),
            " → ".join(label(s, threads_shown) for s in r["order"]),
            *(f"{r[x]['completions_per_s']:.1f}" for x in lits + trls),
            fastest,
            *(f"**{r['ratio_vs_faster_trl'][a]:.2f}x** vs {fastest}" for a in lits),
            *(f"{r[x]['reward_last']:.3f}" for x in lits + trls),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summarize(
    results: list[dict], lits: list[str], trls: list[str], threads_shown: bool
) -> tuple[list[dict], str, str]:
    """Per (model, workload): speeds as median [min-max], ratios, the faster layout's count, rewards as mean ± se."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["workload"]), []).append(r)
    summary = []
    speed_head = [
        "model",
        "workload",
        "steps",
        "runs",
        *(f"{label(x, threads_shown)} completions/s" for x in lits + trls),
        "faster TRL (runs)",
        *(f"{label(a)} / faster TRL" for a in lits),
        *(f"{label(a)} / {label(b, threads_shown)}" for a in lits for b in trls),
    ]
    speed = ["| " + " | ".join(speed_head) + " |", "|" + "---|" * len(speed_head)]
    reward_head = ["model", "workload", "steps", "runs", "side", "reward, first step", "reward, last 10% of steps"]
    reward = ["| " + " | ".join(reward_head) + " |", "|" + "---|" * len(reward_head)]
    for (model, workload), rows in groups.items():
        n, steps = len(rows), rows[0]["steps"]
        wins = {t: sum(r["faster_trl"] == t for r in rows) for t in trls}
        faster = ", ".join(f"{short(t, threads_shown)} ({wins[t]}/{n})" for t in trls if wins[t])
        item = {
            "model": model,
            "workload": workload,
            "steps": steps,
            "runs": n,
            "seeds": [r["seed"] for r in rows],
            "faster_trl_runs": {t: wins[t] for t in trls},
            "sides": {},
            "ratio_vs_faster_trl": {},
            "ratio_vs": {},
        }
        for x in lits + trls:
            cps = [r[x]["completions_per_s"] for r in rows]
            first, last = [r[x]["reward_first"] for r in rows], [r[x]["reward_last"] for r in rows]
            item["sides"][x] = {
                "completions_per_s": {"median": median(cps), "min": min(cps), "max": max(cps), "runs": cps},
                "reward_first": dict(zip(("mean", "se"), mean_se(first)), runs=first),
                "reward_last": dict(zip(("mean", "se"), mean_se(last)), runs=last),
            }
            reward.append(
                "| "
                + " | ".join([model, workload, str(steps), str(n), label(x, threads_shown), pm(first), pm(last)])
                + " |"
            )
        ratio_cells, vs_cells = [], []
        for a in lits:
            ratios = [r["ratio_vs_faster_trl"][a] for r in rows]
            item["ratio_vs_faster_trl"][a] = {
                "median": median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "runs": ratios,
                "against": [r["faster_trl"] for r in rows],
            }
            ratio_cells.append(
                f"**{spread(ratios, '{:.2f}', 'x')}** vs " + "/".join(short(t, threads_shown) for t in trls if wins[t])
            )
            for b in trls:
                rb = [r[a]["completions_per_s"] / r[b]["completions_per_s"] for r in rows]
                item["ratio_vs"][f"{a}/{b}"] = {"median": median(rb), "min": min(rb), "max": max(rb), "runs": rb}
                vs_cells.append(spread(rb, "{:.2f}", "x"))
        speed.append(
            "| "
            + " | ".join(
                [
                    model,
                    workload,
                    str(steps),
                    str(n),
                    *(spread([r[x]["completions_per_s"] for r in rows], "{:.0f}") for x in lits + trls),
                    faster,
                    *ratio_cells,
                    *vs_cells,
                ]
            )
            + " |"
        )
        summary.append(item)
    return summary, "\n".join(speed), "\n".join(reward)


def main(argv=None) -> dict:
    args = parse_args(argv)
    for exe in (args.trl_python, args.lit_parl):
        if not Path(exe).exists():
            hint = "benchmarks/vs_trl/setup_trl_env.sh" if exe == args.trl_python else "make install"
            raise SystemExit(f"{exe} not found: run {hint} first")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_trl_"))
    work.mkdir(parents=True, exist_ok=True)
    lits = ["lit_parl", *(["lit_parl_sync"] if args.lit_sync else [])]
    trls = [trl_name(c, t) for c in args.trl_configs for t in args.trl_threads]
    threads_shown = len(args.trl_threads) > 1
    sides = lits + trls
    steps_used = {f"{m}:{w}": args.steps_of[(m, w)] for m in args.models for w in args.workloads}
    print(
        f"vs_trl: work dir {work}; models {args.models}, workloads {args.workloads}, "
        f"seeds {args.seeds}, reps {args.reps}; "
        f"steps {steps_used} x {SAMPLES_PER_STEP} completions per side; sides {sides}",
        flush=True,
    )
    results = []
    for run_index, (seed, rep) in enumerate((seed, rep) for seed in args.seeds for rep in range(args.reps)):
        shift = run_index % len(sides)
        order = sides[shift:] + sides[:shift]  # rotated per seed/rep: each side first, middle and last in turn
        for model in args.models:
            model_dir = work / f"{model}_seed{seed}"
            if not (model_dir / "config.json").exists():
                save_model(model_dir, model, seed)
            for workload in args.workloads:
                steps = args.steps_of[(model, workload)]
                entry = {
                    "model": model,
                    "workload": workload,
                    "steps": steps,
                    "rep": rep,
                    "seed": seed,
                    "order": list(order),
                }
                for side in order:
                    tag = f"{model}_{workload}_seed{seed}_rep{rep}_{side}"
                    print(
                        f"vs_trl: {model} workload {workload} seed {seed} rep {rep}: {side} ({steps} steps) ...",
                        flush=True,
                    )
                    if side.startswith("lit_parl"):
                        mode = "sync" if side == "lit_parl_sync" else "async"
                        entry[side] = lit_parl_side(args, workload, steps, seed, mode, model_dir, work / tag)
                    else:
                        config, _, threads = side.removeprefix("trl_").partition("_t")
                        entry[side] = trl_side(
                            args, workload, steps, seed, config, int(threads), model_dir, work / f"{tag}.json"
                        )
                    s = entry[side]
                    s["load_avg_after"] = os.getloadavg()
                    print(
                        f"vs_trl:   {side}: {s['completions_per_s']:.1f} completions/s, wall {s['wall_s']:.1f} s, "
                        f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}, "
                        f"load avg {s['load_avg_after'][0]:.2f}",
                        flush=True,
                    )
                annotate(entry, lits, trls)
                print(
                    f"vs_trl:   faster TRL: {label(entry['faster_trl'], threads_shown)}; "
                    + ", ".join(f"{label(a)} / it = {v:.2f}x" for a, v in entry["ratio_vs_faster_trl"].items()),
                    flush=True,
                )
                results.append(entry)
    summary, speed_table, reward_table = summarize(results, lits, trls, threads_shown)
    runs_table = per_run_table(results, lits, trls, threads_shown)
    text = (
        "Per run (lit_parl / the faster TRL layout of the same model, workload, seed and rep):\n\n"
        + runs_table
        + "\n\nSpeed per model and workload, over runs: completions/s median [min–max]; ratios median [min–max]:\n\n"
        + speed_table
        + "\n\nReward per side, over runs: mean ± standard error:\n\n"
        + reward_table
    )
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]},
        "settings": {
            "steps": steps_used,
            "reps": args.reps,
            "seeds": args.seeds,
            "models": {m: MODELS[m] for m in args.models},
            "prompts_per_step": PROMPTS_PER_STEP,
            "group_size": GROUP_SIZE,
            "lit_micro_batch_size": LIT_MICRO_BATCH,
            "trl_configs": args.trl_configs,
            "trl_threads": args.trl_threads,
            "max_new_tokens": MAX_NEW_TOKENS,
            "lr": LR,
            "beta": BETA,
            "preamble_chars": args.preamble_chars,
            "lit_overrides": args.lit_overrides,
            "sides": sides,
            "omp_wait_policy": args.omp_wait_policy,
            "gomp_spincount": args.gomp_spincount,
        },
        "workloads": {w: WORKLOADS[w] for w in args.workloads},
        "results": results,
        "summary": summary,
        "table": text,
        "work_dir": str(work),
    }
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"vs_trl: wrote {args.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
