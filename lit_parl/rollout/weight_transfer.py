"""Moving policy weights to inference servers: the three ways SGLang accepts them.

- ``serialize_named_tensors``: the ``/update_weights_from_tensor`` payload (same node). Tensors are
  pickled with torch's multiprocessing reductions, as SGLang's ``MultiprocessingSerializer`` does, then
  base64-encoded: CUDA tensors travel as IPC handles, never as bytes. CPU tensors go through shared
  memory files (the ``file_system`` strategy), so a server on the same machine can open them. A CUDA
  handle names its device by index, which means another GPU in a server process that sees other
  ``CUDA_VISIBLE_DEVICES``: SGLang's own ``monkey_patch_torch_reductions`` (applied by its servers before
  they unpickle) makes the device travel as its UUID, so the trainer applies it too before pickling.
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
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as torch_mp
from multiprocessing.reduction import ForkingPickler


def serialize_named_tensors(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)`` writes it.

    The caller must keep the tensors alive until the server has answered (it maps their memory).
    """
    if any(t.is_cuda for _, t in named_tensors):
        send_cuda_devices_by_uuid()
    previous = torch_mp.get_sharing_strategy()
    on_cpu = any(not t.is_cuda for _, t in named_tensors)
    if on_cpu:  # a file descriptor cannot cross an HTTP request; a shared-memory file name can
        torch_mp.set_sharing_strategy("file_system")
    try:
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(named_tensors)
    finally:
        if on_cpu:
            torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def send_cuda_devices_by_uuid() -> None:
    """Apply SGLang's ``monkey_patch_torch_reductions`` in this process: CUDA tensors pickled from now on name
    their device by UUID, which the server's own patch maps to its local device index (the indices differ
    whenever the two processes see different ``CUDA_VISIBLE_DEVICES``). Idempotent."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError as error:
        raise ImportError(
            "SGLangRolloutPool(sync_method='tensor') with CUDA weights needs sglang importable in the trainer's process, "
            "for its CUDA IPC patch (devices sent by UUID): pip install 'lit-parl[sglang]', or use sync_method='distributed' "
            "or 'disk'"
        ) from error
    monkey_patch_torch_reductions()


def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The inverse of ``serialize_named_tensors`` (what a server does with the payload)."""
    import pickle

    return pickle.loads(base64.b64decode(payload))


def init_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str, timeout_s: float = 600.0
) -> torch.distributed.ProcessGroup:
    """Join the weight-update group (rank 0: the trainer, which hosts the rendezvous store)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # the keyword for backend options was renamed across torch releases
    options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None})
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_from_trainer(
    group: torch.distributed.ProcessGroup, tensors: Iterable[torch.Tensor], refused: Callable[[], BaseException | None] = lambda: None
) -> None:
    """Send each tensor from rank 0, in order (the servers receive in the order of the request's names).

    A server that refuses its update request never joins the broadcast, which would then wait for it until
    the group's timeout (10 minutes). So each broadcast is started asynchronously and, while it is
    pending, ``refused()`` is polled: an error it returns (the server's answer) is raised at once.
    """
    for tensor in tensors:
        work = torch.distributed.broadcast(tensor.contiguous(), src=0, group=group, async_op=True)
        while not work.is_completed():
            error = refused()
            if error is not None:
                raise error
            time.sleep(0.001)
        work.wait()


def save_shard(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: str | Path, file_name: str) -> dict[str, str]:
    """Write ``named_tensors`` as ``out_dir/file_name`` (safetensors); return their entries of the weight map."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named_tensors}
    save_file(tensors, str(out / file_name))
    return {name: file_name for name in tensors}
