"""A short CPU fit from real SGLang servers that the caller started, run as a script (Lightning's launcher starts
the other ranks by running this file again), or the same fit replayed from what such a fit sampled.

    python tests/helpers/real_sglang_fit.py --out DIR --urls URL ... [--devices 2] [--router-port PORT]
        [--sync METHOD] [--membership FILE --join-at ITERATION LINE] [--kill URL PGID ITERATION N]
    python tests/helpers/real_sglang_fit.py --out DIR --replay DIR

Real SGLang on the CPU does not honour per-sample seeds (it refuses --enable-deterministic-inference there), so
two fits from the servers draw different samples. Each rank therefore writes every group it received
(``groups``) beside what it trained (``samples``) and the final policy (``policy.pt``, rank 0); ``--replay``
trains one process on the groups another fit's ranks received, with no server: the run to compare weights with.
The on-policy check runs at the float32 bound in both, so a replayed group also proves that the replaying
trainer's θ_k is the one the servers sampled from.

``--kill URL PGID ITERATION N`` SIGKILLs the server's process group just before the N-th ``/generate`` sent to
URL while the pool holds version ITERATION (earlier requests to it may still be in flight); its shared-memory
files, which a killed server cannot remove, are removed after it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections import Counter
from pathlib import Path

import lightning
import torch

from lit_parl import GRPOObjective
from lit_parl.callbacks import WeightSync
from lit_parl.rollout import RolloutPool, SGLangRolloutPool
from lit_parl.rollout.records import GroupCompletions
from lit_parl.rollout.rollout_pool import FP32_LOGPROB_TOLERANCE
from lit_parl.rollout.sglang.client import HTTPClient
from lit_parl.rollout.sglang.servers import sglang_shm_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: run as a script, its helpers import as helpers.*
from helpers.components import BatchRecorder, make_components, sgd  # noqa: E402
from helpers.distributed_fit import JoinAt, PoolMembers  # noqa: E402


def as_record(group: GroupCompletions) -> dict:
    return {
        "prompt_id": group.prompt_id,
        "version": group.version,
        "sample_indices": list(group.sample_indices),
        "completions": group.completions,
        "logprobs": group.logprobs,
        "finish_reasons": group.finish_reasons,
    }


class RecordingSGLangPool(SGLangRolloutPool):
    """The SGLang pool, keeping every group it hands to the trainer (with ``--lora``, its default ``sync.lora``:
    the adapters merged into full weights)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.received: list[dict] = []

    def _generate(self, requests, sampling):
        for group in super()._generate(requests, sampling):
            self.received.append(as_record(group))
            yield group


class ReplayPool(RolloutPool):
    """Serves the groups another fit received, by (version, prompt id): that fit's samples, without a server."""

    backend = "replay"

    def __init__(self, groups: list[dict]) -> None:
        super().__init__()
        self.groups = {(g["version"], g["prompt_id"]): g for g in groups}
        assert len(self.groups) == len(groups), "a group was received twice"

    def _start(self, spec) -> None:
        pass

    def _sync_weights(self, buckets, version: int) -> None:
        for _ in buckets:  # read, as a pool must; the weights themselves are the trainer's to prove (on-policy check)
            pass

    def _generate(self, requests, sampling):
        for request in requests:
            g = self.groups[(request.version, request.prompt_id)]
            yield GroupCompletions(
                g["prompt_id"], g["version"], g["sample_indices"], g["completions"], g["logprobs"], g["finish_reasons"]
            )

    def logprob_tolerance(self) -> float:
        return FP32_LOGPROB_TOLERANCE

    def _worker_counts(self) -> tuple[int, int]:
        return (1, 1)

    def _close(self) -> None:
        pass


def journal_generates(pool: SGLangRolloutPool, kill: list[str] | None) -> Counter:
    """Counts each ``/generate`` sent, by (url, version the pool held); with ``kill``, kills that server on time."""
    sent: Counter = Counter()
    original = HTTPClient._request

    async def _request(self, method, url, payload, timeout):
        if url.endswith("/generate"):
            server = url[: -len("/generate")]
            sent[(server, pool.version)] += 1
            if (
                kill
                and server == kill[0]
                and pool.version == int(kill[2])
                and sent[(server, pool.version)] == int(kill[3])
            ):
                pgid = int(kill[1])
                files = sglang_shm_files([pgid])
                os.killpg(pgid, signal.SIGKILL)
                for path in files:
                    path.unlink(missing_ok=True)
        return await original(self, method, url, payload, timeout)

    HTTPClient._request = _request
    return sent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--urls", nargs="+", default=None, help="running SGLang servers")
    parser.add_argument("--router-port", type=int, default=None, help="rank 0 launches sglang_router there")
    # disk: a tensor sync on the CPU leaves torch_shm_manager running (holding the caller's output pipe) while
    # servers that mapped its files live on, and these servers outlive the fit
    parser.add_argument("--sync", default="disk")
    parser.add_argument("--membership", default=None)
    parser.add_argument("--join-at", nargs=2, default=None, metavar=("ITERATION", "LINE"))
    parser.add_argument("--kill", nargs=4, default=None, metavar=("URL", "PGID", "ITERATION", "N"))
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (rank 4), synced merged")
    parser.add_argument("--replay", default=None, help="a fit's --out: train on the groups its ranks received")
    args = parser.parse_args()

    torch.manual_seed(0)
    sent: Counter = Counter()
    if args.replay:
        groups = [
            g for path in sorted(Path(args.replay).glob("rank*.json")) for g in json.loads(path.read_text())["groups"]
        ]
        pool = ReplayPool(groups)
    else:
        pool = RecordingSGLangPool(
            servers={"urls": args.urls, "deterministic_inference": False, "membership_file": args.membership},
            router={"enabled": args.router_port is not None, "port": args.router_port or 30100},
            sync={"method": args.sync},
        )
        sent = journal_generates(pool, args.kill)
    module, datamodule = make_components(
        "async",
        pool=pool,
        prompts=8,
        group_size=4,
        micro_batch_size=4,
        mini_batches=2,
        objective=GRPOObjective(beta=0.04),
        **sgd(0.5, momentum=0.5),
        datamodule_kwargs={"logprob_tolerance": FP32_LOGPROB_TOLERANCE, "gate_timeout_s": 300},
        lora={"rank": 4, "alpha": 8.0} if args.lora else None,
    )
    recorder, members = BatchRecorder(), PoolMembers(pool)
    callbacks = [WeightSync(), recorder, members]
    if args.join_at:
        callbacks.append(JoinAt(int(args.join_at[0]), args.join_at[1], args.membership))
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.iterations,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.policy.state_dict().items()}, out / "policy.pt")
    record = {
        "world": trainer.world_size,
        "samples": recorder.samples(),
        "groups": getattr(pool, "received", []),
        "generates": [[url, version, n] for (url, version), n in sent.items()],
        "pool_urls": members.urls,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
