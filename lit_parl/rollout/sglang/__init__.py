"""The SGLang rollout pool: SGLang servers generate, the trainer trains (docs/design.md, section 4).

The pool launches ``python -m sglang.launch_server`` subprocesses (or attaches to running servers by URL)
and talks to them through SGLang's native HTTP API. One job per module:

- ``sglang_pool``: ``SGLangRolloutPool``, the rollout protocol from ``start`` to ``close``.
- ``settings``: what the pool is told, one dataclass per concern: the servers (``ServerSettings``), how it
  launches them (``LaunchSettings``), the router (``RouterSettings``), the weight sync (``SyncSettings``),
  and its HTTP requests (``RequestSettings``).
- ``servers``: launching, attaching, health-checking and stopping servers and the router.
- ``client``: the asyncio loop, the aiohttp session, and retries on another server.
- ``weights``: the three ways of syncing weights (``tensor``, ``distributed``, ``disk``), each confirmed
  by the weight version every server reports (``/model_info``), the first two inside SGLang's weight-update
  sessions.
- ``messages``: the ``/generate`` request of one sample, and the checks on a group's answers.
- ``judge_server``: ``JudgeLaunch``, an SGLang server of its own for an LLM judge (``lit_parl.rewards.JudgeReward``).

Generation: one ``POST /generate`` per sample, all of the iteration's samples in flight at once, each
group handed to the trainer, unscored, the moment its G samples are finished, stamped with the
``meta_info.weight_version`` the server reports (the trainer refuses any version but the iteration's).
Stop strings are SGLang's own ``stop`` (so the servers load the model directory's tokenizer);
temperature 0 is its greedy decoding.

Log-probs: SGLang's ``output_token_logprobs`` are of the full softmax of logits / T, before top-k and
top-p (the draw is from the filtered one), as the trainer computes them; ``SGLANG_RETURN_ORIGINAL_LOGPROB``
would make them pre-temperature, so the pool refuses to launch servers with it set.

Failures: a request that fails (connection refused or reset, timeout, 5xx, an aborted sample) is sent
again to another live server, at most ``RequestSettings.max_retries`` times; a server that fails its health
check is dropped. A group is handed over once, whatever the retries. With no live server left, or a malformed
answer, ``generate`` raises with the server's URL; nothing is silently lost. ``RouterSettings(enabled=True)``
puts ``sglang_router`` in front of the servers for generation. ``close()`` stops exactly what the pool
launched (servers, router, their process groups) and leaves attached servers running.

SGLang needs a GPU; on a CPU machine the tests run this pool against a stand-in server
(``tests/helpers/sglang_standin.py``) that implements the same endpoints over a tiny transformers model.

Example (on a GPU node with ``pip install lit-parl[sglang]``; ``model_dir`` holds the policy saved with
``save_pretrained`` and its tokenizer)::

    pool = SGLangRolloutPool(launch=LaunchSettings(num_servers=2, mem_fraction_static=0.6), sync=SyncSettings("tensor"))
    pool.start(PoolSpec(model_dir, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id))
    pool.sync_weights([list(policy.named_parameters())], version=0)
    for group in pool.generate(requests, SamplingParams(max_new_tokens=512)):
        ...
    pool.close()
"""

from lit_parl.rollout.sglang.client import ServerError
from lit_parl.rollout.sglang.messages import MalformedResponse
from lit_parl.rollout.sglang.settings import (
    SYNC_METHODS,
    LaunchSettings,
    RequestSettings,
    RouterSettings,
    ServerSettings,
    SyncSettings,
)
from lit_parl.rollout.sglang.sglang_pool import SGLangRolloutPool

__all__ = [
    "SYNC_METHODS",
    "LaunchSettings",
    "MalformedResponse",
    "RequestSettings",
    "RouterSettings",
    "SGLangRolloutPool",
    "ServerError",
    "ServerSettings",
    "SyncSettings",
]
