"""The stand-in SGLang server's LoRA adapters (tests/helpers/sglang_standin.py), as SGLang 0.5.23 serves them.

As SGLang does (``srt/arg_groups/lora_hook.py``, ``srt/lora/lora_manager.py``, ``tokenizer_control_mixin.py``):
``--enable-lora`` without ``--lora-paths`` needs both ``--max-lora-rank`` and ``--lora-target-modules``, and
``--max-loaded-loras`` may not be below ``--max-loras-per-batch`` (the server does not start); an adapter is loaded
from tensors (one payload per tensor-parallel rank, each a pickled ``{name: tensor}`` dict) under a name it does
not hold yet, with a rank of at most ``--max-lora-rank`` and target modules among the server's; a full server
evicts its least recently used adapter; an unknown name cannot be unloaded nor named by ``/generate``
(``lora_path``); a request runs base + (alpha / r) B A of its adapter, whatever the base holds now.
"""

from __future__ import annotations

import base64
import copy
import pickle
import re

import torch

ALL = "all"


def check_lora_args(args) -> str | None:
    """Why SGLang would not start with these LoRA flags, or ``None``."""
    if not args.enable_lora:
        return None
    if args.max_lora_rank is None or not args.lora_target_modules:
        return (
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules"
        )
    if ALL in args.lora_target_modules and len(args.lora_target_modules) > 1:
        return "If 'all' is specified in --lora-target-modules, it should be the only module specified."
    if args.max_loaded_loras is not None and args.max_loaded_loras < args.max_loras_per_batch:
        return "max_loaded_loras should be greater than or equal to max_loras_per_batch"
    return None


class Adapters:
    """Loaded adapters by name, least recently used first, and the model each runs (built on first use)."""

    def __init__(self, args) -> None:
        self.args = args
        self.loaded: dict[str, tuple[dict, dict[str, torch.Tensor]]] = {}  # name -> (config, tensors)
        self.models: dict[str, torch.nn.Module] = {}  # name -> base + its product, until the base changes

    def load(self, body: dict) -> str | None:
        """Load the adapter of a ``/load_lora_adapter_from_tensors`` body; why it is refused, or ``None``."""
        name, config = body["lora_name"], body["config_dict"]
        if not self.args.enable_lora:
            return "LoRA is not enabled on this server (--enable-lora)"
        if name in self.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        payloads = body["serialized_named_tensors"]
        if len(payloads) != self.args.tp_size:
            return f"serialized_named_tensors has {len(payloads)} payloads for tp_size {self.args.tp_size}"
        tensors = pickle.loads(base64.b64decode(payloads[0]))
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            return "the adapter payload must be a {name: tensor} dict"
        rank = config.get("r")
        if not isinstance(rank, int) or rank > self.args.max_lora_rank:
            return f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.args.max_lora_rank}"
        targets = {name.split(".")[-3] for name in tensors if ".lora_A." in name}
        allowed = self.args.lora_target_modules
        if ALL not in allowed and not targets <= set(allowed):
            return f"LoRA adapter {name} targets {sorted(targets)}, not all among --lora-target-modules {allowed}"
        limit = self.args.max_loaded_loras
        while limit is not None and len(self.loaded) >= limit:  # SGLang evicts the least recently used
            self.unload(next(iter(self.loaded)))
        self.loaded[name] = (config, tensors)
        return None

    def unload(self, name: str) -> str | None:
        if name not in self.loaded:
            return f"LoRA adapter {name} does not exist"
        del self.loaded[name]
        self.models.pop(name, None)
        return None

    def base_changed(self) -> None:
        self.models.clear()  # each adapter then runs on the new base

    def model(self, base: torch.nn.Module, name: str) -> torch.nn.Module:
        """The model ``name``'s requests run: ``base`` with each adapted weight + (alpha / r) B A."""
        if name not in self.models:
            config, tensors = self.loaded.pop(name)
            self.loaded[name] = (config, tensors)  # used now: the most recently used
            rank = config["r"]
            scale = config["lora_alpha"] / (rank**0.5 if config.get("use_rslora") else rank)
            merged = copy.deepcopy(base)
            weights = dict(merged.named_parameters())
            with torch.no_grad():
                for a_name, a in tensors.items():
                    if ".lora_A." not in a_name:
                        continue
                    layer = re.sub(r"^base_model\.model\.", "", a_name.split(".lora_A.")[0])
                    b = tensors[a_name.replace(".lora_A.", ".lora_B.")]
                    weight = weights[f"{layer}.weight"]
                    weight += ((b.float() @ a.float()) * scale).to(weight.dtype)
            self.models[name] = merged
        return self.models[name]
