"""What lit_parl runs inside each of vLLM's own workers (every tensor-parallel rank): loading weights in place,
dying with the lit_parl worker, folding the temperature into the logits.

vLLM mixes ``VLLMWorkerExtension`` into its worker class (``EngineArgs.worker_extension_cls=EXTENSION``,
imported there by name); ``lit_parl.rollout.vllm_engine.VLLMEngine`` calls its methods through
``collective_rpc``. Which vLLM functions they rely on: ``lit_parl.rollout.vllm_engine``.
"""

from __future__ import annotations

import logging
import os

import torch

from lit_parl.rollout.processes import die_with_parent

EXTENSION = "lit_parl.rollout.vllm_worker_extension.VLLMWorkerExtension"


class VLLMWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); called through ``collective_rpc``."""

    def lit_parl_load_weights(self, weights: dict[str, torch.Tensor], version: int) -> int:
        """Load Hugging Face-named tensors in place and return ``version`` as this worker's confirmation."""
        # Each reload warns "Failed to load weights" for the layers the checkpoint has no weights for: the
        # rotary embedding (it has none) and a tied head (rebuilt below). Every sync would print it.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        named = iter(weights.items())
        if hasattr(self, "reload_weights"):
            # in place, and re-runs each layer's post-load processing (the CPU backend packs linear
            # weights for oneDNN; a plain copy into the parameters would not reach those packed copies)
            self.reload_weights(weights_iterator=named, is_checkpoint_format=True)
        else:  # vLLM releases without reload_weights (not run here): the parameters' own weight loaders
            self.model_runner.model.load_weights(weights=named)
        model = self.model_runner.model
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if getattr(self.model_config.hf_text_config, "tie_word_embeddings", False) and method is not None:
            # A tied head has no weight of its own in the checkpoint, so the reload reprocesses only the
            # embedding. Rebuild the head's kernel (on CPU, its packed matrix) from the new weight.
            method.process_weights_after_loading(head)
        return version

    def lit_parl_die_with_parent(self) -> int:
        """Have Linux kill this vLLM worker when its parent dies; return its pid.

        A tensor-parallel rank's parent is the lit_parl worker that hosts the engine core (vLLM's
        multiprocessing executor starts it from that worker's main thread); the in-process executor's
        worker is the lit_parl worker itself, which ``serve`` set up so already.
        """
        die_with_parent()
        return os.getpid()

    def lit_parl_set_temperature(self, temperature: float) -> float:
        """Scale the model's logits by 1 / ``temperature`` (times the model's own scale); return the scale."""
        processor = getattr(self.model_runner.model, "logits_processor", None)
        # with LoRA on, vLLM wraps it (LogitsProcessorWithLoRA, whose scale is its base layer's, read-only)
        processor = getattr(processor, "base_layer", processor)
        if processor is None or not hasattr(processor, "scale"):
            raise RuntimeError(
                f"{type(self.model_runner.model).__name__} has no vLLM LogitsProcessor with a scale, where the "
                "temperature is folded in so that the log-probs are the full softmax at T"
            )
        if not hasattr(self, "_lit_parl_model_scale"):
            self._lit_parl_model_scale = processor.scale  # the model's own logit scale (1.0 for most)
        processor.scale = self._lit_parl_model_scale / temperature
        return processor.scale
