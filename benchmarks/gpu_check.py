"""Device check for the paths that need an accelerator. Run by benchmarks/gpu_check.sh on the lent GPU.

For each shared-prompt attention backend that can run on the device:
- exactness: packed completion log-probs and parameter gradients, against the `dense` reference and
  against the unpacked per-completion forward;
- speed: the tri-model training step, packed against padded, on the ~50M model.

Then a short end-to-end GRPO fit on the device (the embedded pool generates on CPU) with
`attention_backend=auto`. Everything is written as JSON lines to `$OUT/gpu_check.jsonl` (or
`--out`), and as a summary on stdout. On a CPU-only machine it runs the CPU backends only, which is
how it is tested here.

    python benchmarks/gpu_check.py --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lit_parl.kernels.attention import available_backends
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import pack


def log(out: Path, record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def tiny(config_cls, dtype, device, kv_heads=2, seed=0):
    config = config_cls(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=kv_heads, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").to(device)


def random_groups(vocab, prompt_lengths, completion_lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for P, lengths in zip(prompt_lengths, completion_lengths):
        prompt = torch.randint(3, vocab, (P,), generator=g).tolist()
        groups.append((prompt, [torch.randint(3, vocab, (R,), generator=g).tolist() for R in lengths]))
    return groups


def to_device(tokens, device):
    from lightning.fabric.utilities.apply_func import move_data_to_device

    return move_data_to_device(tokens, device)


def exactness(out: Path, device: torch.device, backend: str) -> None:
    for config_cls in (Qwen2Config, LlamaConfig):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny(config_cls, dtype, device)
            groups = random_groups(97, [17, 64, 5], [[9, 1, 30, 12], [40, 40], [3, 7, 2]])
            packed = to_device(pack(groups, 0, shared_prompt=True), device)
            reference = to_device(pack(groups, 0, shared_prompt=True), device)
            padded = to_device(pack(groups, 0, shared_prompt=False), device)
            packed.attention.backend, reference.attention.backend = backend, "dense"
            weights = torch.randn(packed.completion_mask.shape, device=device) * packed.completion_mask

            def run(tokens):
                model.zero_grad(set_to_none=True)
                logp = completion_logprobs(model, tokens, temperature=0.7)
                (logp * weights).sum().backward()
                return logp.detach().float(), [p.grad.detach().float().clone() for p in model.parameters()]

            lp, grads = run(packed)
            lp_dense, grads_dense = run(reference)
            lp_padded, _ = run(padded)
            mask = packed.completion_mask
            grad_err = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(grads, grads_dense))
            log(out, {
                "check": "exactness", "backend": backend, "model": config_cls.__name__, "dtype": str(dtype),
                "max_abs_logprob_vs_dense": (lp - lp_dense)[mask].abs().max().item(),
                "max_abs_logprob_vs_unpacked": (lp - lp_padded)[mask].abs().max().item(),
                "max_rel_grad_vs_dense": grad_err,
            })


def speed(out: Path, device: torch.device, backend: str, reps: int = 5) -> None:
    from lit_parl import GRPOModule, GRPOObjective, IterationShape
    from lit_parl.trajectory import Trajectory, collate

    config = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    module = GRPOModule(policy, GRPOObjective(beta=0.04), IterationShape(prompts=2, group_size=8, micro_batch_size=8, mini_batches=2), attention_backend=backend).to(device)
    for P, R, G in [(512, 64, 8), (2048, 128, 16), (128, 32, 4)]:
        g = torch.Generator().manual_seed(P + R + G)
        prompt = torch.randint(3, 32000, (P,), generator=g).tolist()
        trajectories = [Trajectory(0, s, 0, prompt, torch.randint(3, 32000, (R,), generator=g).tolist(), [-1.0] * R, 0.0, float(s % 2) - 0.5, False) for s in range(G)]
        results = {}
        for packing in ("padded", "shared_prompt"):
            batch = to_device(collate(trajectories, 0, 0, packing=packing), device)

            def step():
                logp = module.completion_logprobs(module.policy, batch)
                with torch.no_grad():
                    old = module.completion_logprobs(module.old, batch)
                    ref = module.completion_logprobs(module.reference, batch)
                module.objective(logp, old, ref, batch.advantages, batch.completion_mask).loss_sum.backward()
                module.policy.zero_grad(set_to_none=True)

            step()  # warm-up (and compilation for flex)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
            results[packing] = (sorted(times)[len(times) // 2], peak)
        log(out, {
            "check": "speed", "backend": backend, "P": P, "R": R, "G": G, "token_ratio": G * (P + R) / (P + G * R),
            "padded_s": results["padded"][0], "packed_s": results["shared_prompt"][0],
            "speedup": results["padded"][0] / results["shared_prompt"][0],
            "padded_peak_mib": results["padded"][1], "packed_peak_mib": results["shared_prompt"][1],
        })


def end_to_end(out: Path, device: torch.device) -> None:
    import lightning

    from lit_parl import GRPOModule, GRPOObjective, IterationShape, Packing, RolloutDataModule, tiny_qwen2
    from lit_parl.callbacks import RunSummary, WeightSync
    from lit_parl.rollout import HFRolloutPool
    from lit_parl.tasks import CopyTask, positional_reward

    policy, tokenizer = tiny_qwen2(hidden_size=128, intermediate_size=512)
    shape, objective = IterationShape(prompts=32, group_size=8, micro_batch_size=64), GRPOObjective()
    module = GRPOModule(policy, objective, shape, tokenizer=tokenizer, attention_backend="auto")
    data = RolloutDataModule(CopyTask(), [positional_reward], HFRolloutPool(threads_per_worker=4), tokenizer, shape, objective, initial_model=policy,
                             packing=Packing("shared_prompt"), trainer_threads=4)
    summary = RunSummary(dirpath=str(out / "fit"))
    trainer = lightning.Trainer(accelerator=device.type if device.type != "cpu" else "cpu", devices=1, max_epochs=60,
                                callbacks=[WeightSync(), summary], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, default_root_dir=str(out / "fit"))
    trainer.fit(module, datamodule=data)
    log(out, {"check": "end_to_end", "device": device.type, "backend": module._backend, **summary.summary})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(out, {"check": "environment", "device": str(device), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "backends": available_backends(device)})
    steps = [("exactness", b) for b in available_backends(device) if b != "dense"]
    if not args.skip_speed:
        steps += [("speed", b) for b in available_backends(device) if b != "dense"]
    steps.append(("end_to_end", None))
    for name, backend in steps:
        try:
            if name == "exactness":
                exactness(out, device, backend)
            elif name == "speed":
                speed(out, device, backend)
            else:
                end_to_end(out, device)
        except Exception:  # noqa: BLE001 - one failing backend must not hide the others' results
            log(out, {"check": name, "backend": backend, "error": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    main()
