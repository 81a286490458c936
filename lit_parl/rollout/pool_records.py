"""What a rollout pool is started with (``PoolSpec``) and what it reports about itself (``PoolHealth``).

Both are exported as ``lit_parl.rollout.PoolSpec`` and ``lit_parl.rollout.PoolHealth``; the protocol that
takes and returns them is ``lit_parl.rollout.rollout_pool.RolloutPool``.

Example::

    >>> PoolSpec("runs/initial_model", eos_id=2, pad_id=0).colocated
    False
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class PoolSpec:
    """What a backend needs to start.

    Args:
        model_dir: a Hugging Face model directory (``config.json``, weights, tokenizer files) of the
            policy's architecture; engines load their model from it. Its weights may be stale: the first
            ``sync_weights`` brings the trainer's.
        eos_id: the end token; every backend stops a sample on it (and on ``SamplingParams.stop_token_ids``)
            and keeps it in the completion.
        pad_id: the padding token, for backends that batch prompts of different lengths.
        colocated: generation and training take turns on the same hardware (``mode="sync"``), so the
            engine may use all of it; otherwise it runs beside the trainer and keeps to its own share.
    """

    model_dir: str | Path
    eos_id: int
    pad_id: int
    colocated: bool = False


@dataclass(frozen=True)
class PoolHealth:
    """A pool's state, as ``RolloutPool.health()`` reports it.

    Args:
        backend: the backend's name (``hf``, ``vllm``, ``sglang``, ...).
        started: ``start`` has run and ``close`` has not.
        workers: engine processes or servers the pool drives (0 when not started).
        alive: how many of them are up.
        version: the policy version every worker confirmed; ``None`` before the first sync or during one.
        details: backend-specific facts (a router's URL, process ids, ...), for people, not for code.
    """

    backend: str
    started: bool
    workers: int
    alive: int
    version: int | None
    details: dict = field(default_factory=dict)
