"""SGLang section of the device check: launch a server, generate, sync by each method, verify.

Runs where ``import sglang`` works (a GPU box with ``pip install 'lit-parl[sglang]'``); elsewhere it
logs ``skipped`` and exits 0. One server is launched on the tiny Qwen2 policy; then, for each method in
turn (disk, tensor, distributed), the pool syncs new weights as the next version and the check verifies
that the servers confirmed it (``/model_info``'s ``weight_version``), that every group is stamped with it, and that
the sampled tokens' log-probs now match the new weights (computed by the trainer side) and no longer the old ones.

``--launch-command`` runs the same sequence against another server command; the tests use it with the
stand-in (tests/helpers/sglang_standin.py) to check this script on a CPU machine.

On one GPU the server shares it with the trainer, and ``distributed`` is skipped (logged as such): NCCL
refuses two ranks of one group on one device. With two or more GPUs the server runs on GPU 1
(``--base-gpu-id 1``, every GPU visible to it: a CUDA IPC handle opens only on a device the server sees),
so the ``tensor`` method crosses devices (devices named by UUID) and ``distributed`` runs.

    python gpu_check/gpu_check_sglang.py --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gpu_records import log

from lit_parl.models import tiny_qwen2
from lit_parl.rollout import PoolSpec
from lit_parl.rollout.records import GroupRequest, SamplingParams, sample_seed
from lit_parl.rollout.sglang import LaunchSettings, SGLangRolloutPool, SyncSettings
from lit_parl.tasks import CopyTask


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_logprobs(model, prompt, completion, temperature) -> torch.Tensor:
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(completion)], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion, device=device)[:, None])[:, 0].cpu()


def sync_and_generate(pool, method, version, model, previous, tokenizer, task, sampling, tolerance) -> dict:
    """Sync ``model`` as ``version`` by ``method``, generate 16 groups of 8; the record of what was served."""
    pool.sync = dataclasses.replace(pool.sync, method=method)
    t0 = time.monotonic()
    named = list(model.named_parameters())
    pool.sync_weights([named[i : i + 8] for i in range(0, len(named), 8)], version)  # buckets of 8 tensors
    sync_s = time.monotonic() - t0
    requests = []
    for prompt_id in range(16):
        text, _ = task.make(prompt_id)
        requests.append(
            GroupRequest(
                prompt_id=prompt_id,
                prompt_tokens=tuple(tokenizer(text, add_special_tokens=False).input_ids),
                version=version,
                seeds=tuple(sample_seed(0, version, prompt_id, k) for k in range(8)),
            )
        )
    t0 = time.monotonic()
    groups = list(pool.generate(requests, sampling))
    generate_s = time.monotonic() - t0
    by_id = {r.prompt_id: r for r in requests}
    new_diff, old_diff = 0.0, 0.0
    for group in groups:
        for completion, logprobs in zip(group.completions, group.logprobs):
            served = torch.tensor(logprobs)
            prompt = by_id[group.prompt_id].prompt_tokens
            new_diff = max(
                new_diff,
                float((served - trainer_logprobs(model, prompt, completion, sampling.temperature)).abs().max()),
            )
            if previous is not None:
                old_diff = max(
                    old_diff,
                    float((served - trainer_logprobs(previous, prompt, completion, sampling.temperature)).abs().max()),
                )
    versions = sorted({g.version for g in groups})
    ok = (
        versions == [version]
        and len(groups) == 16
        and new_diff < tolerance
        and (previous is None or old_diff > tolerance)
    )
    return {
        "check": f"sglang_sync_{method}",
        "status": "ok" if ok else "FAILED",
        "version": version,
        "group_versions": versions,
        "groups": len(groups),
        "max_abs_logprob_diff_new_weights": round(new_diff, 5),
        "max_abs_logprob_diff_old_weights": round(old_diff, 5) if previous is not None else None,
        "sync_s": round(sync_s, 3),
        "generate_s": round(generate_s, 3),
        "completions_per_s": round(16 * 8 / generate_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    parser.add_argument(
        "--launch-command", nargs="+", default=None, help="server command (default: python -m sglang.launch_server)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=0.1, help="max |log-prob difference| server vs trainer (bf16 kernels)"
    )
    parser.add_argument("--dtype", default="bfloat16", help="the server's --dtype (the stand-in's test: float32)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.launch_command is None and importlib.util.find_spec("sglang") is None:
        log(
            args.out,
            {
                "check": "sglang",
                "status": "skipped",
                "why": "sglang is not importable here (carry its wheels: docs/gpu.md, The GPU check)",
            },
        )
        return
    device = torch.device("cuda" if torch.cuda.is_available() and args.launch_command is None else "cpu")
    models = [tiny_qwen2(seed=s)[0].to(device).eval() for s in range(4)]
    tokenizer = tiny_qwen2()[1]
    task = CopyTask(seed=0)
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8)
    # triton attention takes the tiny model's head size; no CUDA graphs: a faster start for a short check
    server_args = ["--attention-backend", "triton", "--disable-cuda-graph"] if args.launch_command is None else []
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if gpus > 1:
        server_args += ["--base-gpu-id", "1"]
    methods = ["disk", "tensor", "distributed"]
    if gpus == 1:  # NCCL refuses two ranks of one group on one device: the trainer and the server share it here
        methods.remove("distributed")
        log(
            args.out,
            {
                "check": "sglang_sync_distributed",
                "status": "skipped",
                "why": "one GPU: the trainer and the server would be two NCCL ranks on one device",
            },
        )
    pool = SGLangRolloutPool(
        launch=LaunchSettings(
            port=free_port(),
            command=args.launch_command,
            args=server_args,
            mem_fraction_static=0.3 if gpus == 1 else 0.6,
            dtype=args.dtype,
            start_timeout_s=300,
        ),
        sync=SyncSettings(master_port=free_port(), backend="nccl" if device.type == "cuda" else "gloo"),
    )
    model_dir = tempfile.TemporaryDirectory(prefix="gpu_check_sglang_")  # the launched server builds its model here
    models[0].save_pretrained(model_dir.name)
    tokenizer.save_pretrained(model_dir.name)
    started = time.monotonic()
    try:
        pool.start(PoolSpec(model_dir.name, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
        log(args.out, {"check": "sglang_launch", "status": "ok", "seconds": round(time.monotonic() - started, 1)})
        previous = None
        for version, method in enumerate(methods):
            model = models[version + 1]
            try:
                log(
                    args.out,
                    sync_and_generate(
                        pool, method, version, model, previous, tokenizer, task, sampling, args.tolerance
                    ),
                )
                previous = model
            except Exception as error:  # noqa: BLE001 - the other methods still run
                log(
                    args.out,
                    {
                        "check": f"sglang_sync_{method}",
                        "status": "FAILED",
                        "error": repr(error),
                        "traceback": traceback.format_exc()[-3000:],
                    },
                )
    except Exception as error:  # noqa: BLE001 - the check reports, the next section still runs
        log(
            args.out,
            {"check": "sglang", "status": "FAILED", "error": repr(error), "traceback": traceback.format_exc()[-3000:]},
        )
    finally:
        pool.close()
        model_dir.cleanup()


if __name__ == "__main__":
    main()
