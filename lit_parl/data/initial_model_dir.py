"""InitialModelDir: the policy as a saved Hugging Face directory, which is what a rollout engine starts from.

Example::

    >>> from lit_parl.models import tiny_qwen2
    >>> policy, tokenizer = tiny_qwen2()
    >>> saved = InitialModelDir(policy, tokenizer)
    >>> directory = saved.path()
    >>> import os; "config.json" in os.listdir(directory)
    True
    >>> saved.remove(); os.path.exists(directory)
    False
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lit_parl.callbacks.full_tensors import full_tensors, has_lora_layers


class InitialModelDir:
    """A model saved once, on first use, to a temporary directory (with its tokenizer), or a given path.

    Args:
        model: the policy, or the path of a Hugging Face directory of it (used as it is, never removed).
        tokenizer: saved beside a model, so an engine that tokenizes finds it.
    """

    def __init__(self, model: PreTrainedModel | str | Path, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model, self.tokenizer = model, tokenizer
        self._path: str | None = None  # the temporary directory this object made
        self._finalizer: weakref.finalize | None = None

    def path(self) -> str:
        if isinstance(self.model, (str, Path)):
            return str(self.model)
        if self._path is None:
            self._path = tempfile.mkdtemp(prefix="lit_parl_initial_")
            # removed even when its owner is never torn down (collected, or the interpreter exits first)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._path, ignore_errors=True)
            # a policy with LoRA layers is saved merged, under the base model's names: what an engine loads
            merged = dict(full_tensors(self.model)) if has_lora_layers(self.model) else None
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # under torch.distributed `save_pretrained` writes on rank 0 only, but every rank's engines start
                # from a directory of that rank's own (ranks may be on other machines): this rank writes too.
                # transformers' own writer, not a copy of it: engines read its names (tied weights, architectures).
                self.model.should_save_on_this_rank = lambda is_main_process: True  # shadows the method, once
                try:
                    self.model.save_pretrained(self._path, state_dict=merged)
                finally:
                    del self.model.should_save_on_this_rank
            else:
                self.model.save_pretrained(self._path, state_dict=merged)
            self.tokenizer.save_pretrained(self._path)
        return self._path

    def remove(self) -> None:
        """Delete the temporary directory (nothing when the model was given as a path)."""
        if self._finalizer is not None:
            self._finalizer()  # removes the directory, once
            self._path = self._finalizer = None
