#!/usr/bin/env bash
# What an LLM judge on a real SGLang server costs a real run on this CPU: SmolLM2-135M-Instruct learning to reverse
# digits (+experiment=smollm2_reverse, 4 prompts x 8 samples an iteration, the hf pool) with and without a judge
# beside the positional reward: SmolLM2-135M-Instruct itself, on an SGLang CPU server that the run launches
# (reward.judge.launch), asked whether each reply equals the answer. Unreadable verdicts score 0 and are counted
# (datamodule.scoring.on_error=score). A 135M judge grades poorly: this measures the machinery, not the grades.
# Needs .venv-sglang (make .venv-sglang/.installed) and the SmolLM2 files (pip install 'lit-parl[smollm2]').
# Usage: benchmarks/rewards/judge_smollm2.sh [-n iterations]
set -euo pipefail
cd "$(dirname "$0")/../.."
iterations=5
while getopts "n:" opt; do case $opt in n) iterations=$OPTARG;; *) exit 2;; esac; done
py=.venv-sglang/bin/python
judge=$("$py" -c "from lit_parl.models.smollm2 import smollm2_instruct; print(smollm2_instruct()[0].name_or_path)" \
  2>/dev/null | tail -1)
common=(+experiment=smollm2_reverse shape.prompts=4 shape.micro_batch_size=32 "iterations=$iterations" datamodule.evaluation.every_n_iterations=0
  checkpoint_every=0 callbacks.progress.refresh_rate=0 trainer.max_time=null)
rubric="The reply was: {completion}. The correct reply is: {answer}. If the reply is exactly the correct reply, \
answer Score: 1; otherwise answer Score: 0."
"$py" -m lit_parl "${common[@]}" run_dir=runs/judge_smollm2_without > runs/judge_smollm2_without.log 2>&1
start=$(date +%s.%N)
"$py" -m lit_parl "${common[@]}" run_dir=runs/judge_smollm2_with 'reward=[positional,judge]' \
  reward.judge.launch.model_path="$judge" reward.judge.launch.device=cpu reward.judge.weight=0.5 \
  "reward.judge.rubric=\"$rubric\"" 'reward.judge.score_range=[0,1]' reward.judge.max_tokens=16 \
  datamodule.scoring.on_error=score datamodule.scoring.error_score=0 > runs/judge_smollm2_with.log 2>&1
end=$(date +%s.%N)
"$py" - "$start" "$end" <<'PY'
import csv, json, sys
from pathlib import Path

def read(run):
    summary = json.loads(Path(f"runs/{run}/summary.json").read_text())
    rows = [r for r in csv.DictReader(open(f"runs/{run}/metrics.csv")) if r.get("reward")]
    return summary, rows

without, _ = read("judge_smollm2_without")
with_judge, rows = read("judge_smollm2_with")
n = with_judge["iterations"]
failures = [float(r.get("reward/judge/failures") or 0) for r in rows]
judged = [float(r["reward/judge"]) if r.get("reward/judge") else float("nan") for r in rows]
print(f"| run | iterations | fit wall s | s / iteration | launch + fit + stop s |")
print(f"|---|---|---|---|---|")
print(f"| without judge | {without['iterations']} | {without['wall_s']:.1f} | {without['wall_s'] / without['iterations']:.1f} | |")
total = float(sys.argv[2]) - float(sys.argv[1])
print(f"| with judge | {n} | {with_judge['wall_s']:.1f} | {with_judge['wall_s'] / n:.1f} | {total:.0f} |")
print(f"judge reward per iteration (mean): {' '.join(f'{v:.2f}' for v in judged)}")
print(f"unreadable verdicts per iteration (of 32): {' '.join(f'{v:g}' for v in failures)}")
first = [line for line in Path("runs/judge_smollm2_with.log").read_text().splitlines() if "reward 'judge'" in line]
print("the first failure, as the run reported it:", first[0] if first else "none")
PY
