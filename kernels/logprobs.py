"""Per-token log-probabilities of the sampled tokens, at the sampling temperature.

``token_logprobs`` works from logits. ``linear_token_logprobs`` works from hidden states and the LM head
weight, and never materialises the ``[N, V]`` float32 logits for all tokens at once. It computes them
``chunk_size`` rows at a time (logsumexp and target logit), and the backward pass recomputes each
chunk. With a 150k vocabulary and 16k label tokens, that is 9.8 GB of float32 logits avoided for a
memory of ``chunk_size × V``.
"""

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


class _LinearTokenLogprobs(torch.autograd.Function):
    """Outputs (log-prob of the target, entropy of the distribution) per row; both differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        ctx.set_materialize_grads(False)
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk_size):
            end = start + chunk_size
            logits = torch.nn.functional.linear(hidden[start:end], weight, bias).float() / temperature
            log_p = logits.log_softmax(-1)
            logprobs[start:end] = log_p.gather(-1, targets[start:end, None])[:, 0]
            entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        T = ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_bias = (
            torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b and bias is not None else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            h = hidden[start:end]
            log_p = (torch.nn.functional.linear(h, weight, bias).float() / T).log_softmax(-1)
            p = log_p.exp()
            g = torch.zeros_like(p)  # d loss / d (logits / T)
            if grad_logprobs is not None:  # d log p_y = onehot(y) - p
                gl = grad_logprobs[start:end, None]
                g -= p * gl
                g.scatter_add_(-1, targets[start:end, None], gl)
            if grad_entropy is not None:  # d H = -p (log p + H)
                g -= p * (log_p + entropy[start:end, None]) * grad_entropy[start:end, None]
            g /= T
            if need_h:
                grad_hidden[start:end] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                grad_weight += g.t() @ h.float()
            if grad_bias is not None:
                grad_bias += g.sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax((hidden @ weight.T + bias) / T)[targets]`` for ``hidden`` ``[N, d]``, in chunks;
    with ``with_entropy`` also the entropy of each row's distribution (differentiable too).

    Example::

        >>> h, w = torch.randn(5, 4), torch.randn(7, 4)
        >>> t = torch.tensor([0, 1, 2, 3, 4])
        >>> torch.allclose(linear_token_logprobs(h, w, t, chunk_size=2), token_logprobs(h @ w.T, t))
        True
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logprobs, entropy = _LinearTokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size))
    return (logprobs, entropy) if with_entropy else logprobs
