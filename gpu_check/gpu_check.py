"""The kernels and a fit on the device: the first section of ``gpu_check.sh``.

For each shared-prompt attention backend that can run on the device (``gpu_kernels``): float32 exactness for
the backends that take float32, bfloat16 kernels against float32 attention of the same values, the model
under bf16-mixed autocast against the float32 unpacked forward, and the packed step's speed against padded.
Then ``trainer=gpu`` (bf16-mixed, ``attention_backend=auto``) through the CLI's own build, a short fit of the
default job, with and without ``module.gradient_checkpointing``. Every result is a record of the check's
results file (``gpu_records``). On a CPU-only machine the CPU backends run and the fit uses
``trainer.accelerator=cpu`` (with bf16-mixed on the CPU), which is how it is tested here.

    python gpu_check/gpu_check.py --out /tmp/gpu_check [--skip-speed] [--iterations 40]
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from pathlib import Path

import gpu_kernels
import torch
from gpu_records import log

from lit_parl.kernels.backends import HALF_ONLY, available_backends


def preset_fit(out: Path, device: torch.device, iterations: int) -> None:
    """``lit-parl trainer=gpu`` (the hf pool on this machine's CPUs), then with gradient checkpointing."""
    from hydra import compose, initialize_config_module

    from lit_parl.callbacks import RunSummary
    from lit_parl.cli import build

    for checkpointing in (False, True):
        overrides = [
            "trainer=gpu",
            f"iterations={iterations}",
            "trainer.max_time=null",
            "checkpoint_every=0",
            "logger=csv",
            f"run_dir={out / ('fit_checkpointed' if checkpointing else 'fit')}",
            f"module.gradient_checkpointing={str(checkpointing).lower()}",
        ]
        if device.type != "cuda":
            overrides.append("trainer.accelerator=cpu")
        with initialize_config_module(config_module="lit_parl.conf", version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        module, datamodule, trainer = build(cfg)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer.fit(module, datamodule=datamodule)
        summary = next((c.summary for c in trainer.callbacks if isinstance(c, RunSummary)), {})
        dtypes = sorted(
            {
                str(p.dtype)
                for m in (module.policy, module.old, module.reference)
                if m is not None
                for p in m.parameters()
            }
        )
        ok = (
            str(trainer.precision) == "bf16-mixed"
            and dtypes == ["torch.float32"]
            and trainer.current_epoch == iterations
        )
        log(
            out,
            {
                "check": f"fit_trainer_gpu{'_checkpointed' if checkpointing else ''}",
                "status": "ok" if ok else "FAILED",
                "precision": str(trainer.precision),
                "attention_backend": module._backend,
                "weight_dtypes": dtypes,
                "iterations": trainer.current_epoch,
                "wall_s": round(time.perf_counter() - start, 1),
                "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
                **{k: summary.get(k) for k in ("reward_first", "reward_last10", "completions_per_s")},
            },
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_check_out"))
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--iterations", type=int, default=40, help="iterations of each preset fit")
    args = parser.parse_args()
    out = Path(args.out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = [b for b in available_backends(device) if b != "dense"]
    log(
        out,
        {
            "check": "environment",
            "status": "ok",
            "device": str(device),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "backends": backends,
        },
    )
    steps = [(gpu_kernels.float32_exactness, b) for b in backends if b not in HALF_ONLY]
    steps += [(check, b) for check in (gpu_kernels.bfloat16_kernels, gpu_kernels.bfloat16_model) for b in backends]
    if not args.skip_speed:
        steps += [(gpu_kernels.speed, b) for b in backends]
    for check, backend in steps:
        try:
            check(out, device, backend)
        except Exception:  # noqa: BLE001 - one failing backend must not hide the others' results
            log(
                out,
                {"check": f"{check.__name__}_{backend}", "status": "FAILED", "error": traceback.format_exc()[-2000:]},
            )
    try:
        preset_fit(out, device, args.iterations)
    except Exception:  # noqa: BLE001
        log(out, {"check": "fit_trainer_gpu", "status": "FAILED", "error": traceback.format_exc()[-2000:]})


if __name__ == "__main__":
    main()
