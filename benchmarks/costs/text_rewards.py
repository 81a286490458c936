"""What text rewards cost against the token-id path, and whether a slow reward stays off the critical path.

Every variant is the default job (``lit-parl``, 800 iterations unless ``--iterations``) with rewards added
beside its own token-id reward *at weight 0*: the total reward, and so what is trained, is unchanged, so
the runs do equal work and the throughput difference is the cost of the added reward alone. (Scored
inline, the runs are bit-identical; scored on threads, groups arrive in another order, so micro-batches
are cut differently and rounding differs: the script says so.) Variants run interleaved, one at a time.

- ``ids``: the default job (``positional_reward`` on token ids; nothing decoded);
- ``text``: plus the same reward computed from decoded text (``benchmarks/costs/reward_fns.py:positional_text``):
  every completion is decoded and a Python reward called on it;
- ``slow_inline`` / ``slow_threads``: plus a verifier that takes 10 ms per group (32 groups an iteration),
  scored where the batcher runs (``score_workers=0``) or on 8 scoring threads as groups arrive
  (``score_workers=8``).

Usage: ``.venv/bin/python benchmarks/costs/text_rewards.py [--seeds 0 1 2] [--iterations 800] [--variants ids text]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ADD = (
    "+reward.{name}._target_=lit_parl.rewards.Reward +reward.{name}.fn=benchmarks/costs/reward_fns.py:{fn} "
    "+reward.{name}.weight=0.0"
)
VARIANTS = {
    "ids": "",
    "text": ADD.format(name="text", fn="positional_text"),
    "slow_inline": ADD.format(name="slow", fn="slow_verifier") + " datamodule.score_workers=0",
    "slow_threads": ADD.format(name="slow", fn="slow_verifier") + " datamodule.score_workers=8",
}


def run(variant: str, seed: int, iterations: int) -> dict:
    run_dir = REPO / "runs" / f"text_rewards_{variant}_seed{seed}"
    command = [
        str(Path(sys.executable).parent / "lit-parl"),
        f"seed={seed}",
        f"iterations={iterations}",
        f"run_dir={run_dir}",
        "trainer.max_time=null",
        "checkpoint_every=0",
        *VARIANTS[variant].split(),
    ]
    out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("lit_parl summary:"))
    return json.loads(line.split(":", 1)[1].replace("'", '"'))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=800)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for seed in args.seeds:
        for variant in args.variants:
            summary = run(variant, seed, args.iterations)
            results[variant].append(summary)
            print(
                f"{variant} seed={seed} completions/s={summary['completions_per_s']:.0f} wall={summary['wall_s']:.1f}s "
                f"reward_last={summary[next(k for k in summary if k.startswith('reward_last'))]:.4f}",
                flush=True,
            )
    base = args.variants[0]
    for variant in args.variants:
        for seed, a, b in zip(args.seeds, results[base], results[variant]):
            key = next(k for k in a if k.startswith("reward_last"))
            if a[key] != b[key]:
                # scoring on threads hands groups over in the order their scores finish: micro-batches are cut in
                # another order, and the sums' rounding (amplified over the run) differs; the work stays equal
                print(
                    f"  note: {variant} seed={seed} ended at reward {b[key]:.4f} against {a[key]:.4f} "
                    f"({base}): another arrival order"
                )
    print(f"\nratios of completions/s to '{base}' (per seed, then median), {args.iterations} iterations:")
    for variant in args.variants:
        ratios = [b["completions_per_s"] / a["completions_per_s"] for a, b in zip(results[base], results[variant])]
        print(f"  {variant:13s} {' '.join(f'{r:.3f}' for r in ratios)}  median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
