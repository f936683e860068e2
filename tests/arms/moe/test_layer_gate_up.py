"""`gate_up_experts`: the experts on a model's own fused weights, in each layout transformers
declares (`GateUpLayout`), their gradients written in the parameters' own layout. Against
`experts` on the same weights' views (whose gradients autograd rebuilds through slice and
transpose backwards), on every launch path; and no weight-sized copy, fill or add besides the
kernels. On the CPU the kernels run under Triton's interpreter: tiny shapes, fp32."""

from __future__ import annotations

import pytest
import torch

from suite.arms import moe
from suite.arms.moe import GateUpLayout, config, launch, layer
from bitwise import assert_kept_graph_gives_the_reused_bits
from moepaths import PATHS, force_path
from weightcopies import WeightSizedOps

# d and f no multiple of the interpreter's 16-wide tiles, T * k no multiple of its row tile
T, D, F = 13, 24, 20
LAYOUTS = {f"{'in_out' if t else 'out_in'}-{'concatenated' if c else 'interleaved'}": GateUpLayout(t, c)
           for t in (False, True) for c in (True, False)}
# (E, k, capacity factor, a logit shift per expert)
CASES = {
    "top2": (6, 2, None, None),
    "empty-expert": (5, 2, None, torch.tensor([0.0, -30.0, 0.0, 0.0, 0.0])),
    "capacity-drops": (4, 2, 0.75, torch.tensor([2.0, 0.0, 0.0, -1.0])),
}


@pytest.fixture(autouse=True)
def _paths_forced_here_stay_here():
    yield
    config.forget()


def fused_inputs(layout: GateUpLayout, num_experts: int, seed: int = 0, logit_shift=None):
    """x, (gate_up, down) stored in `layout` as a model's parameters are (contiguous), logits,
    grad_out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    gate_up = torch.randn(num_experts, *((D, 2 * F) if layout.transposed else (2 * F, D)), generator=gen) / D**0.5
    down = torch.randn(num_experts, *((F, D) if layout.transposed else (D, F)), generator=gen) / F**0.5
    logits = torch.randn(T, num_experts, generator=gen)
    if logit_shift is not None:
        logits = logits + logit_shift
    return x, (gate_up, down), logits, torch.randn(T, D, generator=gen)


def leaves(x, weights, logits):
    """Fresh leaves requiring gradients: (x, gate_up, down, logits)."""
    return [t.detach().clone().requires_grad_() for t in (x, *weights, logits)]


def forward_backward(layout, leaves, grad_out, k, capacity_factor=None, views=False):
    """-> [out, dx, d gate_up, d down, dlogits]: gate_up_experts on the fused weights, or with
    views, `experts` on their views."""
    x, gate_up, down, logits = leaves
    routing = moe.route(logits, k, capacity_factor=capacity_factor)
    if views:
        out = moe.experts(x, routing, *layout.views(gate_up, down))
    else:
        out = moe.gate_up_experts(x, routing, gate_up, down, transposed=layout.transposed,
                                  concatenated=layout.concatenated)
    out.backward(grad_out)
    return [out.detach(), *(t.grad for t in leaves)]


def run(layout, x, weights, logits, grad_out, k, capacity_factor=None, views=False):
    return forward_backward(layout, leaves(x, weights, logits), grad_out, k, capacity_factor, views)


NAMES = ("out", "dx", "d gate_up", "d down", "dlogits")


# every layout on a plain routing, the edge cases on one layout each (the interpreter is slow)
LAYOUT_CASES = [*((name, "top2") for name in LAYOUTS), ("out_in-concatenated", "empty-expert"),
                ("in_out-interleaved", "capacity-drops")]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name, case", LAYOUT_CASES)
def test_the_fused_weights_give_the_views_values_and_gradients_in_their_own_layout(name, case, path, monkeypatch):
    layout = LAYOUTS[name]
    num_experts, k, capacity_factor, shift = CASES[case]
    x, weights, logits, grad_out = fused_inputs(layout, num_experts, seed=2, logit_shift=shift)
    want = run(layout, x, weights, logits, grad_out, k, capacity_factor, views=True)
    counts = force_path(monkeypatch, path)
    got = run(layout, x, weights, logits, grad_out, k, capacity_factor)
    if layout.concatenated:  # interleaved halves step by 2: no TMA descriptor takes up's weights
        assert counts.times(path, fused=True)
    assert torch.equal(got[0], want[0])  # the forward launches the views' kernels
    for n, g, w in zip(NAMES, got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=n)
    for grad, weight in zip(got[2:4], weights):
        assert grad.shape == weight.shape and grad.stride() == weight.stride()  # AccumulateGrad takes it as it is
    if case == "empty-expert":  # expert 1 has no rows: its gradients are zeros, written, not left
        assert not got[2][1].any() and not got[3][1].any()


def test_the_gradients_reach_the_parameters_with_no_node_between():
    """The experts' node hands gate_up and down their gradients: no slice, transpose or copy
    backward between it and the parameters' AccumulateGrad (what the views take)."""
    layout = LAYOUTS["out_in-concatenated"]
    x, (gate_up, down), logits, _ = fused_inputs(layout, 6)
    gate_up, down = gate_up.requires_grad_(), down.requires_grad_()
    routing = moe.route(logits, 2)
    out = moe.gate_up_experts(x, routing, gate_up, down)
    reached = {id(node.variable) for node, _ in out.grad_fn.next_functions
               if node is not None and type(node).__name__ == "AccumulateGrad"}
    assert {id(gate_up), id(down)} <= reached
    through_views = moe.experts(x, routing, *layout.views(gate_up, down))
    assert not {id(gate_up), id(down)} & {id(node.variable) for node, _ in through_views.grad_fn.next_functions
                                          if node is not None and hasattr(node, "variable")}


@pytest.mark.parametrize("name, path", [*(("out_in-concatenated", path) for path in PATHS),
                                        ("in_out-interleaved", "kernels")])
def test_no_weight_sized_work_besides_the_kernels(name, path, monkeypatch):
    """A forward and backward of gate_up_experts touches weight-sized memory only in its own
    kernels and GEMMs; the same weights through views (experts) are caught zero-filling,
    copying and adding: the watch's teeth."""
    layout = LAYOUTS[name]
    x, weights, logits, grad_out = fused_inputs(layout, 6, seed=4)
    force_path(monkeypatch, path)
    floor = min(w.numel() for w in weights)
    for views in (False, True):
        fresh = leaves(x, weights, logits)
        with WeightSizedOps(floor, monkeypatch) as watched:
            forward_backward(layout, fresh, grad_out, 2, views=views)
        assert bool(watched.found) == views, watched.found


@pytest.mark.parametrize("name", ["out_in-interleaved", "in_out-concatenated"])
def test_the_entry_points_give_the_plans_values_in_a_layout(name, monkeypatch):
    """Where no plan takes a call (an empty dimension, a dtype the entry points refuse), the
    entry points run it and the gradients still come back in the layout."""
    layout = LAYOUTS[name]
    x, weights, logits, grad_out = fused_inputs(layout, 6, seed=5)
    planned = run(layout, x, weights, logits, grad_out, 2)
    monkeypatch.setattr(launch, "layer_plan", lambda *args: None)
    checked = run(layout, x, weights, logits, grad_out, 2)
    for n, a, b in zip(NAMES, planned, checked):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
        assert a.stride() == b.stride(), n


@pytest.mark.parametrize("path", PATHS)
def test_a_backward_that_keeps_the_graph_gives_the_bits_of_one_that_reuses_the_activations(path, monkeypatch):
    force_path(monkeypatch, path)
    layout = LAYOUTS["out_in-concatenated"]
    x, (gate_up, down), logits, grad_out = fused_inputs(layout, 4, seed=6, logit_shift=CASES["capacity-drops"][3])
    leaves = [x.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_()]

    def forward():
        return moe.gate_up_experts(x, moe.route(logits, 2, capacity_factor=0.75), gate_up, down)

    assert_kept_graph_gives_the_reused_bits(forward, leaves, grad_out)


def test_weights_that_do_not_fit_the_layout_are_refused():
    layout = LAYOUTS["out_in-concatenated"]
    x, (gate_up, down), logits, _ = fused_inputs(layout, 6)
    routing = moe.route(logits, 2)
    with pytest.raises(ValueError, match=r"transposed=True takes gate_up_proj \[E, d, 2f\]"):
        moe.gate_up_experts(x, routing, gate_up, down, transposed=True)
    with pytest.raises(ValueError, match="down_proj must be 3-D"):
        moe.gate_up_experts(x, routing, gate_up, down[0])
    with pytest.raises(ValueError, match=r"got \(6, 39, 24\)"):  # 2f odd
        moe.gate_up_experts(x, routing, gate_up[:, 1:], down)
    with pytest.raises(ValueError, match="x must be"):
        moe.gate_up_experts(x[:, 1:], routing, gate_up, down)
    with pytest.raises(TypeError, match="gate_up_proj must be a tensor"):
        moe.gate_up_experts(x, routing, gate_up.tolist(), down)
    with pytest.raises(TypeError, match="routing must be a Routing"):
        moe.gate_up_experts(x, logits, gate_up, down)


def test_the_plan_keeps_one_entry_per_layout():
    """Two layouts of one shape are two call shapes: a plan kept for one never serves the other."""
    weights = {name: fused_inputs(lay, 6)[1] for name, lay in LAYOUTS.items()}
    x = torch.randn(T, D)
    plans = {launch.layer_plan(x, weights[name], lay, 2 * T, 2) for name, lay in LAYOUTS.items()}
    assert len(plans) == len(LAYOUTS) and {p.layout for p in plans} == set(LAYOUTS.values())
    assert launch.layer_plan(x, weights["out_in-concatenated"], LAYOUTS["out_in-concatenated"], 2 * T, 2) in plans
    assert layer.gate_up_experts is moe.gate_up_experts
