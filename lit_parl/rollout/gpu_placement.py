"""Which GPUs each inference worker or server of a pool gets, as its ``CUDA_VISIBLE_DEVICES``.

``gpu_ids`` is a list per worker (``[[1], [2]]``) or a flat list handed out ``tensor_parallel_size`` at a time,
in order; exactly ``workers * tensor_parallel_size`` ids, none given twice. An integer id is a GPU as the
trainer's process numbers them (``cuda:i``): under a ``CUDA_VISIBLE_DEVICES`` of the trainer's own, its i-th
entry. A string (a GPU or MIG UUID) is passed as it is. The vLLM and SGLang pools both place their engines so.
"""

from __future__ import annotations

from collections.abc import Sequence


def shown(gpu_ids) -> list:
    """``gpu_ids`` as plain lists, for messages (Hydra passes ListConfig)."""
    return [shown(g) if isinstance(g, Sequence) and not isinstance(g, str) else g for g in gpu_ids]


def split_gpu_ids(
    gpu_ids,
    num_workers: int,
    tensor_parallel_size: int,
    owner: str,
    names: tuple[str, str] = ("num_workers", "tensor_parallel_size"),
) -> list[list[int | str]] | None:
    """Each worker's GPU ids, checked: ``tensor_parallel_size`` per worker, no id used twice. ``owner`` and
    ``names`` (the pool's names for the two counts) are for the errors."""
    if gpu_ids is None:
        return None
    if isinstance(gpu_ids, (str, int)):
        raise ValueError(f"{owner}(gpu_ids={gpu_ids!r}): give a list, e.g. gpu_ids=[{gpu_ids!r}]")
    listed, needed = shown(gpu_ids), num_workers * tensor_parallel_size
    nested = [isinstance(g, Sequence) and not isinstance(g, str) for g in listed]
    fix = (
        f"give {names[0]} * {names[1]} = {num_workers} * {tensor_parallel_size} = {needed} ids "
        f"({tensor_parallel_size} per worker, in order), or change {names[0]}"
    )
    if any(nested) and not all(nested):
        raise ValueError(
            f"{owner}(gpu_ids={listed}): mixes lists and ids; "
            "give a list per worker ([[0], [1]]) or a flat list ([0, 1])"
        )
    if all(nested) and listed:
        if len(listed) != num_workers or any(len(ids) != tensor_parallel_size for ids in listed):
            raise ValueError(
                f"{owner}(gpu_ids={listed}): {len(listed)} list(s) of {sorted({len(ids) for ids in listed})} id(s), "
                f"for {num_workers} worker(s) of {names[1]}={tensor_parallel_size}: {fix}"
            )
        per_worker = [list(ids) for ids in listed]
    else:
        if len(listed) != needed:
            raise ValueError(f"{owner}(gpu_ids={listed}): {len(listed)} GPU id(s) for {num_workers} worker(s); {fix}")
        per_worker = [listed[i * tensor_parallel_size : (i + 1) * tensor_parallel_size] for i in range(num_workers)]
    for ids in per_worker:
        for gpu in ids:
            if (
                isinstance(gpu, bool)
                or not isinstance(gpu, (int, str))
                or (isinstance(gpu, int) and gpu < 0)
                or (isinstance(gpu, str) and not gpu.strip())
            ):
                raise ValueError(
                    f"{owner}(gpu_ids={listed}): {gpu!r} is no GPU id; give GPU indices (0, 1, ...) or UUIDs"
                )
    seen: dict[str, int] = {}
    for worker, ids in enumerate(per_worker):
        for gpu in ids:
            other = seen.setdefault(str(gpu), worker)
            if other != worker or ids.count(gpu) > 1:
                where = f"workers {other} and {worker}" if other != worker else f"worker {worker}, twice"
                raise ValueError(
                    f"{owner}(gpu_ids={listed}): GPU {gpu!r} is given to {where}; each GPU serves one "
                    "rank of one worker: give distinct ids, or gpu_ids=null to run every engine on the trainer's device"
                )
    return per_worker


def visible_devices(per_worker: list[list[int | str]], trainer_visible: str | None, owner: str) -> list[str]:
    """Each worker's ``CUDA_VISIBLE_DEVICES``: an integer id indexes the trainer's own ``CUDA_VISIBLE_DEVICES``
    where it has one (GPU i as this process numbers it); a string, and any id without one, is passed as it is."""
    visible = None if trainer_visible is None else [d.strip() for d in trainer_visible.split(",") if d.strip()]
    result = []
    for ids in per_worker:
        mapped = []
        for gpu in ids:
            if isinstance(gpu, int) and visible is not None:
                if gpu >= len(visible):
                    raise ValueError(
                        f"{owner}(gpu_ids=...): GPU {gpu} does not exist in this process, which sees "
                        f"CUDA_VISIBLE_DEVICES={trainer_visible!r} ({len(visible)} GPU(s), numbered from 0): "
                        f"give ids below {len(visible)}"
                    )
                gpu = visible[gpu]
            mapped.append(str(gpu))
        result.append(",".join(mapped))
    return result
