"""full_tensors: a module's parameters as full tensors, a few at a time, whatever shards them.

- DDP (or one device): a parameter is already whole.
- FSDP2 (``fully_shard``; Lightning's ``ModelParallelStrategy``): each rank holds a shard of every parameter,
  a ``DTensor``; ``full_tensor()`` gathers one.
- FSDP1 (``FullyShardedDataParallel`` with ``use_orig_params=True``; Lightning's ``FSDPStrategy``): a
  rank holds a piece of each unit's flat parameter (lit_parl wraps each model as a unit, each decoder layer
  as a unit inside it). One unit is gathered at a time (``summon_full_params(unit, recurse=False)``): the
  peak is one unit, the model's own (embeddings, final norm, head) or one layer. Its tensors are copied
  out, since the gathered storage is freed when the unit is sharded again.
- DeepSpeed ZeRO-3: a rank holds a piece of every parameter (``ds_tensor``); each is gathered in turn
  (``deepspeed.zero.GatheredParameters``) and copied out. ZeRO-2 keeps parameters whole.

Every gather is a collective: every rank walks the same parameters in the same order, and a consumer that
keeps nothing (a rank other than the one writing) still iterates to the end. A tensor is gathered only
when the consumer asks for it, so one that copies each away (a weight push, an export) never holds a
second copy of the model.

Example::

    >>> import torch
    >>> [(name, tuple(t.shape)) for name, t in full_tensors(torch.nn.Linear(3, 2))]
    [('weight', (2, 3)), ('bias', (2,))]
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch

FSDP1_PREFIX = "_fsdp_wrapped_module."  # what FSDP1 inserts in the names of the modules it wraps
PEFT_PREFIX = "base_model.model."  # where a PeftModel keeps the model: its adapter files' names start so


def _is_fsdp1(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether a rank holds only a piece of some parameter of ``module`` (so reading it whole takes a gather)."""
    return _is_fsdp1(module) or any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in module.parameters())


def full_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full detached tensor)`` for every parameter of ``module``: in ``named_parameters`` order, except
    under FSDP1, unit by unit. Names are the model's own, FSDP1's wrapper prefix left out. A model with LoRA
    layers (``lit_parl.models.lora``) is read merged: each adapted layer's weight with its active adapter's
    product added, under the layer's own name, and no adapter tensor (what an engine without LoRA loads)."""
    adapted = lora_layers(module)
    yield from _merged(_whole_tensors(module), adapted) if adapted else _whole_tensors(module)


def _whole_tensors(module: torch.nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter whole, under its own name (FSDP1: unit by unit, gathered; ZeRO-3: gathered one by one);
    ``keep(name)``: only those, and nothing else gathered (FSDP1: only the units that hold some)."""
    if _is_fsdp1(module):
        yield from _fsdp1_full_tensors(module, keep)
        return
    for name, parameter in module.named_parameters():
        if keep is not None and not keep(name):
            continue
        if hasattr(parameter, "ds_id"):  # ZeRO-3
            import deepspeed

            with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
                yield name, parameter.detach().clone()  # the gathered storage is freed when it is partitioned again
            continue
        yield name, _whole(parameter)


def fsdp1_units(module: torch.nn.Module) -> list[tuple[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]]:
    """``module``'s parameters grouped by the FSDP1 unit that owns each (its nearest wrapped ancestor), in
    the order units are met. Names without the wrappers' prefix; a parameter shared by two modules (a tied
    head) once, as ``named_parameters`` gives it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    groups: dict[int, tuple[torch.nn.Module, list]] = {}
    seen: set[int] = set()

    def walk(node: torch.nn.Module, prefix: str, owner: torch.nn.Module | None) -> None:
        if isinstance(node, FullyShardedDataParallel):
            owner = node
            groups.setdefault(id(node), (node, []))
        for name, parameter in node.named_parameters(recurse=False):
            if id(parameter) in seen:
                continue
            if owner is None:
                raise ValueError(
                    f"{prefix + name} belongs to no FSDP unit inside the module: "
                    "wrap the model itself, not only its layers"
                )
            seen.add(id(parameter))
            groups[id(owner)][1].append(((prefix + name).replace(FSDP1_PREFIX, ""), parameter))
        for name, child in node.named_children():
            walk(child, f"{prefix}{name}.", owner)

    walk(module, "", None)
    return [group for group in groups.values() if group[1]]


def _fsdp1_full_tensors(module: torch.nn.Module, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit, parameters in fsdp1_units(module):
        kept = [(n, p) for n, p in parameters if keep is None or keep(n)]
        if not kept:
            continue
        with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
            for name, parameter in kept:
                yield name, parameter.detach().clone()  # the gathered storage is freed when the unit is sharded again


def has_lora_layers(module: torch.nn.Module) -> bool:
    """Whether ``module`` has LoRA layers (read merged by ``full_tensors``)."""
    return bool(lora_layers(module))


def lora_adapter(module: torch.nn.Module) -> str:
    """The name of the adapter ``module``'s LoRA layers run (the trained one)."""
    return next(iter(lora_layers(module).values())).active_adapters[0]


def lora_adapter_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, whole detached tensor)`` of the active adapter's A and B in every LoRA layer of ``module``, under
    peft's names (``base_model.model.<layer>.lora_A.weight``: what ``peft.PeftModel.from_pretrained`` and the
    engines' adapter loaders read). Only the adapter's tensors are gathered under a sharding strategy (FSDP1: the
    units that hold them): every rank must iterate to the end."""
    adapter = lora_adapter(module)
    for name, tensor in _whole_tensors(module, keep=lambda name: is_adapter_tensor(name, adapter)):
        yield f"{PEFT_PREFIX}{name.replace(f'.{adapter}.', '.')}", tensor


def is_adapter_tensor(name: str, adapter: str | None = None) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's A or B (of ``adapter``; ``None``: of any)."""
    return ".lora_" in name and (adapter is None or f".{adapter}." in name)


def lora_adapter_config(module: torch.nn.Module) -> dict:
    """peft's config of ``module``'s active adapter, as ``adapter_config.json`` holds it (JSON types only)."""
    config = module.peft_config[lora_adapter(module)].to_dict()
    return json.loads(json.dumps(config, default=lambda value: sorted(value) if isinstance(value, set) else str(value)))


def base_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``full_tensors`` of a model with LoRA layers as if they had none: the frozen base, under its own names."""
    yield from _merged(_whole_tensors(module), lora_layers(module), with_adapters=False)


def lora_layers(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{name: layer}`` of the LoRA layers (peft's: a ``base_layer`` and ``get_delta_weight``), in module order,
    found by shape so that this package needs no peft; names without FSDP1's wrapper prefix."""
    return {
        name.replace(FSDP1_PREFIX, ""): m
        for name, m in module.named_modules()
        if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")
    }


def _merged(
    named: Iterator[tuple[str, torch.Tensor]], adapted: dict[str, torch.nn.Module], with_adapters: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` whole tensors with the LoRA layers merged: base + (α / r) B A of each layer's active adapter, under
    the layer's own name, no adapter tensor. A layer's base weight waits for its A and B, which come after it
    (peft registers the base layer first), so one layer's tensors are held at a time."""
    held: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its base weight and adapter tensors read so far
    for name, tensor in named:
        owner, _, leaf = name.rpartition(".")
        if ".lora_" in name:
            layer_name, _, rest = name.partition(".lora_")
            if layer_name in held:
                held[layer_name][f"lora_{rest}"] = tensor
                yield from _merge_when_complete(layer_name, adapted[layer_name], held)
            continue
        layer_name = owner.removesuffix(".base_layer")
        layer = adapted.get(layer_name) if owner.endswith(".base_layer") else None
        if layer is None:
            yield name, tensor
        elif leaf == "weight" and with_adapters and not layer.disable_adapters:
            held[layer_name] = {"weight": tensor, "after": []}
            yield from _merge_when_complete(layer_name, layer, held)
        elif layer_name in held:  # the bias after the held weight: kept in order behind it
            held[layer_name]["after"].append((f"{layer_name}.{leaf}", tensor))
        else:
            yield f"{layer_name}.{leaf}", tensor
    if held:  # a layer whose A and B never came (not a linear LoRA layer): its weight would be lost
        raise RuntimeError(f"LoRA layers {sorted(held)} gave no lora_A/lora_B weights to merge: linear layers only")


def _merge_when_complete(layer_name: str, layer, held: dict) -> Iterator[tuple[str, torch.Tensor]]:
    parts = held[layer_name]
    needed = [f"lora_{m}.{a}.weight" for a in layer.active_adapters for m in ("A", "B")]
    if not all(key in parts for key in needed):
        return
    tensor = parts["weight"]
    for adapter in layer.active_adapters:
        delta = lora_delta(parts[f"lora_B.{adapter}.weight"], parts[f"lora_A.{adapter}.weight"], layer, adapter)
        tensor = tensor + delta.to(tensor.dtype)
    del held[layer_name]
    yield f"{layer_name}.weight", tensor
    yield from parts["after"]


def lora_delta(b: torch.Tensor, a: torch.Tensor, layer: torch.nn.Module, adapter: str) -> torch.Tensor:
    """(α / r) B A of ``adapter`` in a LoRA ``layer``, from its whole A and B, in float32 (peft's
    ``get_delta_weight`` reads the local tensors: under a sharding strategy, pieces)."""
    with torch.no_grad():
        delta = (b.float() @ a.float()) * layer.scaling[adapter]
    return delta.T if getattr(layer, "fan_in_fan_out", False) else delta


def _whole(parameter: torch.Tensor) -> torch.Tensor:
    tensor = parameter.detach()  # the receiver copies values: it must not hold the autograd graph's leaves
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
