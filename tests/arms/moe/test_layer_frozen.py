"""Frozen experts: a gradient autograd does not want (a weight that does not require grad, or x)
is None and its GEMMs are not run, as stock's grouped_mm skips them, and the wanted gradients
keep a full backward's bits. Three weights and a model's fused two, eager (the kept LayerPlan)
and compiled (the backward op), and a tiny model whose experts are frozen. On the CPU the
kernels run under Triton's interpreter: tiny shapes, fp32."""

from __future__ import annotations

import pytest
import torch

from suite.arms import moe
from suite.arms.moe import GateUpLayout, config, launch, layer
from moepaths import force_path

T, D, F, E, K = 13, 24, 20, 5, 2
FUSED = GateUpLayout(transposed=False, concatenated=True)  # OLMoE's and Qwen3-MoE's layout


@pytest.fixture(autouse=True)
def _paths_forced_here_stay_here():
    yield
    config.forget()


def inputs(layout: GateUpLayout | None, seed: int = 0):
    """x, the weights (w_gate, w_up, w_down, or a layout's gate_up and down), logits, grad_out."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w_gate, w_up = (torch.randn(E, D, F, generator=gen) / D**0.5 for _ in range(2))
    w_down = torch.randn(E, F, D, generator=gen) / F**0.5
    if layout is None:
        weights = (w_gate, w_up, w_down)
    else:
        weights = (torch.cat((w_gate, w_up), 2).transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous())
    return x, weights, torch.randn(T, E, generator=gen), torch.randn(T, D, generator=gen)


def run(layout, x, weights, logits, grad_out, frozen=(), compiled=False):
    """-> (the grads of x, each weight and the logits: None for a frozen one, out). frozen:
    names among "x" and the weights' indices."""
    x = x.detach().clone().requires_grad_("x" not in frozen)
    weights = [w.detach().clone().requires_grad_(i not in frozen) for i, w in enumerate(weights)]
    logits = logits.detach().clone().requires_grad_()

    def layer(x, weights, logits):
        routing = moe.route(logits, K)
        if layout is None:
            return moe.experts(x, routing, *weights)
        return moe.gate_up_experts(x, routing, *weights, transposed=layout.transposed,
                                   concatenated=layout.concatenated)

    out = (torch.compile(layer, fullgraph=True, dynamic=False) if compiled else layer)(x, weights, logits)
    out.backward(grad_out)
    return [x.grad, *(w.grad for w in weights), logits.grad], out.detach()


def spy_on_the_kept_plan(monkeypatch, layout, x, weights, logits) -> dict[str, int]:
    """Counts of the kept plan's weight-gradient and dx launches from here on."""
    routing = moe.route(logits, K)
    plan = launch.layer_plan(x, weights, layout, routing.token_of_row.shape[0], K)
    calls = {"dw_gate_up": 0, "dw_down": 0, "dx": 0}
    for name in calls:
        launched = getattr(plan, name)

        def counted(*args, _name=name, _launched=launched):
            calls[_name] += 1
            return _launched(*args)

        monkeypatch.setattr(plan, name, counted)
    return calls


def vendor_gemms(layout, frozen) -> int:
    """torch._grouped_mm's calls in a backward on the vendor path: d_a (while anything below
    the SwiGLU is wanted), down's gradient, and gate and up's (one GEMM for a fused gate_up)."""
    n_weights = 3 if layout is None else 2
    gate_up = [i for i in range(n_weights - 1) if i not in frozen]
    wants_down = n_weights - 1 not in frozen
    below = "x" not in frozen or gate_up
    return bool(below) + wants_down + (bool(gate_up) * (2 if layout is None else 1))


# (which weights are frozen, by index, or x; the plan's launches that must not run)
SEPARATE = [((0, 1, 2), ("dw_gate_up", "dw_down")), ((2,), ("dw_down",)), ((0, 1), ("dw_gate_up",)),
            (("x",), ("dx",)), (("x", 0, 1, 2), ("dw_gate_up", "dw_down", "dx"))]
FUSED_CASES = [((0, 1), ("dw_gate_up", "dw_down")), ((0,), ("dw_gate_up",)), ((1,), ("dw_down",)),
               (("x",), ("dx",))]
CASES = [*(("kernels", None, frozen, skipped) for frozen, skipped in SEPARATE),
         *(("kernels", FUSED, frozen, skipped) for frozen, skipped in FUSED_CASES),
         # d_a and the weight gradients through torch._grouped_mm (the H200's path at the model presets)
         ("tma+grads", None, (0, 1, 2), ()), ("tma+grads", FUSED, (0, 1), ()), ("tma+grads", None, ("x",), ()),
         ("tma+grads", FUSED, ("x",), ())]


@pytest.mark.parametrize("path, layout, frozen, skipped", CASES)
def test_a_frozen_input_gets_no_gradient_and_its_gemms_do_not_run(monkeypatch, path, layout, frozen, skipped):
    counts = force_path(monkeypatch, path)
    x, weights, logits, grad_out = inputs(layout)
    full, out = run(layout, x, weights, logits, grad_out)
    assert counts.times(path, fused=layout is not None)  # the path ran, not a fallback
    calls = spy_on_the_kept_plan(monkeypatch, layout, x, weights, logits)
    counts.grouped_mm.clear()
    got, frozen_out = run(layout, x, weights, logits, grad_out, frozen)
    assert torch.equal(frozen_out, out)
    names = ["x", *range(len(weights)), "logits"]
    for name, want, have in zip(names, full, got):
        if name in frozen:
            assert have is None, name
        else:
            assert have is not None and torch.equal(have, want), name
    if path == "kernels":
        assert {name for name, count in calls.items() if count == 0} == set(skipped), calls
    else:
        assert len(counts.grouped_mm) == vendor_gemms(layout, frozen), counts.grouped_mm
        assert calls["dx"] == ("x" not in frozen)


@pytest.mark.parametrize("layout, frozen", [(None, (2,)), (FUSED, (0,))])
def test_without_a_kept_plan_a_frozen_input_leaves_the_rest_as_they_are(monkeypatch, layout, frozen):
    """The calls no plan takes run through the entry points, which compute every gradient and
    drop the ones not wanted: the rest keep a full backward's bits."""
    x, weights, logits, grad_out = inputs(layout, seed=2)
    monkeypatch.setattr(layer, "_plan", lambda *args: None)
    full, _ = run(layout, x, weights, logits, grad_out)
    got, _ = run(layout, x, weights, logits, grad_out, frozen)
    for name, want, have in zip(["x", *range(len(weights)), "logits"], full, got):
        assert have is None if name in frozen else torch.equal(have, want), name


def test_compiled_a_frozen_weight_gets_no_gradient_and_the_rest_keep_their_bits():
    x, weights, logits, grad_out = inputs(FUSED, seed=1)
    full, _ = run(FUSED, x, weights, logits, grad_out, compiled=True)
    got, _ = run(FUSED, x, weights, logits, grad_out, frozen=(0,), compiled=True)
    assert got[1] is None
    for name, want, have in zip(("x", "gate_up", "down", "logits"), full, got):
        if name != "gate_up":
            assert torch.equal(have, want), name


def test_a_model_with_frozen_experts_trains_the_rest_as_with_them_unfrozen():
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("the experts interface needs transformers >= 5")
    from hfmodels import tiny

    from suite.integrations.transformers import use_suite_experts

    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    grads = []
    for freeze in (False, True):
        model = tiny("olmoe")
        use_suite_experts(model)
        experts = {name for name, _ in model.named_parameters() if ".experts." in name}
        assert experts
        for name, p in model.named_parameters():
            p.requires_grad_(not (freeze and name in experts))
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    unfrozen, frozen = grads
    for name, grad in frozen.items():
        if name in experts:
            assert grad is None, name
        else:
            assert torch.equal(grad, unfrozen[name]), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_frozen_experts_run_none_of_their_grouped_mm_gemms(monkeypatch):
    """A bf16 layer that the H200 sends through torch._grouped_mm (the size rule's smallest
    work an expert), a model's fused weights frozen: d_a is the backward's one grouped GEMM,
    and dx and the logits' gradient keep the bits of a backward that wanted everything."""
    tokens, d, f, n_experts = 4096, 1024, 768, 2
    device = torch.device("cuda")
    if not config.vendor_gemms(tokens, n_experts, d, f, torch.bfloat16, device):
        pytest.skip("this GPU keeps the weight gradients on our kernels (vendor_gemms: sm90 only)")
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, d, generator=gen, device=device, dtype=torch.bfloat16)
    weights = (torch.randn(n_experts, 2 * f, d, generator=gen, device=device, dtype=torch.bfloat16) / d**0.5,
               torch.randn(n_experts, d, f, generator=gen, device=device, dtype=torch.bfloat16) / f**0.5)
    logits = torch.randn(tokens, n_experts, generator=gen, device=device)
    grad_out = torch.randn(tokens, d, generator=gen, device=device, dtype=torch.bfloat16)
    calls = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(a[0].shape) or grouped_mm(*a, **kw))

    def layer(frozen):
        leaves = [x.clone().requires_grad_(), *(w.clone().requires_grad_(not frozen) for w in weights),
                  logits.clone().requires_grad_()]
        routing = moe.route(leaves[-1], 1)
        moe.gate_up_experts(leaves[0], routing, *leaves[1:3]).backward(grad_out)
        return [t.grad for t in leaves]

    full = layer(frozen=False)
    assert len(calls) == 3  # d_a, d down_proj, d gate_up_proj
    calls.clear()
    frozen = layer(frozen=True)
    assert len(calls) == 1 and frozen[1] is None and frozen[2] is None
    assert torch.equal(frozen[0], full[0]) and torch.equal(frozen[3], full[3])
