"""HFExport: save the trained policy in Hugging Face format (safetensors, config, tokenizer) at the end of fit,
and every N iterations."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from .contracts import HasPolicy, SavesPretrained, contract_problems, require
from .full_tensors import full_tensors, has_lora_layers, is_sharded, lora_adapter_config, lora_adapter_tensors


class HFExport(Callback):
    r"""Save ``pl_module.policy`` with ``save_pretrained`` when fit ends, and the module's tokenizer if it has one.

    The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained(dirpath)`` (and
    ``AutoTokenizer.from_pretrained`` when a tokenizer was saved). With ``every_n_iterations`` the policy is
    also saved after every n-th epoch, to ``<dirpath>/iteration-<k>`` (k epochs trained). Only global rank 0
    writes; under FSDP2 every rank first takes part in gathering the full weights, one tensor at a time into
    CPU memory (``lit_parl.callbacks.full_tensors``).

    Needs a :class:`~lit_parl.callbacks.HasPolicy` module whose ``policy`` has ``save_pretrained``
    (:class:`~lit_parl.callbacks.SavesPretrained`, any ``transformers.PreTrainedModel``). A ``tokenizer``
    attribute is optional; when present (not ``None``) it must have ``save_pretrained`` too.

    A policy trained with LoRA adapters (peft's layers in it) is saved as its adapter, in ``<dirpath>/adapter`` as
    peft saves one (``peft.PeftModel.from_pretrained(base, "<dirpath>/adapter")`` on the model the run started
    from); with ``merge_lora`` the merged model (base + (α / r) B A, loadable with transformers alone) is written
    to ``dirpath`` too.

    Override ``export(pl_module, directory, state_dict=None)`` to save the model differently; under FSDP2 it is
    given the gathered weights as ``state_dict`` (with LoRA, the merged ones; on one device or DDP without LoRA,
    ``None``: the policy holds them whole). Override ``export_adapter(pl_module, directory, tensors)`` for the
    adapter.

    Args:
        dirpath: the export directory. ``None``: ``<trainer.default_root_dir>/policy``.
        every_n_iterations: also export after every n-th epoch (``0``: only at the end).
        merge_lora: with LoRA, also write the merged model (a second whole-model copy in CPU memory while it is
            written); without LoRA the model is always written.

    Raises:
        TypeError: at fit start, when the LightningModule has no ``policy`` module, the policy no
            ``save_pretrained``, or the tokenizer no ``save_pretrained``.

    Example (a tiny Qwen2 as the policy)::

        >>> import lightning, tempfile, transformers
        >>> from lightning.pytorch.demos.boring_classes import BoringModel
        >>> class Model(BoringModel):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.policy = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=16,
        ...             hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        ...             num_key_value_heads=1))
        >>> folder = tempfile.TemporaryDirectory()
        >>> export = HFExport(dirpath=folder.name)
        >>> trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=0,
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ...     callbacks=[export])
        >>> trainer.fit(Model())
        >>> type(transformers.AutoModelForCausalLM.from_pretrained(export.saved_to)).__name__
        'Qwen2ForCausalLM'
        >>> folder.cleanup()
    """

    def __init__(self, dirpath: str | None = None, every_n_iterations: int = 0, merge_lora: bool = False) -> None:
        if every_n_iterations < 0:
            raise ValueError(f"HFExport(every_n_iterations={every_n_iterations}) must be >= 0 (0: only when fit ends)")
        self.dirpath = dirpath
        self.every_n_iterations = every_n_iterations
        self.merge_lora = merge_lora
        self.saved_to: Path | None = None  # the directory written last

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # checked now, not at the end: a run of hours must not end in an export that cannot happen
        fix = "Keep a transformers PreTrainedModel as `self.policy`, or subclass HFExport and override `export`."
        if type(self).export is HFExport.export:
            require(pl_module, HasPolicy, owner="HFExport", role="the LightningModule", fix=fix)
            require(pl_module.policy, SavesPretrained, owner="HFExport", role="the module's `policy`", fix=fix)
            tokenizer = getattr(pl_module, "tokenizer", None)
            if tokenizer is not None and contract_problems(tokenizer, SavesPretrained):
                raise TypeError(
                    f"HFExport saves the module's `tokenizer` beside the policy, but {type(tokenizer).__name__} "
                    "has no `save_pretrained`. "
                    "Use a transformers tokenizer, set `tokenizer = None`, or override `export`."
                )

    def export(
        self, pl_module: LightningModule, directory: Path, state_dict: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Write the policy (safetensors) and the tokenizer, if any, into ``directory`` (on global rank 0).

        ``state_dict``: the policy's full weights when a strategy shards them (gathered on every rank), or merged
        when it trains LoRA adapters; ``None``: the policy's own.
        """
        pl_module.policy.save_pretrained(
            directory, state_dict=state_dict
        )  # safetensors: the default of transformers >= 4.35
        self._save_tokenizer(pl_module, directory)

    def export_adapter(self, pl_module: LightningModule, directory: Path, tensors: dict[str, torch.Tensor]) -> None:
        """Write the policy's trained LoRA adapter into ``directory`` as peft saves one, and the tokenizer, if any
        (on global rank 0). ``tensors``: the adapter's whole tensors, under the policy's parameter names."""
        save_adapter(pl_module.policy, directory, tensors)
        self._save_tokenizer(pl_module, directory)

    @staticmethod
    def _save_tokenizer(pl_module: LightningModule, directory: Path) -> None:
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        done = trainer.current_epoch + 1
        if self.every_n_iterations and done % self.every_n_iterations == 0:
            self._export(trainer, pl_module, self._directory(trainer) / f"iteration-{done}")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._export(trainer, pl_module, self._directory(trainer))

    def _directory(self, trainer: Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "policy"

    def _export(self, trainer: Trainer, pl_module: LightningModule, directory: Path) -> None:
        policy = pl_module.policy
        # every rank below: each gather is a collective; the other ranks take part and keep nothing
        adapter = None
        if has_lora_layers(policy):
            tensors = ((name, tensor.cpu()) for name, tensor in lora_adapter_tensors(policy))
            adapter = dict(tensors) if trainer.is_global_zero else [None for _ in tensors]
        state_dict = None
        if (adapter is None and is_sharded(policy)) or (adapter is not None and self.merge_lora):
            # kept in CPU memory, one tensor at a time on the device (LoRA: the merged weights, under the base
            # model's names: what transformers alone loads)
            full = ((name, tensor.cpu()) for name, tensor in full_tensors(policy))
            if trainer.is_global_zero:
                state_dict = dict(full)
            else:
                for _ in full:
                    pass
        if not trainer.is_global_zero:
            return
        if adapter is not None:  # rank 0's (the others only took part in the gathers)
            self.export_adapter(pl_module, directory / "adapter", adapter)
        if state_dict is not None:
            self.export(pl_module, directory, state_dict)
        elif adapter is None:  # whole weights: an override written for one device may take two arguments only
            self.export(pl_module, directory)
        self.saved_to = directory


def save_adapter(model: torch.nn.Module, directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The active LoRA adapter of ``model`` (peft's layers injected into it; its whole ``tensors`` under peft's
    names, as ``lora_adapter_tensors`` gives them) as peft saves one, for ``peft.PeftModel.from_pretrained(base,
    directory)`` on the base model the run started from."""
    write_adapter_files(directory, tensors, lora_adapter_config(model))


def write_adapter_files(directory: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """An adapter directory as peft writes one: ``adapter_model.safetensors`` (``tensors``, peft's names) and
    ``adapter_config.json`` (``config``); what peft, vLLM's and SGLang's adapter loaders read."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
    save_file(state, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
