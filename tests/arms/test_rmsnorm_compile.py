"""rms_norm inside torch.compile: custom ops with fake shapes and autograd, no graph break, the
same bits as the eager path. On the CPU the kernels run under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from suite.arms import rmsnorm as arm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, torch.float32)
    dy = torch.randn(shape, generator=gen).to(DEVICE, torch.bfloat16)
    return x, weight, dy


def norm(x, weight):
    return arm.rms_norm(x, weight, 1e-6, 0.0)


def y_dx_dw(fn, x, weight, dy):
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = fn(x, weight)
    return (y.detach(), *torch.autograd.grad(y, (x, weight), dy))


def assert_same_bits(got, expected):
    for name, g, e in zip(("y", "dx", "dw"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        view = torch.int16 if g.element_size() == 2 else torch.int32
        assert torch.equal(g.view(view), e.view(view)), name


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_traces_to_one_graph_of_custom_ops():
    x, weight, _ = make((3, 5, 96))
    explained = torch._dynamo.explain(norm)(x, weight)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    assert "suite.rms_norm_fwd" in explained.graphs[0].code


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_compile_gives_the_eager_bits(backend):
    x, weight, dy = make((3, 5, 96))
    expected = y_dx_dw(norm, x, weight, dy)
    compiled = torch.compile(norm, fullgraph=True, backend=backend)
    assert_same_bits(y_dx_dw(compiled, x, weight, dy), expected)


def test_dynamic_row_count_compiles_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(norm, fullgraph=True, backend=counter, dynamic=True)
    for rows in (7, 13, 40):
        x, weight, dy = make((rows, 96), seed=rows)
        assert_same_bits(y_dx_dw(compiled, x, weight, dy), y_dx_dw(norm, x, weight, dy))
    assert counter.frame_count == 1


def test_eager_calls_skip_the_custom_op(monkeypatch):
    def dispatched(*args):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(arm, "_rms_norm_fwd_op", dispatched)
    x, weight, dy = make((3, 5, 96))
    y_dx_dw(norm, x, weight, dy)
    with torch.no_grad():
        norm(x, weight)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dynamic", [False, True])
def test_inductor_gives_the_eager_bits(dynamic):
    x, weight, dy = make((4, 256, 2048))
    compiled = torch.compile(norm, fullgraph=True, dynamic=dynamic)
    assert_same_bits(y_dx_dw(compiled, x, weight, dy), y_dx_dw(norm, x, weight, dy))
