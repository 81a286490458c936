"""Compute kernels of the trainer's forward pass (imported as ``lit_parl.kernels``).

Keep this file free of transformers imports and use relative imports: run from the repository root,
``import kernels`` finds this folder, and transformers probes ``kernels`` (Hugging Face's hub-kernels
package) while it initialises. This module must then import cleanly and carry no ``__version__``, so
transformers concludes that package is absent.
"""

from .logprobs import token_logprobs

__all__ = ["token_logprobs"]
