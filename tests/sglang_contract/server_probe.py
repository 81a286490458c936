"""A callback that asks the run's SGLang server, at the end of the fit, what it now serves.

Added to a CLI run by ``test_cli_fit`` (``+callbacks.probe._target_=sglang_contract.server_probe.ServerProbe``):
at ``on_fit_end`` the pool is still open (the datamodule's teardown closes it, after the callbacks' fit end), so
the launched server still holds the weights of the last sync. The probe writes to ``path``, as JSON, the version
the server reports (``/model_info``) and its input log-probs of each of ``sequences`` (``/generate`` with
``logprob_start_len: 0``): what the test compares with the exported policy, after the run's process is gone.
Plain HTTP from the standard library, nothing of the pool: the answer is the server's, not lit_parl's reading of it.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


def call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def input_logprobs(url: str, input_ids: list[int]) -> list[float]:
    """The server's log-prob of each token of ``input_ids`` after the ones before it (the first has none)."""
    answer = call(
        f"{url}/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    return [entry[0] for entry in answer["meta_info"]["input_token_logprobs"][1:]]


class ServerProbe(Callback):
    """At fit end, the server at ``url``'s reported weight version and input log-probs of ``sequences``, to ``path``."""

    def __init__(self, url: str, path: str, sequences: list[list[int]]) -> None:
        self.url, self.path, self.sequences = url, Path(path), [list(s) for s in sequences]

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        probe = {
            "weight_version": call(f"{self.url}/model_info")["weight_version"],
            "logprobs": [input_logprobs(self.url, s) for s in self.sequences],
        }
        self.path.write_text(json.dumps(probe))
