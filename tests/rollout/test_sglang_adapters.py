"""Adapter-only weight sync to SGLang (``pool.sync.lora=adapter``, lit_parl.rollout.sglang.adapters), against the
stand-in server, which serves LoRA adapters as SGLang does (tests/helpers/sglang_standin_lora.py): the request
shapes themselves are checked against SGLang's own classes in tests/sglang_contract.

A LoRA fit whose servers get the base once and then each iteration's adapter alone passes the on-policy check
every iteration and ends on the adapters of the same fit with merged pushes (SGD; same seeds, so the same
samples).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from helpers.components import fit, make_components
from helpers.multi_process import free_port
from helpers.sglang_pools import STANDIN
from lit_parl import GRPOObjective
from lit_parl.models.lora import TRAINED, adapter_parameters
from lit_parl.rollout.records import SamplingParams
from lit_parl.rollout.sglang import SGLangRolloutPool

pytest.importorskip("aiohttp")

LORA = {"rank": 4, "alpha": 8.0}
ITERATIONS = 3


def lora_fit(tmp_path, lora_sync: str):
    journal = tmp_path / f"{lora_sync}.jsonl"
    pool = SGLangRolloutPool(
        launch={
            "command": STANDIN,
            "dtype": "float32",  # the trainer's: the on-policy check compares log-probs within its tolerance
            "start_timeout_s": 120,
            "port": free_port(),
            "args": ["--journal", str(journal)],
        },
        sync={"method": "tensor", "lora": lora_sync},
    )
    torch.manual_seed(0)  # the adapters' initial A: the same in both fits
    module, datamodule = make_components(
        pool=pool,
        mini_batches=2,  # θ_k is the snapshot adapter
        objective=GRPOObjective(beta=0.04),
        lora=LORA,
        optimizer=functools.partial(torch.optim.SGD, lr=0.5),
        max_grad_norm=None,
        datamodule_kwargs={"logprob_tolerance": 1e-4},  # float32 on both sides: a base-only sample shows
    )
    fit(module, datamodule, ITERATIONS)
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    return module, datamodule, events


def test_the_base_goes_once_then_each_iterations_adapter_alone_and_the_fit_is_the_merged_one(tmp_path):
    merged, _, merged_events = lora_fit(tmp_path, "merged")
    adapted, datamodule, events = lora_fit(tmp_path, "adapter")
    assert datamodule.launcher.logprob_tolerance() is not None, "the on-policy check must be on"
    assert [s.version for s in datamodule.history] == list(range(ITERATIONS))

    loads = [e for e in events if e["event"] == "load"]
    assert [e["version"] for e in loads] == ["0"], "the base is pushed once, before the first adapter"
    assert not any("lora_" in name for name, _ in loads[0]["tensors"])
    adapters = [e for e in events if e["event"] == "load_adapter"]
    assert [e["name"] for e in adapters] == [f"lit_parl-v{k}" for k in range(ITERATIONS)]
    for event in adapters:  # the A and B of every adapted layer, under peft's names, nothing else
        names = [name for name, _ in event["tensors"]]
        assert names and all(name.startswith("base_model.model.") and ".lora_" in name for name in names)
        assert not any(".default." in name for name in names)
    generates = [e for e in events if e["event"] == "generate"]
    assert generates and all(e["adapter"] == f"lit_parl-v{e['version']}" for e in generates)
    assert [e["version"] for e in merged_events if e["event"] == "load"] == [str(k) for k in range(ITERATIONS)]

    final = dict(adapter_parameters(adapted.policy, TRAINED))
    moved = max(float(tensor.detach().abs().max()) for name, tensor in final.items() if ".lora_B." in name)
    assert moved > 1e-3, "the adapters' B (zero at the start) barely moved: the comparison would prove nothing"
    for name, tensor in adapter_parameters(merged.policy, TRAINED):
        torch.testing.assert_close(final[name], tensor, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


def test_an_adapter_above_the_servers_rank_is_refused_naming_the_setting(tmp_path):
    from lit_parl.rollout.sglang.adapters import AdapterLoader

    loader = AdapterLoader(weights=None, max_rank=8)
    with pytest.raises(
        ValueError, match=r"rank 16 is above the engines' max_lora_rank 8: set pool.sync.max_lora_rank=16"
    ):
        loader.load([], [[("a", torch.zeros(1))]], {"r": 16}, version=0)


def test_a_joined_rank_names_the_adapter_the_pushing_rank_loaded(spec, tmp_path):
    """Under several trainer ranks rank 0 loads the adapter; another rank's pool follows rank 0's ``address()``
    (which names it) when it adopts the version, and its requests name it too (the stand-in's journal says which
    adapter each sample ran with)."""
    from helpers.sglang_pools import requests_for, start_pool
    from lit_parl.callbacks.full_tensors import base_tensors, lora_adapter_config, lora_adapter_tensors
    from lit_parl.models import tiny_qwen2
    from lit_parl.models.lora import LoRASettings, add_lora

    journal = tmp_path / "journal.jsonl"
    model, _ = tiny_qwen2(seed=0)
    add_lora(model, LoRASettings(rank=4, alpha=8.0))
    owner = start_pool(spec, launch={"args": ["--journal", str(journal)]}, sync={"method": "tensor", "lora": "adapter"})
    joined = SGLangRolloutPool(sync={"lora": "adapter"})
    try:
        joined.join(spec, owner.address())
        owner.sync_weights([list(base_tensors(model))], version=0)
        owner.sync_adapter([list(lora_adapter_tensors(model))], lora_adapter_config(model), version=0)
        joined.adopt_version(0, owner.address())
        sampling = SamplingParams(max_new_tokens=3, temperature=0.7)
        assert {g.version for g in joined.generate(requests_for(0, prompts=2), sampling)} == {0}
    finally:
        joined.close()
        owner.close()
    generates = [json.loads(line) for line in journal.read_text().splitlines()]
    generates = [e for e in generates if e["event"] == "generate"]
    assert generates and all(e["adapter"] == "lit_parl-v0" for e in generates)
