"""Pushing the trainer's weights to SGLang servers, bucket by bucket, by one of three methods.

Every sync is wrapped the same way: ``/pause_generation``, the update, ``/flush_cache``, then the version
every server reports (``weight_version`` of ``/model_info``; every server must report the new version, or
the sync fails) and ``/continue_generation``. Current SGLang refuses tensor and distributed updates outside
a weight-update session, so those run between ``/begin_weight_update`` and ``/end_weight_update``. A
server without those routes (an SGLang from before them, told by its 404, never guessed) takes the updates
as they come and reports its version at ``/get_weight_version``. The methods (``SyncSettings.method``):

- ``tensor``: ``/update_weights_from_tensor`` per bucket, the tensors passed as CUDA IPC handles (or
  shared-memory files for CPU tensors), pickled once per tensor-parallel rank of each server, devices
  named by UUID (``weight_transfer.send_cuda_devices_by_uuid``): trainer and servers on one node.
- ``distributed``: ``/init_weights_update_group`` once, then ``/update_weights_from_distributed`` per
  bucket while the trainer broadcasts it over NCCL: servers on other nodes.
- ``disk``: each bucket written as a safetensors shard in ``sync_dir`` (which every server must see),
  an index beside them, then one ``/update_weights_from_disk``.

Buckets are read on the caller's thread (a sharded trainer gathers each one with collectives there) and
each is sent before the next is read, so the producer may reuse its memory. Every update carries the new
``weight_version``: a server may report it before its last bucket is in, but generation is paused
meanwhile, and the pool holds no confirmed version until every server reported it after the last one.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

from lit_parl.rollout.rollout_pool import WeightBucket
from lit_parl.rollout.sglang.client import HTTPClient, RouteNotFound
from lit_parl.rollout.sglang.fanout import ServerFanout
from lit_parl.rollout.sglang.servers import Server
from lit_parl.rollout.sglang.settings import SYNC_METHODS, SyncSettings
from lit_parl.rollout.shm_manager import ShmManager
from lit_parl.rollout.weight_transfer import (
    BroadcastAbandoned,
    broadcast_from_trainer,
    init_weight_update_group,
    save_shard,
    serialize_named_tensors,
)


class WeightUpdater:
    """The weight side of an SGLang pool: the three update methods and the weight-update process group.

    Args:
        client: the pool's HTTP client.
        model_dir: the model directory whose ``config.json`` goes beside disk checkpoints.
        sync_dir: the root of the ``disk`` checkpoints (``version_<k>`` below it).
        tp_size: tensor-parallel ranks per server (each gets its share of a ``tensor`` update).
        settings: where the ``distributed`` method's process group meets, its backend and its name (the trainer
            is rank 0 and hosts the rendezvous); the method is each ``sync``'s own.
    """

    def __init__(
        self, client: HTTPClient, model_dir: str | Path, sync_dir: str | Path, tp_size: int, settings: SyncSettings
    ) -> None:
        self.client = client
        self.model_dir = Path(model_dir)
        self.sync_dir = Path(sync_dir)
        self.tp_size = tp_size
        self.dist = (settings.master_address, settings.master_port, settings.backend)
        self.group_name = settings.group_name
        self.group = None  # the weight-update process group, once the distributed method built it
        self.shm = ShmManager()  # the manager CPU tensors' pickles name: the pool's, gone when it closes
        self.abandoned = False  # a refused update left a broadcast pending in the group
        self.fanout = ServerFanout()  # the pool sets its `lose`: which servers that fail a call leave the push

    def sync(
        self, method: str, servers: list[Server], everyone: list[Server], buckets: Iterable[WeightBucket], version: int
    ) -> None:
        """Load ``buckets`` as ``version`` on the live ``servers`` (of ``everyone`` the pool drives); confirm it."""
        if method not in SYNC_METHODS:
            raise ValueError(f"SyncSettings(method={method!r}): choose one of {SYNC_METHODS}")
        if not servers:
            raise RuntimeError(f"no live SGLang server to sync version {version} to; down: {[s.url for s in everyone]}")
        if method == "distributed" and self.abandoned:
            raise RuntimeError(
                "a refused distributed update left the weight-update group unusable: restart the servers and resume "
                "from the last checkpoint"
            )
        if method == "distributed" and self.group is not None and len(servers) < len(everyone):
            # a broadcast to a group with a dead member would hang until the NCCL timeout
            down = [s.url for s in everyone if not s.alive]
            raise RuntimeError(
                f"SGLang server(s) {down} left the weight-update group: the distributed sync cannot go on. Resume "
                "from the last checkpoint with the servers restarted, or use SyncSettings(method='disk'), which "
                "tolerates losing a server"
            )
        run = self.client.run
        run(self.fanout.each(servers, lambda s: self.client.post(s.url, "/pause_generation", {})))
        if method == "distributed" and self.group is None:
            self._init_group(servers, everyone)
        shards: dict[str, str] = {}
        out = self.sync_dir / f"version_{version}"
        if method == "disk":
            shutil.rmtree(out, ignore_errors=True)  # shards of a failed attempt at this version must not mix in
        fields = {"weight_version": str(version), "flush_cache": False}  # the wrap flushes once, after the last
        opened = run(self._open_sessions(servers)) if method != "disk" else []
        sent = 0
        try:
            for sent, bucket in enumerate(buckets, start=1):
                if method == "tensor":
                    self._send_tensors(servers, bucket, fields)
                elif method == "distributed":
                    self._broadcast(servers, bucket, fields)
                else:
                    shards.update(save_shard(bucket, out, f"model-{sent:05d}.safetensors"))
        except BaseException:
            run(self._close_quietly(opened))  # a server left in a session refuses the next one; the error is the sync's
            raise
        run(self.fanout.each(opened, self._end))
        if not sent:
            raise ValueError("sync_weights got no buckets: nothing to load")
        if method == "disk":
            self._load_from_disk(servers, out, shards, version)
        run(self._confirm(servers, version))

    def _send_tensors(self, servers: list[Server], bucket: WeightBucket, fields: dict) -> None:
        # CPU tensors travel as shared-memory files that close with their last reader: send fresh copies,
        # alive until every server has answered (CUDA tensors travel as IPC handles, uncopied)
        shared = [(name, t.detach() if t.is_cuda else t.detach().clone()) for name, t in bucket]

        def payload() -> dict:
            # one payload per tensor-parallel rank of each server, each pickled on its own: every rank unpickles
            # only its own (SGLang's TpModelWorker.deserialize_own_rank), and a CUDA IPC handle is counted per
            # unpickling
            payloads = [serialize_named_tensors(shared, self.shm) for _ in range(self.tp_size)]
            return {"serialized_named_tensors": payloads, **fields}

        self.client.run(self.fanout.each(servers, lambda s: self._update(s, "/update_weights_from_tensor", payload())))

    def _broadcast(self, servers: list[Server], bucket: WeightBucket, fields: dict) -> None:
        payload = {
            "names": [name for name, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": self.group_name,
            **fields,
        }
        # the servers receive while this thread sends: the requests go first, the broadcast meets them
        update = "/update_weights_from_distributed"
        updates = self.client.submit(self.fanout.each(servers, lambda s: self._update(s, update, payload)))

        def refused() -> BaseException | None:  # a server that fails its request will not join the broadcast
            error = updates.exception() if updates.done() else None
            return None if error is None else RuntimeError(f"the distributed weight update was refused: {error}")

        try:
            broadcast_from_trainer(self.group, [t.detach() for _, t in bucket], refused)
        except BroadcastAbandoned:
            self.abandoned = True  # a broadcast is left pending in the group: it cannot serve another sync
            updates.cancel()
            raise
        except BaseException:
            updates.cancel()
            raise
        updates.result()

    def _init_group(self, servers: list[Server], everyone: list[Server]) -> None:
        address, port, backend = self.dist
        world_size = 1 + self.tp_size * len(everyone)
        body = {
            "master_address": address,
            "master_port": port,
            "world_size": world_size,
            "group_name": self.group_name,
            "backend": backend,
        }

        def join(server: Server):
            offset = 1 + self.tp_size * everyone.index(server)  # rank 0 is the trainer
            return self._update(server, "/init_weights_update_group", {**body, "rank_offset": offset})

        joined = self.client.submit(self.fanout.each(servers, join))
        try:
            self.group = init_weight_update_group(address, port, 0, world_size, self.group_name, backend)
        except BaseException:
            joined.cancel()
            raise
        joined.result()

    def _load_from_disk(self, servers: list[Server], out: Path, shards: dict[str, str], version: int) -> None:
        config = self.model_dir / "config.json"
        if config.exists():
            shutil.copy(config, out / "config.json")
        # the standard index of a sharded checkpoint: every loader reads exactly the shards it names
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
        payload = {"model_path": str(out), "weight_version": str(version), "flush_cache": True}
        self.client.run(self.fanout.each(servers, lambda s: self._update(s, "/update_weights_from_disk", payload)))
        for old in self.sync_dir.glob("version_*"):  # keep only the weights the servers now hold
            if old != out:
                shutil.rmtree(old, ignore_errors=True)

    async def _open_sessions(self, servers: list[Server]) -> list[Server]:
        """Open a weight-update session on each server that has them; return those. If one fails, the ones
        opened are closed before the error is raised."""
        results = await asyncio.gather(*(self.fanout.guarded(self._begin, s) for s in servers), return_exceptions=True)
        opened = [s for s, result in zip(servers, results) if result is True]
        failed = [result for result in results if isinstance(result, BaseException)]
        self.fanout.leave(servers, results)
        if failed:
            await self._close_quietly(opened)
            raise failed[0]
        return opened

    async def _begin(self, server: Server) -> bool:
        """Open ``server``'s weight-update session; ``False``: it has none to open (an SGLang before sessions).

        A refused ``begin`` is taken for a session left open (by a trainer that stopped in the middle of a
        sync): it is closed once and opened again. Generation is paused, and every weight is sent anew.
        """
        try:
            await self._update(server, "/begin_weight_update", {})
        except RouteNotFound:
            return False
        except RuntimeError:
            await self._end(server)
            await self._update(server, "/begin_weight_update", {})
        return True

    async def _end(self, server: Server, timeout: float | None = None) -> None:
        answer = await self.client.post(server.url, "/end_weight_update", {}, timeout=timeout)
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise RuntimeError(f"{server.url}/end_weight_update failed: {answer}")

    async def _close_quietly(self, servers: list[Server]) -> None:
        """After a failed sync: close the sessions, briefly and without hiding the sync's own error."""
        await asyncio.gather(*(self._end(s, timeout=10.0) for s in servers), return_exceptions=True)

    async def reported_version(self, server: Server) -> str | None:
        """The weight version ``server`` reports: ``/model_info``'s ``weight_version``, or, on an SGLang without
        it (the field or the route missing), ``/get_weight_version``'s."""
        try:
            info = await self.client.get(server.url, "/model_info")
        except RouteNotFound:
            info = None
        if isinstance(info, dict) and "weight_version" in info:
            return info["weight_version"]
        answer = await self.client.get(server.url, "/get_weight_version")
        return answer.get("weight_version") if isinstance(answer, dict) else answer

    async def _confirm(self, servers: list[Server], version: int) -> None:
        await self.fanout.each(servers, lambda s: self.client.post(s.url, "/flush_cache", {}))
        await self._check_reported(servers, version)
        await self.fanout.each(servers, lambda s: self.client.post(s.url, "/continue_generation", {}))

    def check_reported(self, servers: list[Server], version: int) -> None:
        """Raise unless every one of ``servers`` reports ``version`` (a sync another rank's pool made)."""
        self.client.run(self._check_reported(servers, version))

    async def _check_reported(self, servers: list[Server], version: int) -> None:
        reported = await self.fanout.each(servers, self.reported_version)
        wrong = [(s.url, got) for s, got in zip(servers, reported) if got != str(version)]
        if wrong:
            raise RuntimeError(
                f"weight sync to version {version} was not confirmed: the servers reported {wrong} "
                "(url, weight_version). Refusing to generate with unknown weights."
            )

    async def _update(self, server: Server, path: str, payload: dict) -> None:
        answer = await self.client.post(server.url, path, payload)
        if not isinstance(answer, dict) or not answer.get("success", False):
            raise RuntimeError(f"{server.url}{path} failed: {answer}")

    def close(self, servers: list[Server]) -> None:
        """Leave the weight-update group: the live ``servers`` destroy their side first (an attached server
        outlives this pool, and would otherwise keep the group's communicator), then the trainer."""
        self.shm.stop()  # the manager the tensor updates named: an attached server would keep it alive
        if self.group is not None:
            payload = {"group_name": self.group_name}

            async def destroy_each():  # quietly: a server may be gone already
                destroy = "/destroy_weights_update_group"
                calls = (self.client.post(s.url, destroy, payload, timeout=10.0) for s in servers)
                await asyncio.gather(*calls, return_exceptions=True)

            self.client.run(destroy_each())
            try:
                if self.abandoned:  # destroying waits for the pending broadcast (NCCL: until its timeout)
                    from torch.distributed.distributed_c10d import _abort_process_group

                    _abort_process_group(self.group)
                else:
                    torch.distributed.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - the servers may be gone already
                pass
            self.group = None
