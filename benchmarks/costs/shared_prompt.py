"""Shared-prompt packing vs one padded row per completion: training-step time and peak memory.

Each step is the trainer's work on one micro-batch of one group: the tri-model forward (policy with
gradient, old and reference without), the GRPO loss with β > 0, and the backward pass. The two
layouts are measured side by side, interleaved, in one process. Each speedup is printed beside the
token-count ratio G·(P+R)/(P+G·R). `auto` is what `datamodule.packing.mode=auto` would choose.

Peak memory is the rise of the process's peak resident set during the step (Linux: the peak is reset
through /proc/self/clear_refs). The log-prob memory columns are analytic, for a 151,936-token
vocabulary: the float32 logits that a plain `model(...).logits` + `log_softmax` keeps for every
position, against the `chunk × V` block of `linear_token_logprobs`.

    .venv/bin/python benchmarks/costs/shared_prompt.py                     # both models, the full grid (~25 min here)
    .venv/bin/python benchmarks/costs/shared_prompt.py --models tiny --reps 3
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from lit_parl import GRPOModule, GRPOObjective, IterationShape
from lit_parl.data.micro_batch import Trajectory, collate

MODELS = {
    # the embedded default's size
    "tiny": dict(
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=53,
    ),
    # ~50M parameters (tied embeddings), grouped-query attention
    "50m": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
}
VOCAB_150K = 151_936


def build(kind: str) -> GRPOModule:
    config = Qwen2Config(**MODELS[kind], tie_word_embeddings=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    # β > 0 and two mini-batches: old and reference both run, the full tri-model
    return GRPOModule(
        policy,
        GRPOObjective(beta=0.04),
        IterationShape(prompts=2, group_size=8, micro_batch_size=8, mini_batches=2),
        attention_backend="sdpa",
    )


def group(P: int, R: int, G: int, vocab: int, seed: int) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (P,), generator=generator).tolist()
    return [
        Trajectory(
            0,
            s,
            0,
            prompt,
            torch.randint(3, vocab, (R,), generator=generator).tolist(),
            [-1.0] * R,
            float(s % 2),
            float(s % 2) - 0.5,
            False,
        )
        for s in range(G)
    ]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _rss_kib("VmRSS:")


def train_step(module: GRPOModule, batch) -> None:
    logp = module.completion_logprobs(module.policy, batch)
    with torch.no_grad():
        old = module.completion_logprobs(module.old, batch)
        ref = module.completion_logprobs(module.reference, batch)
    terms = module.objective(logp, old, ref, batch.advantages, batch.completion_mask)
    terms.loss_sum.backward()
    module.policy.zero_grad(set_to_none=True)


def measure(module: GRPOModule, batch, reps: int) -> tuple[float, float]:
    """Median seconds of ``reps`` steps and the peak RSS rise (MiB) of the first."""
    times, peak = [], 0.0
    for rep in range(reps):
        base = _reset_peak()
        start = time.perf_counter()
        train_step(module, batch)
        times.append(time.perf_counter() - start)
        if rep == 0:
            peak = (_rss_kib("VmHWM:") - base) / 1024
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,50m")
    parser.add_argument("--prompt-lengths", default="128,512,2048")
    parser.add_argument("--completion-lengths", default="32,128")
    parser.add_argument("--group-sizes", default="4,8,16")
    parser.add_argument("--extra", default="50m:512:64:8", help="extra model:P:R:G configurations, comma-separated")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    grid = [
        (model, P, R, G)
        for model in args.models.split(",")
        for P, R, G in itertools.product(
            map(int, args.prompt_lengths.split(",")),
            map(int, args.completion_lengths.split(",")),
            map(int, args.group_sizes.split(",")),
        )
    ]
    for extra in filter(None, args.extra.split(",")):
        model, P, R, G = extra.split(":")
        if model in args.models.split(","):
            grid.append((model, int(P), int(R), int(G)))

    print(f"threads={args.threads} reps={args.reps} torch={torch.__version__}")
    header = (
        f"{'model':>5} {'P':>5} {'R':>4} {'G':>3} | {'token ratio':>11} | "
        f"{'padded s':>9} {'packed s':>9} {'speedup':>7} | "
        f"{'auto':>6} {'auto/padded':>11} | {'padded MiB':>10} {'packed MiB':>10} | "
        f"{'logits GiB (150k)':>17} {'chunked MiB':>11}"
    )
    print(header)
    print("-" * len(header))
    modules, warmed = {}, set()
    for model, P, R, G in grid:
        module = modules.get(model) or modules.setdefault(model, build(model))
        trajectories = group(P, R, G, module.policy.config.vocab_size, seed=P * 31 + R * 7 + G)
        padded = collate(trajectories, 0, 0, packing="padded")
        packed = collate(trajectories, 0, 0, packing="shared_prompt")
        auto_packs = collate(trajectories, 0, 0, packing="auto").tokens.attention is not None
        if model not in warmed:  # first use of a model: allocator and kernels warm up on this config
            train_step(module, packed)
            train_step(module, padded)
            warmed.add(model)
        t_packed, m_packed = measure(module, packed, args.reps)
        t_padded, m_padded = measure(module, padded, args.reps)
        ratio = G * (P + R) / (P + G * R)
        t_auto = t_packed if auto_packs else t_padded
        logits_gib = G * (P + R) * VOCAB_150K * 4 / 2**30  # model(...).logits in float32 at every position
        chunk_mib = min(1024, G * R) * VOCAB_150K * 4 / 2**20
        print(
            f"{model:>5} {P:>5} {R:>4} {G:>3} | {ratio:>11.2f} | "
            f"{t_padded:>9.3f} {t_packed:>9.3f} {t_padded / t_packed:>6.2f}x | "
            f"{'packed' if auto_packs else 'padded':>6} {t_padded / t_auto:>10.2f}x | "
            f"{m_padded:>10.0f} {m_packed:>10.0f} | "
            f"{logits_gib:>17.2f} {chunk_mib:>11.0f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
