"""The MoE arm inside torch.compile: the routing's and the experts' one autograd node each, the
same nodes eager calls take, with the kernels inside them as custom ops with fake shapes: no
graph break, the eager arm's bits. On the CPU the kernels run under
Triton's interpreter (the aot_eager backend: inductor's CPU code is not what a GPU user runs)."""

from __future__ import annotations

import pytest
import torch

from suite.arms import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIDDEN, FFN, EXPERTS, K = 16, 12, 4, 2


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer(capacity_factor=None, dtype=torch.float32, device=DEVICE, hidden=HIDDEN, ffn=FFN, experts=EXPERTS, k=K):
    torch.manual_seed(0)
    return moe.MoEExperts(hidden, ffn, experts, k, capacity_factor=capacity_factor, device=device, dtype=dtype)


def inputs(tokens, dtype=torch.float32, device=DEVICE, hidden=HIDDEN, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    return x, (torch.randn(tokens, hidden, generator=gen) * 1e-2).to(device, dtype)


def out_and_grads(fn, module, x, dy):
    """The output and the gradients of x and every parameter (the router's too)."""
    x = x.detach().requires_grad_()
    out = fn(x)
    params = [p for _, p in sorted(module.named_parameters())]
    return [out.detach(), *torch.autograd.grad(out, [x, *params], dy)]


def assert_same_bits(got, expected):
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, i
        assert torch.equal(g.view(torch.uint8), e.view(torch.uint8)) if g.numel() else True, i


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_the_layer_traces_to_one_graph_of_custom_ops(capacity_factor):
    module = layer(capacity_factor)
    x, _ = inputs(9)
    explained = torch._dynamo.explain(module)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    graph = explained.graphs[0]
    # the autograd node's forward and backward bodies, each a subgraph of the one graph
    code = "".join(m.code for m in graph.modules() if isinstance(m, torch.fx.GraphModule))
    assert "autograd_function_apply" in graph.code
    assert all(f"suite.moe_{op}" in code for op in ("route", "experts", "experts_backward", "route_backward")), code


def test_routing_from_topk_traces_without_a_break():
    def model_router(x, weight):
        probs = torch.softmax(x @ weight, dim=-1)
        top_w, top_i = torch.topk(probs, K)
        return moe.routing_from_topk(top_i, top_w, EXPERTS).offsets

    x, _ = inputs(9)
    explained = torch._dynamo.explain(model_router)(x, torch.randn(HIDDEN, EXPERTS, device=DEVICE))
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("capacity_factor", [None, 0.75, 1.0])
def test_fullgraph_compile_gives_the_eager_bits(capacity_factor):
    module = layer(capacity_factor)
    x, dy = inputs(9)
    expected = out_and_grads(module, module, x, dy)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    assert_same_bits(out_and_grads(compiled, module, x, dy), expected)


@pytest.mark.parametrize("transposed, concatenated", [(False, True), (True, False)])
def test_a_models_fused_weights_compile_to_the_eager_bits_in_their_layout(transposed, concatenated):
    """gate_up_experts under fullgraph compile: the same node, its ops given the two weights and
    the layout's flags; the eager bits, and gradients in the parameters' layout."""
    torch.manual_seed(0)
    gate_up, down = (p.requires_grad_() for p in fused_weights(
        [torch.randn(EXPERTS, *shape, device=DEVICE) * 0.3 for shape in ((HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN))],
        transposed, concatenated))
    router = torch.randn(HIDDEN, EXPERTS, device=DEVICE)
    x, dy = inputs(9)

    def step(x):
        routing = moe.route(x @ router, K)
        return moe.gate_up_experts(x, routing, gate_up, down, transposed=transposed, concatenated=concatenated)

    def out_and_weight_grads(fn):
        x_leaf = x.detach().requires_grad_()
        out = fn(x_leaf)
        return [out.detach(), *torch.autograd.grad(out, [x_leaf, gate_up, down], dy)]

    expected = out_and_weight_grads(step)
    got = out_and_weight_grads(torch.compile(step, fullgraph=True, backend="aot_eager"))
    assert_same_bits(got, expected)
    assert got[2].stride() == gate_up.stride() and got[3].stride() == down.stride()


def test_a_compiled_backward_reuses_the_saved_activations_only_where_no_graph_is_kept(monkeypatch):
    """The backward op's temporaries go into the forward's a, gu and y_rows where the running
    backward keeps no graph (the eager node's rule, read at run time inside the op); a kept graph
    (retain_graph, with AOT's donated buffers off, else it refuses) keeps them intact: a second
    backward through it gives the first one's bits, and both the eager ones."""
    import torch._functorch.config as functorch_config

    from suite.arms.moe import layer as moe_layer

    reused = []
    backward = moe_layer._experts_backward

    def spy(*args, reuse_saved=False, **kwargs):
        reused.append(reuse_saved)
        return backward(*args, reuse_saved=reuse_saved, **kwargs)

    monkeypatch.setattr(moe_layer, "_experts_backward", spy)
    module = layer()
    x, dy = inputs(9)
    expected = out_and_grads(module, module, x, dy)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    reused.clear()
    assert_same_bits(out_and_grads(compiled, module, x, dy), expected)
    assert reused == [True]
    params = [p for _, p in sorted(module.named_parameters())]
    with functorch_config.patch(donated_buffer=False):
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        x_leaf = x.detach().requires_grad_()
        out = compiled(x_leaf)
        reused.clear()
        kept = torch.autograd.grad(out, [x_leaf, *params], dy, retain_graph=True)
        again = torch.autograd.grad(out, [x_leaf, *params], dy)
    assert reused == [False, True]
    assert_same_bits(list(kept), expected[1:])
    assert_same_bits(list(again), expected[1:])


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_one_layer_called_twice_on_one_input_keeps_two_sets_of_saved_activations(backend):
    """AOTAutograd's CSE merges pure calls on the same inputs: without the call's own token the
    two forwards become one, and the first backward's temporaries land in the activations the
    second one reads (gradients off by whole units)."""
    module = layer()
    x, dy = inputs(9)
    other = torch.randn(dy.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 1e-2

    def twice(x):
        return module(x), module(x)

    def grads(fn):
        x_leaf = x.detach().requires_grad_()
        params = [p for _, p in sorted(module.named_parameters())]
        return torch.autograd.grad(fn(x_leaf), [x_leaf, *params], (dy, other))

    expected = grads(twice)
    got = grads(torch.compile(twice, fullgraph=True, backend=backend))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_dynamic_token_counts_compile_once():
    from torch._dynamo.testing import CompileCounterWithBackend

    module = layer(1.25)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, fullgraph=True, backend=counter, dynamic=True)
    for tokens in (7, 13, 22):
        x, dy = inputs(tokens, seed=tokens)
        assert_same_bits(out_and_grads(compiled, module, x, dy), out_and_grads(module, module, x, dy))
    assert counter.frame_count == 1


@pytest.mark.parametrize("fused", [True, False])
def test_eager_calls_skip_the_custom_ops(fused):
    """An eager call pays no custom op's dispatch: the autograd nodes launch the kernels
    themselves. The ops' calls would show in a dispatch mode; the aten ops' do (the check's teeth)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.namespaces = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.namespaces.add(func.namespace)
            return func(*args, **(kwargs or {}))

    module = layer(1.0)
    x, dy = inputs(9)
    seen = Seen()
    with seen:
        if fused:
            out_and_grads(module, module, x, dy)
        else:
            routing = moe.route(module.router(x), K, capacity_factor=1.0)
            out = moe.experts(x, routing, module.w_gate, module.w_up, module.w_down)
            torch.autograd.grad(out, [module.w_gate, module.router.weight], dy)
    assert "aten" in seen.namespaces and "suite" not in seen.namespaces


def _op_args(tokens=9):
    """The ops' inputs: none requires a gradient, since the ops carry no autograd of their own
    (the autograd nodes that call them do)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(tokens, EXPERTS, generator=gen).to(DEVICE)
    routing = moe.route(logits, K)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE)
    weights = [(torch.randn(EXPERTS, *shape, generator=gen) * 0.3).to(DEVICE)
               for shape in ((HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN))]
    return logits, routing, x, routing.probs, weights


def fused_weights(weights, transposed, concatenated):
    """(gate_up, down) as a model stores w_gate, w_up and w_down in that layout."""
    w_gate, w_up, w_down = weights
    pair = torch.cat((w_gate, w_up), 2) if concatenated else torch.stack((w_gate, w_up), 3).flatten(2)
    return ([pair.contiguous(), w_down.contiguous()] if transposed
            else [pair.transpose(1, 2).contiguous(), w_down.transpose(1, 2).contiguous()])


def test_opcheck_passes_for_each_op():
    logits, r, x, probs, weights = _op_args()
    slots = 9 * K
    for renormalize, capacity, z_loss in ((True, slots, True), (False, 3, False)):
        max_rows = min(slots, EXPERTS * capacity)
        torch.library.opcheck(torch.ops.suite.moe_route, (logits, K, renormalize, capacity, max_rows, z_loss))
    torch.library.opcheck(torch.ops.suite.moe_layout, (r.expert_ids, EXPERTS, slots, slots))
    torch.library.opcheck(torch.ops.suite.moe_layout, (r.expert_ids, EXPERTS, 3, EXPERTS * 3))
    layout = (r.token_of_row, r.offsets, r.row_id_map)
    # three weights, then a model's fused two in each layout its flags name
    for given, flags in ((weights, (False, True)), *(
            (fused_weights(weights, transposed, concatenated), (transposed, concatenated))
            for transposed in (False, True) for concatenated in (True, False))):
        # plain SwiGLU; the clamped ones and GeGLU (the activation's mode, limit) on the three weights alone
        for act in ((0, 0.0), (1, 0.6), (2, 0.3), (3, 0.0))[:4 if given is weights else 1]:
            token = torch.empty(0, device=DEVICE)
            torch.library.opcheck(torch.ops.suite.moe_experts, (x, probs, given, *layout, *flags, *act, token))
            out, a, gu, y_rows = torch.ops.suite.moe_experts(x, probs, given, *layout, *flags, *act, token)
            grad_out = torch.randn_like(out)
            for wanted in ((True, True, True), (True, False, False), (False, False, True)):  # all, frozen, x too
                torch.library.opcheck(torch.ops.suite.moe_experts_backward,
                                      (grad_out, x, probs, given, a, gu, y_rows, *layout, *flags, *act, *wanted))
    probs, expert_ids, *_, lse, _ = torch.ops.suite.moe_route(logits, K, True, slots, slots, True)
    grad_probs = torch.randn(9, K, device=DEVICE)
    for grad_z in (torch.tensor(0.5, device=DEVICE), None):
        torch.library.opcheck(torch.ops.suite.moe_route_backward, (grad_probs, grad_z, logits, lse, expert_ids, probs, True))


@pytest.mark.parametrize("lie", ["shape", "dtype"])
def test_opcheck_catches_a_fake_whose_output_lies(lie):
    """The saboteur of the opcheck test above: an op running the routing kernels whose fake
    claims another probs shape (or dtype) than the kernels return. torch.compile would plan
    its graph on the lie; opcheck must refuse it, or the test above has no teeth."""
    name = f"suite_test::route_lying_{lie}"
    lying = torch.library.custom_op(name, mutates_args=())(_route_probs)

    @lying.register_fake
    def _(logits, k):
        if lie == "shape":
            return logits.new_empty(logits.shape[0], k + 1, dtype=torch.float32)
        return logits.new_empty(logits.shape[0], k, dtype=torch.float64)

    from torch.testing._internal.optests import OpCheckError

    logits, *_ = _op_args()
    with pytest.raises(OpCheckError):
        torch.library.opcheck(lying, (logits, K))


def _route_probs(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.ops.suite.moe_route(logits, k, True, logits.shape[0] * k, logits.shape[0] * k, False)[0]


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routing_gradient_is_the_softmax_chain_rule(renormalize):
    """The routing kernels' backward (probs and z-loss) against autograd in float64 through
    softmax, gather, the renormalisation and mean(logsumexp^2): the one backward eager and
    compiled calls take."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(11, 6, generator=gen, dtype=torch.float64)
    upstream = torch.randn(11, 3, generator=gen, dtype=torch.float64)
    routing = moe.route(logits.float(), 3, renormalize, z_loss=True)
    wide = logits.clone().requires_grad_()
    picked = torch.softmax(wide, -1).gather(1, routing.expert_ids.long())
    probs = picked / picked.sum(-1, keepdim=True) if renormalize else picked
    z_loss = torch.logsumexp(wide, -1).square().mean()
    (expected,) = torch.autograd.grad((probs, z_loss), wide, (upstream, torch.tensor(0.7, dtype=torch.float64)))
    narrow = logits.float().requires_grad_()
    again = moe.route(narrow, 3, renormalize, z_loss=True)
    (got,) = torch.autograd.grad((again.probs, again.z_loss), narrow, (upstream.float(), torch.tensor(0.7)))
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


# ---- on the GPU: inductor, and CUDA graphs ---------------------------------------------------


def _gpu_layer():
    return layer(None, torch.bfloat16, "cuda", hidden=256, ffn=384, experts=8, k=2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_inductor_gives_the_eager_bits(capacity_factor):
    module = layer(capacity_factor, torch.bfloat16, "cuda", hidden=256, ffn=384, experts=8, k=2)
    x, dy = inputs(1000, torch.bfloat16, "cuda", hidden=256)
    expected = out_and_grads(module, module, x, dy)
    compiled = torch.compile(module, fullgraph=True)
    assert_same_bits(out_and_grads(compiled, module, x, dy), expected)


@pytest.mark.cuda
@needs_cuda
def test_reduce_overhead_replays_cuda_graphs_with_the_eager_bits():
    module = _gpu_layer()
    compiled = torch.compile(module, fullgraph=True, mode="reduce-overhead")
    for step in range(4):  # warm-up, record, then replays
        x, dy = inputs(1000, torch.bfloat16, "cuda", hidden=256, seed=step)
        got = out_and_grads(compiled, module, x, dy)
        assert_same_bits(got, out_and_grads(module, module, x, dy))


@pytest.mark.cuda
@needs_cuda
def test_inductors_step_peaks_no_higher_than_the_eager_one():
    """The compiled backward reuses the saved activations as the eager one does, so a compiled
    forward + backward holds no buffer of gu's size ([2, R, f]) beyond the eager step's peak
    (without the reuse: dgu and dx_rows, twice that)."""
    tokens, hidden, ffn, k = 8192, 1024, 512, 2
    module = layer(None, torch.bfloat16, "cuda", hidden=hidden, ffn=ffn, experts=8, k=k)
    x, dy = inputs(tokens, torch.bfloat16, "cuda", hidden=hidden)
    compiled = torch.compile(module, fullgraph=True)

    def peak(fn):
        out_and_grads(fn, module, x, dy)  # compiles, plans and autotunes outside the measure
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out_and_grads(fn, module, x, dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    gu_bytes = 2 * tokens * k * ffn * x.element_size()
    eager, inductor = peak(module), peak(compiled)
    assert inductor - eager < gu_bytes, (inductor, eager, gu_bytes)


def test_the_z_loss_layer_traces_without_a_break():
    torch.manual_seed(0)
    module = moe.MoEExperts(HIDDEN, FFN, EXPERTS, K, z_loss=True, device=DEVICE)
    x, _ = inputs(9)
    explained = torch._dynamo.explain(module)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    compiled(x)
    eager_z = module.last_z_loss
    module(x)
    assert torch.equal(eager_z, module.last_z_loss)
