"""What tests of several processes share: free ports to launch servers on, and comparing two runs' policies."""

from __future__ import annotations

import socket

import torch


def free_port(consecutive: int = 1) -> int:
    """A port p with p .. p + consecutive - 1 free now (launched server i listens on the pool's port + i)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if all(_bindable(port + i) for i in range(1, consecutive)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def assert_same_policy(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], rtol: float = 1e-5) -> None:
    """Every tensor of ``got`` within ``rtol`` of ``expected``'s, relative to that tensor's largest magnitude."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        scale = tensor.abs().max().clamp(min=1e-12)
        assert float((got[name] - tensor).abs().max() / scale) <= rtol, name
