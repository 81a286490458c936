"""Moving policy weights to inference servers: the three ways SGLang accepts them.

- ``serialize_named_tensors``: the ``/update_weights_from_tensor`` payload (same node). Tensors are
  pickled with torch's multiprocessing reductions, as SGLang's ``MultiprocessingSerializer`` does, then
  base64-encoded: CUDA tensors travel as IPC handles, never as bytes. CPU tensors go through shared
  memory files (the ``file_system`` strategy), so a server on the same machine can open them. A CUDA
  handle names its device by index, which means another GPU in a server process that sees other
  ``CUDA_VISIBLE_DEVICES``: SGLang's own ``monkey_patch_torch_reductions`` (applied by its servers before
  they unpickle) makes the device travel as its UUID, so the trainer applies it too before pickling. A
  shared-memory file's pickle also names the manager the reader must connect to: the pool's own
  (``shm_manager``), which a server keeps connected while it lives, not the one libtorch started for the
  trainer's process.
- ``init_weight_update_group``: a process group of its own between the trainer (rank 0) and the
  servers' ranks, for ``/update_weights_from_distributed``. It is built like SGLang builds its side
  (TCP rendezvous, a store prefixed by the group name, a fresh process group), without touching the
  trainer's default group, which Lightning owns.
- ``save_shard``: one shard of a safetensors checkpoint for ``/update_weights_from_disk``.
"""

from __future__ import annotations

import base64
import inspect
import io
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing as torch_mp
from torch.multiprocessing.reductions import rebuild_storage_filename

from lit_parl.extras import require
from lit_parl.rollout.shm_manager import ShmManager


def serialize_named_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], shm_manager: ShmManager | None = None
) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` writes it.

    The caller must keep the tensors alive until the server has answered (it maps their memory). CPU tensors
    name ``shm_manager`` as their manager (without one, the manager libtorch started for this process, which
    every reader then keeps alive as long as the reader lives).
    """
    if any(t.is_cuda for _, t in named_tensors):
        send_cuda_devices_by_uuid()
    previous = torch_mp.get_sharing_strategy()
    on_cpu = any(not t.is_cuda for _, t in named_tensors)
    if on_cpu:  # a file descriptor cannot cross an HTTP request; a shared-memory file name can
        torch_mp.set_sharing_strategy("file_system")
    try:
        buffer = io.BytesIO()
        pickler = ForkingPickler(buffer)
        if on_cpu and shm_manager is not None:
            pickler.dispatch_table = naming_manager(pickler.dispatch_table, shm_manager.handle())
        pickler.dump(named_tensors)
    finally:
        if on_cpu:
            torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def naming_manager(dispatch_table: dict, manager: bytes) -> dict:
    """``dispatch_table`` with CPU storages shared by file name under ``manager``: torch's own reduction, its
    manager field replaced (the reader's rebuild is torch's, which SGLang's unpickler admits)."""
    reduce_storage = dispatch_table[torch.UntypedStorage]  # typed storages and tensors pickle their untyped one

    def reduce(storage: torch.UntypedStorage):
        rebuild, args = reduce_storage(storage)
        if rebuild is rebuild_storage_filename:  # (cls, manager, file name, size)
            args = (args[0], manager, *args[2:])
        return rebuild, args

    return {**dispatch_table, torch.UntypedStorage: reduce}


def send_cuda_devices_by_uuid() -> None:
    """Apply SGLang's ``monkey_patch_torch_reductions`` in this process: CUDA tensors pickled from now on name
    their device by UUID, which the server's own patch maps to its local device index (the indices differ
    whenever the two processes see different ``CUDA_VISIBLE_DEVICES``). Idempotent. Process-wide, as in
    SGLang's own processes: torch's reduction is replaced for good, and SGLang's version pickles CUDA tensors
    only (it is applied when a bucket holds CUDA tensors, which a trainer on a GPU sends all of)."""
    require(
        "sglang.srt.utils.patch_torch",
        "sglang",
        "the SGLang pool's pool.sync.method='tensor' with CUDA weights (in the trainer's process, for SGLang's CUDA "
        "IPC patch: devices sent by UUID)",
        hint="(or use pool.sync.method='distributed' or 'disk')",
    ).monkey_patch_torch_reductions()


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The inverse of ``serialize_named_tensors`` (what a server does with the payload)."""
    import pickle

    return pickle.loads(base64.b64decode(payload))


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 600.0,
) -> torch.distributed.ProcessGroup:
    """Join the weight-update group (rank 0: the trainer, which hosts the rendezvous store)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # the keyword for backend options was renamed across torch releases
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(_new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


class BroadcastAbandoned(RuntimeError):
    """A server refused its update and the broadcast cannot finish: the group holds a pending operation."""


def broadcast_from_trainer(
    group: torch.distributed.ProcessGroup,
    tensors: Iterable[torch.Tensor],
    refused: Callable[[], BaseException | None] = lambda: None,
    grace_s: float = 1.0,
) -> None:
    """Send each tensor from rank 0, in order (the servers receive in the order of the request's names).

    The broadcasts are queued together on a thread of their own while this one watches ``refused()``: a
    server that refuses its update request never joins them, and they would wait for it until the group's
    timeout (NCCL even blocks the host in the first one, where it builds its communicator with every rank).
    An error ``refused()`` returns is raised at once, unless the broadcasts still end within ``grace_s``
    (a server that failed after receiving); if they do not, ``BroadcastAbandoned`` says the group is unusable.
    """
    tensors = [t.contiguous() for t in tensors]
    failed: list[BaseException] = []

    def send() -> None:
        try:
            if tensors and tensors[0].is_cuda:
                torch.cuda.set_device(tensors[0].device)  # a new thread starts on device 0
            works = [torch.distributed.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
            for work in works:
                work.wait()
        except BaseException as error:  # noqa: BLE001 - raised on the caller's thread
            failed.append(error)

    sender = threading.Thread(target=send, name="lit_parl-weight-broadcast", daemon=True)
    sender.start()
    while sender.is_alive():
        error = refused()
        if error is not None:
            sender.join(grace_s)
            if sender.is_alive():
                raise BroadcastAbandoned(
                    f"{error}; the broadcast was abandoned, pending in the weight-update group"
                ) from error
            raise error
        sender.join(0.005)
    if failed:
        raise failed[0]


def save_shard(
    named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, file_name: str
) -> dict[str, str]:
    """Write ``named_tensors`` as ``out_dir/file_name`` (safetensors); return their entries of the weight map."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    save_file(tensors, str(out / file_name))
    return {name: file_name for name in tensors}
