"""Compute kernels of the trainer's forward pass (imported as ``lit_parl.kernels``).

Keep this file free of transformers imports and use relative imports: run from the repository root,
``import kernels`` finds this folder, and transformers probes ``kernels`` (Hugging Face's hub-kernels
package) while it initialises. This module must then import cleanly and carry no ``__version__``, so
transformers concludes that package is absent. The attention backends (which register with
transformers) live in ``lit_parl.kernels.attention`` and ``lit_parl.kernels.forward``.
"""

from .logprobs import linear_token_logprobs, token_logprobs
from .packing import PackedTokens, SharedPromptLayout, pack

__all__ = ["PackedTokens", "SharedPromptLayout", "linear_token_logprobs", "pack", "token_logprobs"]
