"""HFExport: save the trained policy in Hugging Face format (safetensors, config, tokenizer) at the end of fit.

The result loads with ``AutoModelForCausalLM.from_pretrained(dirpath)`` and ``AutoTokenizer.from_pretrained``.

Example::

    trainer = lightning.Trainer(callbacks=[WeightSync(), HFExport("runs/x/policy")])
"""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer


class HFExport(Callback):
    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath  # None: <trainer.default_root_dir>/policy
        self.saved_to: Path | None = None

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        target = Path(self.dirpath) if self.dirpath else Path(trainer.default_root_dir) / "policy"
        pl_module.policy.save_pretrained(target, safe_serialization=True)
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(target)
        self.saved_to = target
