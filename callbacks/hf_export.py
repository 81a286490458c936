"""HFExport: save the trained policy in Hugging Face format (safetensors, config, tokenizer) at the end of fit."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from .contracts import HasPolicy, SavesPretrained, contract_problems, require


class HFExport(Callback):
    r"""Save ``pl_module.policy`` with ``save_pretrained`` when fit ends, and the module's tokenizer if it has one.

    The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained(dirpath)`` (and
    ``AutoTokenizer.from_pretrained`` when a tokenizer was saved). Only global rank 0 writes.

    Needs a :class:`~lit_parl.callbacks.HasPolicy` module whose ``policy`` has ``save_pretrained``
    (:class:`~lit_parl.callbacks.SavesPretrained`, any ``transformers.PreTrainedModel``). A ``tokenizer``
    attribute is optional; when present (not ``None``) it must have ``save_pretrained`` too.

    Override ``export(pl_module, directory)`` to save differently, e.g. to gather a sharded policy first.

    Args:
        dirpath: the export directory. ``None``: ``<trainer.default_root_dir>/policy``.

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
        ...             hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
        >>> export = HFExport(dirpath=tempfile.mkdtemp())
        >>> trainer = lightning.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=2, limit_val_batches=0,
        ...     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ...     callbacks=[export])
        >>> trainer.fit(Model())
        >>> type(transformers.AutoModelForCausalLM.from_pretrained(export.saved_to)).__name__
        'Qwen2ForCausalLM'
    """

    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath
        self.saved_to: Path | None = None  # the directory written, once fit ended

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
                    "has no `save_pretrained`. Use a transformers tokenizer, set `tokenizer = None`, or override `export`."
                )

    def export(self, pl_module: LightningModule, directory: Path) -> None:
        """Write the policy (safetensors) and the tokenizer, if any, into ``directory``."""
        pl_module.policy.save_pretrained(directory)  # safetensors: the default of transformers >= 4.35
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(directory)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        directory = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "policy"
        self.export(pl_module, directory)
        self.saved_to = directory
