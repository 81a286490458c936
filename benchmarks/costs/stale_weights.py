"""How far a pool that keeps old weights drifts from θ_k: the figures behind the on-policy check's bounds.

Trains the tests' tiny job (8 prompts x 4 samples, the `hf` pool, AdamW) for a few iterations twice per
learning rate: with a normal pool, and with one that pushes the first sync's weights at every sync while
reporting each new version (labels all correct, weights stale). Prints, per iteration, the rollout/θ_k
mean |Δ log-prob| per token of the worst group and of the whole iteration. The check itself is off here
(``logprob_tolerance=None``), so the stale run continues.

    .venv/bin/python benchmarks/costs/stale_weights.py [--iterations 4] [--lrs 5e-4 1e-5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lightning.pytorch import Callback

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers.components import fit, make_components
from helpers.pools import KeepsFirstWeights  # noqa: E402 - the tests' tiny job and stale pool
from lit_parl.rollout import HFRolloutPool  # noqa: E402
from lit_parl.trainer.guards import logprob_mismatch, worst_group_mismatch  # noqa: E402


class Mismatch(Callback):
    """Per iteration: the worst group's and the whole iteration's mean |Δ log-prob| per token."""

    def __init__(self) -> None:
        self.rows: dict[int, list[float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        old = pl_module.completion_logprobs(pl_module.policy, batch).detach()  # one step per iteration: θ_k
        worst, _ = worst_group_mismatch(batch.rollout_logprobs, old, batch.completion_mask, batch.prompt_ids)
        abs_sum, _, tokens = logprob_mismatch(batch.rollout_logprobs, old, batch.completion_mask)
        row = self.rows.setdefault(trainer.current_epoch, [0.0, 0.0, 0.0])
        row[0] = max(row[0], worst)
        row[1] += float(abs_sum)
        row[2] += float(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--lrs", type=float, nargs="+", default=[5e-4, 1e-5])
    args = parser.parse_args()
    print("| lr (AdamW) | pool | iteration | worst group, mean abs per token | iteration, mean abs per token |")
    print("|---|---|---|---|---|")
    for lr in args.lrs:
        for name, wrap in (("normal", lambda pool: pool), ("keeps first weights", KeepsFirstWeights)):
            pool = wrap(HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1))
            module, data = make_components(pool=pool, lr=lr)
            data.logprob_tolerance = None
            probe = Mismatch()
            fit(module, data, iterations=args.iterations, callbacks=[probe])
            for iteration, (worst, abs_sum, tokens) in sorted(probe.rows.items()):
                print(f"| {lr:g} | {name} | {iteration} | {worst:.2e} | {abs_sum / tokens:.2e} |", flush=True)


if __name__ == "__main__":
    main()
