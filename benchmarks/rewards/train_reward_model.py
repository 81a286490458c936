"""Train the tiny reward model that benchmarks/rewards/learns.sh trains a policy against.

Preference pairs are written here (benchmarks/rewards/digit_preference.py: completions with more even digits are
preferred), on the default job's own prompts (the copy task's), and the model (``lit_parl.tiny_reward_model``, a
one-logit Qwen2 on the character tokenizer) is fitted with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected).
It reads a sample as ``lit_parl.rewards.RewardModel`` will: the prompt as the policy saw it, then the completion (no
chat template). Prints the held-out pairwise accuracy and saves model and tokenizer for ``reward.model.path``.

    python benchmarks/rewards/train_reward_model.py --out runs/digit_rm
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digit_preference import preference_pairs  # noqa: E402

from lit_parl import tiny_reward_model  # noqa: E402
from lit_parl.tasks import CopyTask  # noqa: E402


def scores(model, tokenizer, texts: list[str]) -> torch.Tensor:
    encoded = tokenizer(texts, return_tensors="pt", padding=True)
    return model(input_ids=encoded.input_ids, attention_mask=encoded.attention_mask).logits[:, 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, tokenizer = tiny_reward_model(seed=args.seed)
    task = CopyTask(seed=10_000)  # prompts of the job's kind, not the run's own draws
    prompts = [task.row(i).prompt for i in range(5000)]
    pairs = preference_pairs(prompts, args.pairs + 2000, args.seed)
    train, held_out = pairs[: args.pairs], pairs[args.pairs :]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.monotonic()
    model.train()
    for step in range(args.steps):
        batch = [train[(step * args.batch + k) % len(train)] for k in range(args.batch)]
        chosen = scores(model, tokenizer, [p + c for p, c, _ in batch])
        rejected = scores(model, tokenizer, [p + r for p, _, r in batch])
        loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 250 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.inference_mode():
        right = sum(
            int(
                (
                    scores(model, tokenizer, [p + c for p, c, _ in chunk])
                    > scores(model, tokenizer, [p + r for p, _, r in chunk])
                ).sum()
            )
            for chunk in (held_out[k : k + 500] for k in range(0, len(held_out), 500))
        )
    print(
        f"held-out pairwise accuracy {right / len(held_out):.3f} over {len(held_out)} pairs; "
        f"trained {args.steps} steps of {args.batch} pairs in {time.monotonic() - start:.0f} s"
    )
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
