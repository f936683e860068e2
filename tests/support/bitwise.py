"""Bit-pattern comparisons for tests that claim the same bits (-0.0 against 0.0 and NaN
payloads count, as the gates' bitwise parity counts them)."""

from __future__ import annotations

import torch


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of t, as integers of its element size."""
    return t.detach().contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((bits(a) == bits(b)).all())


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    differ = (bits(a) != bits(b)).sum().item()
    assert differ == 0, f"{what}: {differ} of {a.numel()} elements differ in bits"


def assert_kept_graph_gives_the_reused_bits(forward, leaves: list[torch.Tensor], grad_out: torch.Tensor) -> None:
    """Two backwards through one graph kept (retain_graph) and one through a fresh forward whose
    graph is freed (its buffers reused) give the same gradients, bit for bit."""
    out = forward()
    kept = [torch.autograd.grad(out, leaves, grad_out, retain_graph=True) for _ in range(2)]
    reused = torch.autograd.grad(forward(), leaves, grad_out)
    for first, second, third in zip(*kept, reused):
        assert torch.equal(first, second) and torch.equal(first, third)
