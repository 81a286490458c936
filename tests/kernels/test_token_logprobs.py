"""The log-prob kernel against log_softmax, in float32 and bfloat16, forward and backward."""

from __future__ import annotations

import pytest
import torch

from lit_parl.kernels import token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_token_logprobs_matches_log_softmax(temperature, dtype):
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(2, 7, 13, generator=generator) * 3
    targets = torch.randint(0, 13, (2, 7), generator=generator)
    weights = torch.randn(2, 7, generator=generator)

    logits = base.clone().to(dtype).requires_grad_(True)
    out = token_logprobs(logits, targets, temperature)
    assert out.shape == (2, 7)
    assert out.dtype == torch.float32  # documented: float32 whatever the logits' dtype
    (out * weights.to(out.dtype)).sum().backward()

    reference_logits = base.clone().to(dtype).double().requires_grad_(True)
    expected = torch.log_softmax(reference_logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    (expected * weights.double()).sum().backward()

    torch.testing.assert_close(out.double(), expected.detach(), atol=1e-5, rtol=1e-5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, atol=tol, rtol=tol)
