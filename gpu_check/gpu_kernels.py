"""The kernel checks of the GPU check (``gpu_check.py``): shared-prompt attention exact against references, and
the packed step against the padded one. Each function logs records (``gpu_records.log``) with a ``status``.

- ``float32_exactness``: backends that take float32 (sdpa, flex, dense): packed log-probs and gradients
  against the ``dense`` reference and the unpacked forward (bounds: 1e-4 nats, 1e-3 relative gradient).
- ``bfloat16_kernels``: each backend on bfloat16 q/k/v against float32 attention of the same bf16 values
  (bound: 2e-2 of the largest output), two head layouts (GQA 8/2 x 64, MHA 4/4 x 128).
- ``bfloat16_model``: the model's log-probs and gradients under bf16-mixed autocast, packed, against the
  float32 unpacked forward (bounds: mean 0.05, max 0.25 nats per token: bfloat16's own error).
- ``speed``: the tri-model step, packed against padded, on a 50M model in bfloat16 (a measurement: ``ok``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_records import log
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from lit_parl.kernels.attention import shared_prompt_attention
from lit_parl.kernels.forward import completion_logprobs
from lit_parl.kernels.packing import dense_allowed, pack

MODELS = (Qwen2Config, LlamaConfig)
GROUPS = ([17, 64, 5, 300], [[9, 1, 30, 12], [40, 40], [3, 7, 2], [128] * 8])  # prompt lengths, completion lengths


def tiny(config_cls, dtype, device, kv_heads=2, seed=0):
    config = config_cls(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
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


def _logprobs_and_grads(model, tokens, weights, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast(tokens.input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        logp = completion_logprobs(model, tokens, temperature=0.7)
    (logp * weights).sum().backward()
    return logp.detach().float(), [p.grad.detach().float().clone() for p in model.parameters()]


def _relative_grad_error(grads, reference) -> float:
    return max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(grads, reference))


def float32_exactness(out: Path, device: torch.device, backend: str) -> None:
    groups = random_groups(97, *GROUPS)
    for config_cls in MODELS:
        model = tiny(config_cls, torch.float32, device)
        packed, reference = (to_device(pack(groups, 0, shared_prompt=True), device) for _ in range(2))
        padded = to_device(pack(groups, 0, shared_prompt=False), device)
        packed.attention.backend, reference.attention.backend = backend, "dense"
        weights = torch.randn(packed.completion_mask.shape, device=device) * packed.completion_mask
        lp, grads = _logprobs_and_grads(model, packed, weights, autocast=False)
        lp_dense, grads_dense = _logprobs_and_grads(model, reference, weights, autocast=False)
        lp_padded, _ = _logprobs_and_grads(model, padded, weights, autocast=False)
        mask = packed.completion_mask
        vs_dense, vs_unpacked = (lp - lp_dense)[mask].abs().max().item(), (lp - lp_padded)[mask].abs().max().item()
        grad_error = _relative_grad_error(grads, grads_dense)
        log(
            out,
            {
                "check": f"float32_exactness_{backend}_{config_cls.__name__}",
                "max_abs_logprob_vs_dense": vs_dense,
                "max_abs_logprob_vs_unpacked": vs_unpacked,
                "max_rel_grad_vs_dense": grad_error,
                "status": "ok" if max(vs_dense, vs_unpacked) <= 1e-4 and grad_error <= 1e-3 else "FAILED",
            },
        )


def bfloat16_kernels(out: Path, device: torch.device, backend: str) -> None:
    groups = random_groups(97, *GROUPS)
    layout = to_device(pack(groups, 0, shared_prompt=True, max_row_tokens=700), device).attention
    layout.backend = backend
    B, L = layout.segment_ids.shape
    real = layout.segment_ids >= 0
    g = torch.Generator(device=device).manual_seed(0)
    for H, Hkv, D in ((8, 2, 64), (4, 4, 128)):
        q = (torch.randn(B, H, L, D, device=device, generator=g) * 2).bfloat16()
        k = (torch.randn(B, Hkv, L, D, device=device, generator=g) * 2).bfloat16()
        v = torch.randn(B, Hkv, L, D, device=device, generator=g).bfloat16()
        expand = lambda t: t.float().repeat_interleave(H // Hkv, 1)  # noqa: E731
        ref = F.scaled_dot_product_attention(
            q.float(), expand(k), expand(v), attn_mask=dense_allowed(layout), scale=D**-0.5
        ).transpose(1, 2)
        scale = ref[real].abs().max().item()
        got, _ = shared_prompt_attention(None, q, k, v, None, scaling=D**-0.5, shared_prompt=layout)
        error = (got.float() - ref)[real].abs().max().item()
        log(
            out,
            {
                "check": f"bfloat16_kernel_{backend}_h{H}kv{Hkv}d{D}",
                "output_dtype": str(got.dtype),
                "max_abs_vs_f32": error,
                "ref_max_abs": scale,
                "status": "ok" if got.dtype == torch.bfloat16 and error <= 2e-2 * scale else "FAILED",
            },
        )


def bfloat16_model(out: Path, device: torch.device, backend: str) -> None:
    groups = random_groups(97, *GROUPS)
    for config_cls in MODELS:
        model = tiny(config_cls, torch.float32, device)
        padded = to_device(pack(groups, 0, shared_prompt=False), device)
        weights = torch.randn(padded.completion_mask.shape, device=device) * padded.completion_mask
        expected, expected_grads = _logprobs_and_grads(model, padded, weights, autocast=False)
        packed = to_device(pack(groups, 0, shared_prompt=True), device)
        packed.attention.backend = backend
        logp, grads = _logprobs_and_grads(model, packed, weights, autocast=True)
        error = (logp - expected)[padded.completion_mask].abs()
        log(
            out,
            {
                "check": f"bf16_mixed_model_{backend}_{config_cls.__name__}",
                "mean_abs_logprob_vs_f32_unpacked": error.mean().item(),
                "max_abs_logprob_vs_f32_unpacked": error.max().item(),
                "max_rel_grad_vs_f32_unpacked": _relative_grad_error(grads, expected_grads),
                "status": "ok" if error.mean().item() <= 0.05 and error.max().item() <= 0.25 else "FAILED",
            },
        )


def speed(out: Path, device: torch.device, backend: str, reps: int = 5) -> None:
    from lit_parl import GRPOModule, GRPOObjective, IterationShape
    from lit_parl.data.micro_batch import Trajectory, collate

    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").to(device)
    shape = IterationShape(prompts=2, group_size=8, micro_batch_size=8, mini_batches=2)
    module = GRPOModule(policy, GRPOObjective(beta=0.04), shape, attention_backend=backend).to(device)
    for P, R, G in [(512, 64, 8), (2048, 128, 16), (128, 32, 4)]:
        g = torch.Generator().manual_seed(P + R + G)
        prompt = torch.randint(3, 32000, (P,), generator=g).tolist()
        trajectories = [
            Trajectory(
                0,
                s,
                0,
                prompt,
                torch.randint(3, 32000, (R,), generator=g).tolist(),
                [-1.0] * R,
                0.0,
                float(s % 2) - 0.5,
                False,
            )
            for s in range(G)
        ]
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
        log(
            out,
            {
                "check": f"speed_{backend}_P{P}_R{R}_G{G}",
                "status": "ok",
                "token_ratio": G * (P + R) / (P + G * R),
                "padded_s": results["padded"][0],
                "packed_s": results["shared_prompt"][0],
                "speedup": results["padded"][0] / results["shared_prompt"][0],
                "padded_peak_mib": results["padded"][1],
                "packed_peak_mib": results["shared_prompt"][1],
            },
        )
