"""A short CPU fit under a strategy, run as a script: Lightning's launcher starts the other ranks by running
this file again. Each rank writes what it trained, what its pool received and the final policy to ``--out``.

    python tests/helpers/distributed_fit.py --strategy ddp --devices 2 --out DIR [--mode sync] [--dynamic] [--die RANK]
        [--clip NORM] [--nan-prompt ID] [--save-every-step DIR] [--resume CKPT] [--eval] [--lora]
        [--sglang-port PORT --sglang-journal FILE [--sglang-sync METHOD] [--sglang-gpus GPU ...]
         [--sglang-membership FILE [--sglang-join-at ITERATION LINE]]]

``--strategy`` is one of single (the one-process run on the same global batch), ddp, fsdp2, fsdp (FSDP1) and
deepspeed2/deepspeed3 (ZeRO stages); on the CPU, fsdp and deepspeed go through the subclasses below that lift
Lightning's CUDA-only checks. ``--die RANK`` kills that rank (SIGKILL) at the start of iteration 1, with a
real worker-process pool, to check that the run ends. ``--sglang-port`` trains from one SGLang pool shared by
every rank: rank 0 launches two stand-in servers (``tests/helpers/sglang_standin.py``) on PORT and PORT + 1,
which write what they load and sample to the journal; ``--sglang-sync`` is the weight sync's method;
``--sglang-gpus`` launches SGLang itself instead, one server per GPU named (the GPU check).
``--sglang-per-rank`` gives each rank servers of its own instead (one each, on PORT + 2 x rank), pushed to by
that rank. ``--sglang-membership`` is the pool's membership file; ``--sglang-join-at`` adds a line to it during the
iteration before the one named, so that the server joins at that iteration's push.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import lightning
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_parl import GRPOObjective
from lit_parl.callbacks import HFExport, WeightSync
from lit_parl.rollout import HFRolloutPool, SGLangRolloutPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script, its helpers import as helpers.*
from helpers.components import BatchRecorder, make_components, sgd  # noqa: E402
from helpers.pools import InProcessPool  # noqa: E402


class RecordingPool(InProcessPool):
    """Records each sync's version and the names and shapes of the tensors it received."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = []
        self.initial_dir: dict = {}

    def _start(self, spec):
        config = json.loads((Path(spec.model_dir) / "config.json").read_text())
        self.initial_dir = {
            "files": sorted(p.name for p in Path(spec.model_dir).iterdir()),
            "architectures": config.get("architectures"),
        }
        super()._start(spec)

    def _sync_weights(self, buckets, version):
        received = []

        def recorded():
            for bucket in buckets:
                received.extend((name, list(tensor.shape), type(tensor).__name__) for name, tensor in bucket)
                yield bucket

        super()._sync_weights(recorded(), version)
        self.syncs.append({"version": version, "tensors": received})


class GradNorms(Callback):
    """Each iteration's logged gradient norm (the mean over its optimizer steps, before clipping)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module):
        if "grad_norm" in trainer.callback_metrics:
            self.norms.append(float(trainer.callback_metrics["grad_norm"]))


class PoisonPrompt(Callback):
    """Makes the advantages of one prompt's completions NaN, so that the optimizer step training them is skipped."""

    def __init__(self, prompt_id: int) -> None:
        self.prompt_id = prompt_id

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rows = torch.tensor([prompt_id == self.prompt_id for prompt_id in batch.prompt_ids])
        if batch.pass_index == 0 and bool(rows.any()):
            batch.advantages[rows.to(batch.advantages.device)] = float("nan")


class DieAt(Callback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1 and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


class JoinAt(Callback):
    """Rank 0 adds ``url`` to the pool's membership file during iteration ``iteration - 1``: the server joins at
    the push of iteration ``iteration``. The file is written whole and renamed into place, as a user should."""

    def __init__(self, iteration: int, url: str, file: str) -> None:
        self.iteration, self.url, self.file = iteration, url, Path(file)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == self.iteration - 1 and batch_idx == 0 and trainer.global_rank == 0:
            listed = self.file.read_text() if self.file.exists() else ""
            draft = self.file.with_suffix(".draft")
            draft.write_text(listed + f"{self.url}\n")
            draft.replace(self.file)


class PerRankSGLangPool(SGLangRolloutPool):
    """SGLang servers of this rank's own, as an embedded pool is: each rank launches them and pushes to them (the
    per-rank push the shared pool's benchmark compares with; ``--sglang-per-rank``)."""

    shared_across_ranks = False


class EpochEnds(Callback):
    """When each iteration ended (monotonic seconds): the iteration times, past the first (the pool's start)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.times.append(time.monotonic())


class PoolMembers(Callback):
    """The servers this rank's pool drives when training ends (before the pool is closed)."""

    def __init__(self, pool) -> None:
        self.pool, self.urls = pool, None

    def on_train_end(self, trainer, pl_module):
        self.urls = self.pool.health().details.get("urls")


class CPUFSDPStrategy(lightning.pytorch.strategies.FSDPStrategy):
    """Lightning's FSDP1 strategy on the CPU. Lightning refuses the name 'fsdp' (and FSDPStrategy itself) with
    accelerator='cpu', and its wrapping context passes FSDP ``device_id=None`` there, which torch's FSDP1
    reads as "find an accelerator". torch's FSDP1 runs on the CPU (gloo) given ``device_id=cpu``: this is
    Lightning's context with that one argument; everything else is the strategy's own code."""

    @contextlib.contextmanager
    def model_sharded_context(self):
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import enable_wrap

        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self.kwargs,
        ):
            yield


class CPUDeepSpeedStrategy(lightning.pytorch.strategies.DeepSpeedStrategy):
    """Lightning's DeepSpeed strategy on the CPU (DeepSpeed's CPU accelerator, gloo). Lightning refuses any
    accelerator but CUDA, checks that devices have indices (CPU devices have none) and passes DeepSpeed the
    device's index as its rank (``None`` here): these three are skipped or given the local rank; everything
    else is the strategy's own code and DeepSpeed's."""

    def setup_environment(self) -> None:
        super(lightning.pytorch.strategies.DeepSpeedStrategy, self).setup_environment()  # DDPStrategy's: no CUDA check

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        import deepspeed

        engine, deepspeed_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, deepspeed_optimizer


def held(parameter: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``parameter``: an FSDP2 shard, a ZeRO-3 partition, FSDP1's view, or all of it."""
    if hasattr(parameter, "ds_tensor"):
        return parameter.ds_tensor
    return parameter.to_local() if hasattr(parameter, "to_local") else parameter


def strategy(name: str, devices: int, accelerator: str):
    if name.startswith("deepspeed"):
        stage = int(name[-1])
        if accelerator != "cpu":
            return lightning.pytorch.strategies.DeepSpeedStrategy(stage=stage)
        os.environ["DS_ACCELERATOR"] = "cpu"  # what DeepSpeed would pick without a GPU, said rather than guessed
        return CPUDeepSpeedStrategy(stage=stage, process_group_backend="gloo")
    if name == "fsdp":
        return (
            lightning.pytorch.strategies.FSDPStrategy()
            if accelerator != "cpu"
            else CPUFSDPStrategy(state_dict_type="sharded")
        )
    if name == "ddp":
        return lightning.pytorch.strategies.DDPStrategy()  # gloo on the CPU, NCCL on CUDA
    if name == "fsdp2":
        return lightning.pytorch.strategies.ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
    return "auto"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--strategy", default="single", choices=("single", "ddp", "fsdp2", "fsdp", "deepspeed2", "deepspeed3")
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="async")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--die", type=int, default=None)
    parser.add_argument("--clip", type=float, default=None, help="module.max_grad_norm (default: no clipping)")
    parser.add_argument(
        "--nan-prompt", type=int, default=None, help="NaN advantages for this prompt id: its optimizer step is skipped"
    )
    parser.add_argument(
        "--eval", action="store_true", help="a greedy evaluation of 4 held-out prompts after every iteration"
    )
    parser.add_argument("--save-every-step", default=None, help="a directory: a checkpoint after every optimizer step")
    parser.add_argument("--resume", default=None, help="a checkpoint to resume from")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 4, alpha 8), not the weights")
    parser.add_argument("--sglang-port", type=int, default=None, help="one SGLang pool (stand-ins) for every rank")
    parser.add_argument("--sglang-journal", default=None, help="the stand-ins' journal file")
    parser.add_argument("--sglang-sync", default="tensor", help="the SGLang pool's weight sync method")
    parser.add_argument("--sglang-master-port", type=int, default=None, help="the distributed sync's rendezvous")
    parser.add_argument(
        "--sglang-per-rank", action="store_true", help="each rank launches and pushes to servers of its own"
    )
    parser.add_argument("--sglang-membership", default=None, help="the SGLang pool's membership file")
    parser.add_argument(
        "--sglang-join-at", nargs=2, default=None, metavar=("ITERATION", "LINE"), help="add LINE to the file then"
    )
    parser.add_argument(
        "--sglang-gpus", type=int, nargs="+", default=None, help="real SGLang servers on these GPUs (the GPU check)"
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    objective = GRPOObjective(beta=0.04, dynamic_sampling=args.dynamic)
    if args.sglang_gpus is not None:  # SGLang itself, one server per GPU (the tiny model's head size: triton)
        pool = SGLangRolloutPool(
            launch={
                "num_servers": len(args.sglang_gpus),
                "gpu_ids": args.sglang_gpus,
                "port": args.sglang_port,
                "args": ["--attention-backend", "triton", "--disable-cuda-graph"],
                "start_timeout_s": 300,
            },
            sync={"method": args.sglang_sync, "backend": "nccl", "master_port": args.sglang_master_port or 29650},
        )
    elif args.sglang_port is not None:
        standin = [sys.executable, str(Path(__file__).with_name("sglang_standin.py")), "--journal", args.sglang_journal]
        per_rank = args.sglang_per_rank
        rank = int(os.environ.get("LOCAL_RANK", 0))  # set in the processes Lightning starts; 0 in this one
        pool = (PerRankSGLangPool if per_rank else SGLangRolloutPool)(
            launch={
                "command": standin,
                "num_servers": 2 // args.devices if per_rank else 2,  # two servers in all, either way
                "port": args.sglang_port + 2 * rank if per_rank else args.sglang_port,
                "dtype": "float32",
            },
            servers={"membership_file": args.sglang_membership},
            sync={"method": args.sglang_sync, "backend": "gloo", "master_port": args.sglang_master_port or 29650},
        )
    elif args.die is not None:
        pool = HFRolloutPool(num_workers=1, threads_per_worker=1, prompts_per_request=2, colocated_threads=1)
    else:
        pool = RecordingPool()
    module, datamodule = make_components(
        args.mode,
        pool=pool,
        prompts=8,
        group_size=4,
        micro_batch_size=4,
        mini_batches=2,
        objective=objective,
        **{**sgd(0.5, momentum=0.5), "max_grad_norm": args.clip},
        datamodule_kwargs={"evaluation": {"every_n_iterations": 1, "prompts": 4}} if args.eval else None,
        lora={"rank": 4, "alpha": 8.0} if args.lora else None,
    )
    recorder, norms, sync = BatchRecorder(), GradNorms(), WeightSync()
    callbacks = [sync, recorder, norms, HFExport(dirpath=str(Path(args.out) / "export"))] + (
        [DieAt(args.die)] if args.die is not None else []
    )
    callbacks += [PoisonPrompt(args.nan_prompt)] if args.nan_prompt is not None else []
    members, epoch_ends = PoolMembers(pool), EpochEnds()
    callbacks += [members, epoch_ends]
    if args.sglang_join_at:
        callbacks.append(JoinAt(int(args.sglang_join_at[0]), args.sglang_join_at[1], args.sglang_membership))
    if args.save_every_step:
        callbacks.append(
            ModelCheckpoint(dirpath=args.save_every_step, filename="{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = lightning.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy(args.strategy, args.devices, args.accelerator),
        max_epochs=args.iterations,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=bool(args.save_every_step),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=args.resume)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    policy = {name: tensor for name, tensor in WeightSync().policy_tensors(trainer, module)}  # gathered on every rank
    if rank == 0:
        torch.save(policy, out / "policy.pt")
    record = {
        "world": trainer.world_size,
        "samples": recorder.samples(),
        "syncs": getattr(pool, "syncs", []),
        "initial_dir": getattr(pool, "initial_dir", {}),
        "drawn": datamodule.schedule.cursor,
        "parameter_types": sorted({type(p).__name__ for p in module.parameters()}),
        "policy_numel_held": sum(held(p).numel() for p in module.policy.parameters()),
        "grad_norm": float(trainer.callback_metrics["grad_norm"]),  # the last iteration's, over every rank's gradient
        "grad_norms": norms.norms,
        "skipped_steps": module.guard.skipped_steps,
        "pool_urls": members.urls,
        "iteration_seconds": [b - a for a, b in zip(epoch_ends.times, epoch_ends.times[1:])],
        "sync_seconds": [end - start for start, end in sync.sync_intervals],  # each push, as this rank spent it
        "val": {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("val/")},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():  # left to the interpreter's exit, gloo's threads once aborted it (-6)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
