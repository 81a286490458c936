"""Per-token log-probabilities of the sampled tokens, at the sampling temperature."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)[..., targets]`` in float32; ``logits`` is ``[..., V]``, ``targets`` ``[...]``.

    Example::

        >>> logits = torch.tensor([[0.0, 0.0]])
        >>> token_logprobs(logits, torch.tensor([1])).exp()
        tensor([0.5000])
    """
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
