"""suite.arms.moe.activation: the clamped SwiGLU and GeGLU, their closed-form derivatives, and
the kernels that compute them (interpreted, fp32), eager and under torch.compile, against the
reference and the float64 truth."""

from __future__ import annotations

import math

import pytest
import torch

from gates.moe_truth import experts_truth
from suite.arms.moe import GateUpLayout, GeGLU, MoEExperts, SwiGLU, experts, experts_reference, gate_up_experts, route
from suite.arms.moe import launch
from suite.arms.moe.activation import activation_of
from moepaths import PATHS, force_path

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CLAMPED = [SwiGLU(0.6, "gate"), SwiGLU(0.3, "silu")]
# every activation besides plain SwiGLU, and their ids
OTHERS, OTHER_IDS = [*CLAMPED, GeGLU()], ["gate", "silu", "geglu"]


@pytest.mark.parametrize("limit, clamp, error", [
    (True, "gate", TypeError), ("1", "gate", TypeError), (0.0, "gate", ValueError), (-1.0, "gate", ValueError),
    (math.inf, "gate", ValueError), (math.nan, "gate", ValueError), (1.0, "up", ValueError)])
def test_a_bad_limit_or_clamp_is_named(limit, clamp, error):
    with pytest.raises(error, match="SwiGLU: (limit|clamp) must"):
        SwiGLU(limit, clamp)


def test_the_kernels_mode_and_limit_round_trip():
    assert SwiGLU().mode == 0 and SwiGLU().kernel_limit == 0.0 and SwiGLU(2) == SwiGLU(2.0, "gate")
    for activation in [SwiGLU(), *OTHERS]:
        assert activation_of(activation.mode, activation.kernel_limit) == activation
    assert len({activation.mode for activation in [SwiGLU(), *OTHERS]}) == 4


@pytest.mark.parametrize("swiglu", [SwiGLU(), *OTHERS], ids=["plain", *OTHER_IDS])
def test_the_closed_form_backward_is_autograds_bounds_included(swiglu):
    """At and past every bound: torch's clamp passes the gradient at the bound, none past it.
    GeGLU's: torch's gelu(approximate="tanh") and its autograd."""
    limit = swiglu.limit or 1.0
    points = torch.tensor([-9.0, -3.0, -limit, -0.2, 0.0, 0.25, limit, 3.0, 9.0], dtype=torch.float64)
    gate, up = torch.meshgrid(points, points, indexing="ij")
    if swiglu.limit is not None and swiglu.clamp == "silu":  # a gate whose silu is the limit itself
        silu_at_limit = torch.tensor(0.5, dtype=torch.float64)
        for _ in range(60):  # Newton on silu(g) = limit
            sig = torch.sigmoid(silu_at_limit)
            silu_at_limit -= (silu_at_limit * sig - limit) / (sig * (1 + silu_at_limit * (1 - sig)))
        gate = torch.cat([gate, torch.full_like(points, silu_at_limit.item())[None]])
        up = torch.cat([up, points[None]])
    gate, up = gate.requires_grad_(), up.requires_grad_()
    d_a = torch.linspace(-1, 1, gate.numel(), dtype=torch.float64).view_as(gate)
    want = torch.autograd.grad(swiglu(gate, up), (gate, up), d_a)
    got = swiglu.backward(d_a, gate.detach(), up.detach())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def _layer(seed=0, tokens=19, d=40, f=24, num_experts=5, k=2, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=gen)
    weights = [torch.randn(num_experts, d, f, generator=gen) * d**-0.5,
               torch.randn(num_experts, d, f, generator=gen) * d**-0.5,
               torch.randn(num_experts, f, d, generator=gen) * f**-0.5]
    logits = torch.randn(tokens, num_experts, generator=gen)
    x, *weights, logits, grad_out = (t.to(device) for t in (x, *weights, logits, torch.randn(tokens, d, generator=gen)))
    return x, weights, logits.requires_grad_(), grad_out, k


def _grads(fn, x, weights, routing, grad_out, **kwargs):
    x = x.clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in weights]
    out = fn(x, routing, *weights, **kwargs)
    return [out.detach(), *torch.autograd.grad(out, (x, *weights, routing.probs), grad_out)]


def _max_error(got, truth):
    return max(((g.double() - t).abs().max() / t.abs().max()).item() for g, t in zip(got, truth))


@pytest.mark.parametrize("swiglu", OTHERS, ids=OTHER_IDS)
def test_the_kernels_clamp_as_the_reference_and_the_truth(swiglu):
    x, weights, logits, grad_out, k = _layer()
    routing = route(logits, k)
    truth = experts_truth(x, routing, *weights, grad_out, swiglu)
    truth = [truth[n] for n in ("out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs")]
    reference = _grads(experts_reference, x, weights, routing, grad_out, activation=swiglu)
    arm = _grads(experts, x, weights, routing, grad_out, activation=swiglu)
    assert _max_error(reference, truth) < 1e-5 and _max_error(arm, truth) < 1e-5
    # the clamp bites at these limits, and gelu is not silu: plain SwiGLU's numbers are far from them
    assert _max_error(_grads(experts, x, weights, routing, grad_out), truth) > 0.05
    if swiglu.limit is None:
        return
    # a clamped pre-activation passes no gradient, so some rows of d_a meet zeros: not a no-op
    g = launch.expert_up(x, weights[0], weights[1], routing.token_of_row, routing.offsets)[1]
    assert 0.1 < (g[: int(routing.offsets[-1])] > swiglu.limit).float().mean() < 0.9


@pytest.mark.parametrize("swiglu", OTHERS, ids=OTHER_IDS)
@pytest.mark.parametrize("layout", [GateUpLayout(False, True), GateUpLayout(True, False)],
                         ids=["out_in", "in_out_interleaved"])
def test_a_models_fused_weights_take_the_clamp(swiglu, layout):
    x, weights, logits, grad_out, k = _layer(seed=1)
    routing = route(logits, k)
    want = _grads(experts, x, weights, routing, grad_out, activation=swiglu)
    num_experts, d, f = weights[0].shape
    gate_up = torch.empty((num_experts, d, 2 * f) if layout.transposed else (num_experts, 2 * f, d))
    down = torch.empty((num_experts, f, d) if layout.transposed else (num_experts, d, f))
    for view, w in zip(layout.views(gate_up, down), weights):
        view.copy_(w)
    got = _grads(lambda x, r, gu, dn, **kw: gate_up_experts(x, r, gu, dn, transposed=layout.transposed,
                                                             concatenated=layout.concatenated, **kw),
                 x, [gate_up, down], routing, grad_out, activation=swiglu)
    d_weights = [g.contiguous() for g in layout.views(got[2], got[3])]
    assert torch.equal(got[0], want[0])  # the forward: the same kernels through the views
    for g, w in zip([got[1], *d_weights, got[4]], want[1:]):  # dx: one GEMM over 2f, another order
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("swiglu", [CLAMPED[1], GeGLU()], ids=["silu", "geglu"])
def test_the_clamp_under_torch_compile_gives_the_eager_bits(swiglu):
    x, weights, logits, grad_out, k = _layer(seed=2)
    routing = route(logits, k)
    eager = _grads(experts, x, weights, routing, grad_out, activation=swiglu)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(experts, backend="aot_eager", fullgraph=True)
        got = _grads(compiled, x, weights, routing, grad_out, activation=swiglu)
    finally:
        torch._dynamo.reset()
    for g, w in zip(got, eager):
        assert torch.equal(g, w)


def test_moe_experts_clamps_fused_as_eager():
    torch.manual_seed(0)
    layer = MoEExperts(24, 16, 4, 2, swiglu_limit=0.2, swiglu_clamp="silu")
    x = torch.randn(2, 7, 24)
    fused = layer(x)
    layer.impl = "eager"
    torch.testing.assert_close(fused, layer(x), rtol=1e-5, atol=1e-6)
    assert "swiglu_limit=0.2, swiglu_clamp='silu'" in repr(layer)
    with pytest.raises(ValueError, match="SwiGLU: limit must be finite"):
        MoEExperts(24, 16, 4, 2, swiglu_limit=-1.0)


def test_moe_experts_geglu_fused_as_eager():
    torch.manual_seed(0)
    layer = MoEExperts(24, 16, 4, 2, glu="geglu")
    x = torch.randn(2, 7, 24)
    fused = layer(x)
    layer.impl = "eager"
    torch.testing.assert_close(fused, layer(x), rtol=1e-5, atol=1e-6)
    assert "glu='geglu'" in repr(layer) and "glu=" not in repr(MoEExperts(24, 16, 4, 2))
    with pytest.raises(ValueError, match="MoEExperts: glu must be one of"):
        MoEExperts(24, 16, 4, 2, glu="reglu")
    with pytest.raises(ValueError, match="GeGLU experts take none"):
        MoEExperts(24, 16, 4, 2, glu="geglu", swiglu_limit=7.0)


def test_geglu_at_extreme_gates_is_gelus_without_nan():
    """The kernels' gelu is x * sigmoid(2 z): within fp32's rounding of the float64 gelu in its
    tails too (torch's fp32 0.5 x (1 + tanh z) cancels there), and where z^3 overflows fp32
    (|g| ~ 1e13 and past) the value and slope are gelu's limits (g and 1; 0 and 0)."""
    points = torch.tensor([-1e30, -1e13, -60.0, -5.0, -0.5, 0.0, 0.5, 5.0, 60.0, 1e13, 1e30])
    n = points.numel()
    x = points[:, None].expand(n, 16).contiguous()
    eye = torch.eye(16)[None]
    token_of_row, offsets = torch.arange(n, dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    a, g, u = launch.expert_up(x, eye, eye, token_of_row, offsets, activation=GeGLU())
    gate = x.double().requires_grad_()
    gelu = torch.nn.functional.gelu(gate, approximate="tanh")
    slope = torch.autograd.grad(gelu.sum(), gate)[0]
    assert torch.equal(g, x) and not a.isnan().any()
    torch.testing.assert_close(a, (gelu * gate).detach().float(), rtol=1e-6, atol=0)  # g * g: inf at 1e30
    dg, du = torch.empty_like(g), torch.empty_like(u)
    launch.swiglu_backward(torch.ones(n, 16), g, torch.ones_like(u), offsets, dg, du, GeGLU())
    assert not dg.isnan().any()
    torch.testing.assert_close(dg.double(), slope, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(du.double(), gelu.detach(), rtol=1e-6, atol=0)


def test_an_activation_that_is_not_a_swiglu_is_named():
    x, weights, logits, _, k = _layer()
    with pytest.raises(TypeError, match="experts: activation must be a suite.arms.moe.SwiGLU or GeGLU"):
        experts(x, route(logits, k), *weights, activation="silu")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("swiglu", OTHERS, ids=OTHER_IDS)
def test_on_the_gpu_every_path_clamps_within_the_bf16_references_error(path, swiglu, monkeypatch):
    """bf16 on tensor cores, each launch path forced (the TMA forward's epilogue, the grouped_mm
    backward's SwiGLU pass), d and f no multiple of the tiles: as close to the float64 truth
    as the bf16 reference, and the same bits run to run."""
    if path != "kernels" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA and the grouped_mm path are taken on sm90 alone")
    counts = force_path(monkeypatch, path)
    x, weights, logits, grad_out, k = _layer(seed=3, tokens=300, d=264, f=200, num_experts=6, device="cuda")
    x, grad_out, *weights = (t.bfloat16() for t in (x, grad_out, *weights))
    routing = route(logits, k)
    truth = experts_truth(x, routing, *weights, grad_out, swiglu)
    truth = [truth[n] for n in ("out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs")]
    reference = _grads(experts_reference, x, weights, routing, grad_out, activation=swiglu)
    arm = _grads(experts, x, weights, routing, grad_out, activation=swiglu)
    assert counts.times(path)
    for name, a, r, t in zip(("out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs"), arm, reference, truth):
        error, reference_error = (((v.double() - t).norm() / t.norm()).item() for v in (a, r))
        assert error <= 2 * reference_error + 1e-6, (name, error, reference_error)
    again = _grads(experts, x, weights, routing, grad_out, activation=swiglu)
    assert all(torch.equal(a, b) for a, b in zip(arm, again))
