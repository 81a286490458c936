"""A stand-in engine for the vLLM pool's placement tests: it reports, as its completions, the
``CUDA_VISIBLE_DEVICES`` its worker process had when the engine was built, and the worker's pid.

Imported by the spawned workers (by this module's name: ``tests/vllm_backend`` is on the path pytest
gives them), so it imports nothing heavy and starts no vLLM.
"""

from __future__ import annotations

import os

from lit_parl.rollout.records import GroupCompletions

UNSET = "<unset>"


class EnvProbe:
    """A ``WorkerEngine``: ``load`` keeps nothing, ``sample`` answers each request with ``"<env>|<pid>"``."""

    def __init__(self) -> None:
        self.seen = os.environ.get("CUDA_VISIBLE_DEVICES", UNSET)  # when the engine is built, as vLLM would read it

    def load(self, shared, version: int) -> None:
        pass

    def sample(self, requests, sampling, version: int):
        tokens = [ord(c) for c in f"{self.seen}|{os.getpid()}"]
        for r in requests:
            yield GroupCompletions(
                prompt_id=r.prompt_id,
                version=version,
                sample_indices=list(range(r.group_size)),
                completions=[list(tokens) for _ in range(r.group_size)],
                logprobs=[[0.0] * len(tokens) for _ in range(r.group_size)],
                finish_reasons=["length"] * r.group_size,
            )


def decode(group: GroupCompletions) -> tuple[str, int]:
    """``(CUDA_VISIBLE_DEVICES, pid)`` of the worker that answered ``group``."""
    seen, pid = "".join(chr(t) for t in group.completions[0]).rsplit("|", 1)
    return seen, int(pid)
