"""The experts arm (`moe.experts`, on the Triton kernels) against the eager reference and the
float64 truth: output and every gradient, on routings with the edge cases a layer meets. On the
CPU the kernels run under Triton's interpreter: tiny shapes, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from suite import triton_support
from suite.arms import moe
from suite.arms.moe import config, launch, layer
from gates.moe_truth import experts_truth, routing_truth
from bitwise import assert_kept_graph_gives_the_reused_bits
from moepaths import PATHS, force_path

# d and f no multiple of the interpreter's 16-wide tiles, T * k no multiple of its row tile
T, D, F = 19, 40, 24


def make_inputs(num_experts, seed=0, logit_shift=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w_gate = torch.randn(num_experts, D, F, generator=gen) / D**0.5
    w_up = torch.randn(num_experts, D, F, generator=gen) / D**0.5
    w_down = torch.randn(num_experts, F, D, generator=gen) / F**0.5
    logits = torch.randn(T, num_experts, generator=gen)
    if logit_shift is not None:
        logits = logits + logit_shift
    grad_out = torch.randn(T, D, generator=gen)
    return x, (w_gate, w_up, w_down), logits, grad_out


def run(fn, x, weights, logits, grad_out, k, capacity_factor=None, dtype=None):
    """-> (routing, [out, dx, dw_gate, dw_up, dw_down, dprobs, dlogits]), every leaf cast to dtype."""
    cast = (lambda t: t.detach().to(dtype)) if dtype else (lambda t: t.detach())
    x = cast(x).requires_grad_()
    weights = [cast(w).requires_grad_() for w in weights]
    logits = logits.detach().clone().requires_grad_()
    routing = moe.route(logits, k, capacity_factor=capacity_factor)
    probs = routing.probs
    if dtype is not None:
        probs = probs.to(dtype)
    probs.retain_grad()
    out = fn(x, dataclasses.replace(routing, probs=probs), *weights)
    out.backward(cast(grad_out))
    return routing, [out.detach(), x.grad, *(w.grad for w in weights), probs.grad, logits.grad]


NAMES = ("out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs", "dlogits")


def truth_of(x, weights, logits, grad_out, k, capacity_factor=None):
    """[out, dx, dw_gate, dw_up, dw_down, dprobs, dlogits] of the closed-form float64 truth, on the
    routing `run` makes."""
    routing = moe.route(logits, k, capacity_factor=capacity_factor)
    probs, wide = routing_truth(logits, routing)
    got = experts_truth(x, dataclasses.replace(routing, probs=probs.detach()), *weights, grad_out)
    (dlogits,) = torch.autograd.grad(probs, wide, got["dprobs"])
    return [*(got[name] for name in NAMES[:-1]), dlogits]


def rel_l2(value, truth):
    truth = truth.double()
    return ((value.double() - truth).norm() / truth.norm().clamp_min(1e-300)).item()


# (E, k, capacity factor, a logit shift per expert): the cases the gate also runs
CASES = {
    "top1": (6, 1, None, None),
    "top2": (6, 2, None, None),
    "top8": (9, 8, None, None),
    "empty-expert": (5, 2, None, torch.tensor([0.0, -30.0, 0.0, 0.0, 0.0])),
    "one-expert": (4, 2, None, torch.tensor([30.0, 0.0, 0.0, 0.0])),
    "capacity-drops": (4, 2, 0.75, torch.tensor([2.0, 0.0, 0.0, -1.0])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_arm_matches_reference_and_truth_in_every_gradient(case):
    num_experts, k, capacity_factor, shift = CASES[case]
    x, weights, logits, grad_out = make_inputs(num_experts, logit_shift=shift)
    routing, got = run(moe.experts, x, weights, logits, grad_out, k, capacity_factor)
    _, ref = run(moe.experts_reference, x, weights, logits, grad_out, k, capacity_factor)
    truth = truth_of(x, weights, logits, grad_out, k, capacity_factor)
    for name, g, r, t in zip(NAMES, got, ref, truth):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        # fp32 end to end: within a few times the reference's own error
        assert rel_l2(g, t) <= 4 * rel_l2(r, t) + 1e-6, (name, rel_l2(g, t), rel_l2(r, t))
    counts = routing.offsets.diff()
    if case == "empty-expert":
        assert counts[1] == 0 and torch.count_nonzero(got[2][1]) == 0 and torch.count_nonzero(got[4][1]) == 0
    if case == "one-expert":
        assert counts[0] == T
    if case == "capacity-drops":
        dropped = ~routing.kept
        assert bool(dropped.any()) and bool((got[5][dropped] == 0).all())


def test_arm_repeats_its_bits():
    # k = 4: the slots' sums have an order to keep; a capacity drops some of them
    x, weights, logits, grad_out = make_inputs(5, seed=3)
    _, first = run(moe.experts, x, weights, logits, grad_out, 4, 1.0)
    _, second = run(moe.experts, x, weights, logits, grad_out, 4, 1.0)
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), name


def test_arm_refuses_mismatched_shapes():
    x, (w_gate, w_up, w_down), logits, _ = make_inputs(4)
    routing = moe.route(logits, 2)
    with pytest.raises(ValueError, match="w_down"):
        moe.experts(x, routing, w_gate, w_up, w_down.transpose(1, 2))


# ---- the module ----


def train(impl, steps=20):
    """A toy regression (fit a fixed random MoE's outputs), AdamW, the same seed and data for
    either impl -> the loss at every step."""
    torch.manual_seed(0)
    layer = moe.MoEExperts(16, 16, num_experts=4, top_k=2, capacity_factor=1.25, impl=impl)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 16, generator=gen)
    target = torch.tanh(x @ torch.randn(16, 16, generator=gen) / 16**0.5)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_fused_and_eager_layers_train_alike():
    fused, eager = train("fused"), train("eager")
    assert fused[-1] < 0.5 * fused[0]
    # fp32 on both sides; routing decisions could flip on a near tie, which would show here
    for step, (a, b) in enumerate(zip(fused, eager)):
        assert abs(a - b) <= 1e-4 * max(b, 1e-3), (step, a, b)


@pytest.mark.parametrize("capacity_factor, z_loss", [(None, False), (0.75, True)])
def test_the_module_routes_and_runs_its_experts_in_one_node_with_the_composed_bits(capacity_factor, z_loss):
    """MoEExperts' eager forward puts the routing and the experts behind one autograd node:
    the bits of route() then experts() on the same weights, the z-loss's gradient included."""
    torch.manual_seed(3)
    layer = moe.MoEExperts(D, F, num_experts=5, top_k=2, capacity_factor=capacity_factor, z_loss=z_loss)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(4))
    grad_out = torch.randn(T, D, generator=torch.Generator().manual_seed(5))
    params = list(layer.parameters())

    def grads(out, z):
        loss = (out * grad_out).sum() + (1e-3 * z if z is not None else 0.0)
        return [out.detach(), *(t.detach() for t in ([z] if z is not None else [])),
                *torch.autograd.grad(loss, [xx, *params])]

    xx = x.clone().requires_grad_()
    out = layer(xx)
    assert "_ExpertsFunction" in type(out.grad_fn.next_functions[0][0]).__name__
    fused = grads(out, layer.last_z_loss)
    xx = x.clone().requires_grad_()
    routing = moe.route(layer.router(xx), 2, capacity_factor=layer._capacity, z_loss=z_loss)
    composed = grads(moe.experts(xx, routing, layer.w_gate, layer.w_up, layer.w_down), routing.z_loss)
    assert len(fused) == len(composed)
    for a, b in zip(fused, composed):
        assert torch.equal(a, b)


def test_the_module_refuses_weights_of_another_shape_and_a_second_order_backward():
    layer = moe.MoEExperts(D, F, num_experts=5, top_k=2)
    x = torch.randn(T, D, requires_grad=True)
    out = layer(x)
    (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        dx.sum().backward()
    layer.w_down = torch.nn.Parameter(torch.randn(5, F, D + 8))
    with pytest.raises(ValueError, match=r"MoEExperts: weights must be w_gate/w_up \[E, d, f\] and w_down"):
        layer(x)


def test_module_keeps_the_input_shape_and_refuses_an_unknown_impl():
    layer = moe.MoEExperts(16, 8, num_experts=3, top_k=1, impl="eager")
    assert layer(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    with pytest.raises(ValueError, match="impl"):
        moe.MoEExperts(16, 8, num_experts=3, top_k=1, impl="triton")


# ---- on the GPU: bf16 at a realistic size, and no host sync ----

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_inputs(tokens=2048, d=520, f=352, num_experts=8, seed=5):
    """d and f no multiple of the tiles; expert 1 empty, the first experts overflow a capacity."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, d, device="cuda", generator=gen)
    weights = [torch.randn(num_experts, *shape, device="cuda", generator=gen) / shape[0] ** 0.5
               for shape in ((d, f), (d, f), (f, d))]
    logits = 2 * torch.randn(tokens, num_experts, device="cuda", generator=gen)
    logits += torch.linspace(1.0, -1.0, num_experts, device="cuda")
    logits[:, 1] = -30.0
    grad_out = torch.randn(tokens, d, device="cuda", generator=gen)
    return x, weights, logits, grad_out


@pytest.fixture(autouse=True)
def _paths_forced_here_stay_here():
    """A plan kept under a forced path must not serve a later test of the same shape."""
    yield
    config.forget()


def gpu_bf16_args():
    """`run`'s arguments in bf16 on gpu_inputs (top-2, capacity factor 1.0), and those inputs."""
    x, weights, logits, grad_out = inputs = gpu_inputs()
    return (x.bfloat16(), [w.bfloat16() for w in weights], logits, grad_out.bfloat16(), 2, 1.0), inputs


def _skip_off_sm90(path: str) -> None:
    if path != "kernels" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("measured on sm90 alone: TMA needs sm90 or later, and elsewhere torch's grouped_mm syncs or has "
                    "erred")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_bf16_arm_is_as_close_to_the_truth_as_the_bf16_reference_and_repeats(path, monkeypatch):
    _skip_off_sm90(path)
    counts = force_path(monkeypatch, path)
    args, (x, weights, logits, grad_out) = gpu_bf16_args()
    routing, got = run(moe.experts, *args)
    _, ref = run(moe.experts_reference, *args)
    truth = truth_of(x, weights, logits, grad_out, 2, 1.0)
    assert int(routing.offsets[2] - routing.offsets[1]) == 0 and int(routing.num_dropped) > 0
    for name, g, r, t in zip(NAMES, got, ref, truth):
        assert rel_l2(g, t) <= 2 * rel_l2(r, t) + 1e-6, (name, rel_l2(g, t), rel_l2(r, t))
    assert all(not w[1].any() for w in got[2:5])  # the empty expert's weight gradients are zeros
    assert counts.times(path)
    _, again = run(moe.experts, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layout", ["stored", "out_in"])
def test_the_tma_kernels_give_the_pointer_kernels_bits_on_the_gpu(layout, monkeypatch):
    """bf16 on tensor cores, d and f no multiple of the tiles, an empty expert and dropped rows,
    the weights as MoEExperts stores them or as transposed views of [E, out, in] storage (a
    model's): the layer through TMA descriptors gives every output bit for bit as through
    pointers."""
    _skip_off_sm90("tma")
    args, _ = gpu_bf16_args()
    if layout == "out_in":
        args = (args[0], [w.transpose(1, 2).contiguous().transpose(1, 2) for w in args[1]], *args[2:])
    results = {}
    for path in ("kernels", "tma"):
        with monkeypatch.context() as patch:
            counts = force_path(patch, path)
            results[path] = run(moe.experts, *args)[1]
            assert counts.times(path)
    for name, a, b in zip(NAMES, results["kernels"], results["tma"]):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_forward_and_backward_never_sync_with_the_host(path, monkeypatch):
    _skip_off_sm90(path)
    counts = force_path(monkeypatch, path)
    x, weights, logits, grad_out = gpu_inputs(tokens=256, d=128, f=96)
    bf16 = [t.bfloat16().requires_grad_() for t in (x, *weights)]
    logits.requires_grad_()

    def step():
        routing = moe.route(logits, 2, capacity_factor=1.0)
        out = moe.experts(bf16[0], routing, *bf16[1:])
        return torch.autograd.grad(out, (*bf16, logits), grad_out.bfloat16())

    step()  # compiled first: compiling may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.times(path, 2)


@pytest.mark.parametrize("case", ["top2", "capacity-drops"])
def test_the_layer_plan_gives_the_entry_points_bits(case, monkeypatch):
    """experts() launches through a LayerPlan kept per call shape, skipping the entry points'
    checks and tile choice: the same kernels on the same buffers, so the same bits."""
    num_experts, k, capacity_factor, shift = CASES[case]
    inputs = make_inputs(num_experts, seed=11, logit_shift=shift)
    planned = run(moe.experts, *inputs, k, capacity_factor)[1]
    monkeypatch.setattr(launch, "layer_plan", lambda *args: None)
    checked = run(moe.experts, *inputs, k, capacity_factor)[1]
    for name, a, b in zip(NAMES, planned, checked):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("case", ["top2", "top8", "empty-expert", "capacity-drops"])
@pytest.mark.parametrize("keep_graph", [False, True])
@pytest.mark.parametrize("path", [p for p in PATHS if p != "kernels"])
def test_each_path_gives_the_kernels_values(path, case, keep_graph, monkeypatch):
    """Where `tma_gemms` feeds the row GEMMs through TMA descriptors, the pointer kernels' bits
    (the same tiles and sums); where `vendor_gemms` sends d_a and the weight gradients to
    torch._grouped_mm (CUTLASS on an H200), their values (fp32 on the CPU, where torch's own
    grouped_mm runs them: the sums' order differs only). The layer and the entry points give
    each other's bits on every path."""
    num_experts, k, capacity_factor, shift = CASES[case]
    inputs = make_inputs(num_experts, seed=3, logit_shift=shift)
    kernels = run(moe.experts, *inputs, k, capacity_factor)[1]
    counts = force_path(monkeypatch, path)
    if keep_graph:  # the backward then may not write into the saved activations
        monkeypatch.setattr(layer, "_graph_kept", lambda: True)
    planned = run(moe.experts, *inputs, k, capacity_factor)[1]
    assert counts.times(path)
    monkeypatch.setattr(launch, "layer_plan", lambda *args: None)
    checked = run(moe.experts, *inputs, k, capacity_factor)[1]
    assert counts.times(path, 2)
    for name, want, a, b in zip(NAMES, kernels, planned, checked):
        if path == "tma":
            assert torch.equal(a, want), name
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(a, b), name
    if case == "empty-expert":  # expert 1 has no rows: its weight gradients are zeros
        assert all(not w[1].any() for w in planned[2:5])


def test_a_weight_no_descriptor_can_take_goes_through_pointers(monkeypatch):
    """A weight view whose rows are not 16-byte multiples, or a gate and up stored the two ways,
    is planned on the pointer kernels; one whose pointer is misaligned falls back to them as it
    launches: the same bits."""
    num_experts, k, capacity_factor, shift = CASES["top2"]
    x, weights, logits, grad_out = make_inputs(num_experts, seed=4)
    want = run(moe.experts, x, weights, logits, grad_out, k)[1]
    counts = force_path(monkeypatch, "tma")
    storage = torch.zeros(weights[2].numel() + 1)
    misaligned = storage[1:].view_as(weights[2]).copy_(weights[2])  # 4 bytes into its storage
    got = run(moe.experts, x, (*weights[:2], misaligned), logits, grad_out, k)[1]
    assert len(counts.tma) == 2  # up and dx; down and d_a read w_down through pointers
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    w_up = torch.zeros(*weights[1].shape[:2], weights[1].shape[2] + 1)[..., :-1].copy_(weights[1])  # rows of 100 B
    assert isinstance(launch.up_launch(64, num_experts, D, F, D, weights[0].stride(), w_up.stride(), torch.float32,
                                    torch.device("cpu")), triton_support.PlannedLaunch)
    w_up_stored_out_in = weights[1].transpose(1, 2).contiguous().transpose(1, 2)
    for w_up in (w_up, w_up_stored_out_in):
        counts.tma.clear()
        got = run(moe.experts, x, (weights[0], w_up, weights[2]), logits, grad_out, k)[1]
        assert len(counts.tma) == 2  # down and d_a; up and dx on the pointer kernels
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_weights_stored_out_in_go_through_descriptors_as_stored():
    """A model's [E, out, in] weights, passed as their transposed views (transformers' experts
    through suite.integrations), reach every TMA kernel in their stored order: four TMA launches
    a forward and backward, and the pointer kernels' bits."""
    num_experts, k, _, _ = CASES["top2"]
    x, weights, logits, grad_out = make_inputs(num_experts, seed=5)
    out_in = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in weights]
    with pytest.MonkeyPatch.context() as patch:
        force_path(patch, "kernels")
        want = run(moe.experts, x, out_in, logits, grad_out, k)[1]
    with pytest.MonkeyPatch.context() as patch:
        counts = force_path(patch, "tma")
        got = run(moe.experts, x, out_in, logits, grad_out, k)[1]
        assert counts.times("tma")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    torch.testing.assert_close(got[0], run(moe.experts, x, weights, logits, grad_out, k)[1][0])


def test_grouped_mm_and_tma_are_taken_on_sm90_in_bf16_at_measured_sizes(monkeypatch):
    capability = [(9, 0)]
    monkeypatch.setattr(config, "interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setenv("SUITE_PROFILE", "none")
    cuda, bf16 = torch.device("cuda", 0), torch.bfloat16
    olmoe = (65536, 64, 2048, 1024)  # rows, experts, d, f
    assert config.vendor_gemms(*olmoe, bf16, cuda)
    assert config.vendor_gemms(65536, 128, 2048, 768, bf16, cuda)  # qwen3-30b-a3b, the smallest measured
    mixtral = (16384, 8, 4096, 14336)
    assert config.vendor_gemms(*mixtral, bf16, cuda)
    assert not config.vendor_gemms(*olmoe, torch.float16, cuda)
    assert not config.vendor_gemms(*olmoe, bf16, torch.device("cpu"))
    assert not config.vendor_gemms(65536, 64, 2044, 1024, bf16, cuda)  # rows of 4088 bytes
    assert not config.vendor_gemms(32768, 64, 1024, 512, bf16, cuda)  # a train-step OLMoE layer: not measured
    assert not config.vendor_gemms(16, 16, 1024, 2816, bf16, cuda)  # the host-probe layer
    assert config.vendor_gemms(16384, 16, 1024, 2816, bf16, cuda)  # top2-small, the least d measured
    assert not config.vendor_gemms(8192, 16, 1024, 768, bf16, cuda)  # no dim below, less work than any measured
    assert not config.vendor_gemms(65536, 64, 8192, 128, bf16, cuda)  # f under any measured
    assert all(config.tma_gemms(*layer, bf16, cuda)
               for layer in (olmoe, mixtral, (65536, 128, 2048, 768), (16384, 16, 1024, 2816)))
    assert not config.tma_gemms(16, 16, 1024, 2816, bf16, cuda)  # the host-probe layer: host time counts more
    assert not config.tma_gemms(32768, 64, 1024, 512, bf16, cuda)
    for other in ((12, 0), (8, 0), (10, 0)):  # torch's grouped_mm syncs and loops, or has erred, there
        capability[0] = other  # and TMA, where there is one, is not measured
        assert not config.vendor_gemms(*olmoe, bf16, cuda) and not config.tma_gemms(*olmoe, bf16, cuda)
    capability[0] = (9, 0)
    monkeypatch.setenv("SUITE_PROFILE", "rtx")  # the RTX card's tiles, and what it takes
    assert not config.vendor_gemms(*olmoe, bf16, cuda) and not config.tma_gemms(*olmoe, bf16, cuda)


def test_grouped_mm_operands_need_16_byte_rows_and_pointers():
    rows = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert config.grouped_mm_ready(rows, rows.t(), torch.zeros(2, 16, 8, dtype=torch.bfloat16).transpose(1, 2))
    assert not config.grouped_mm_ready(torch.zeros(8 * 16 + 1, dtype=torch.bfloat16)[1:].view(8, 16))  # 2 bytes in
    assert not config.grouped_mm_ready(rows.as_strided((4, 16), (8, 1)))  # rows that overlap
    assert not config.grouped_mm_ready(torch.zeros(8, 12, dtype=torch.bfloat16))  # rows of 24 bytes
    assert not config.grouped_mm_ready(torch.zeros(8, 16, dtype=torch.bfloat16)[:, ::2])  # no unit stride


@pytest.mark.parametrize("path", PATHS)
def test_a_backward_that_keeps_the_graph_leaves_the_saved_activations_whole(path, monkeypatch):
    """The backward writes its temporaries into the forward's saved activations only when
    autograd frees them after it: with retain_graph a second backward reads them intact, and
    both give the bits of a backward that did reuse them; on either path (torch._grouped_mm's
    forced on the CPU)."""
    counts = force_path(monkeypatch, path)
    num_experts, k, capacity_factor, shift = CASES["capacity-drops"]
    x, weights, logits, grad_out = make_inputs(num_experts, seed=5, logit_shift=shift)
    leaves = [x.requires_grad_(), *(w.requires_grad_() for w in weights)]

    def forward():
        return moe.experts(x, moe.route(logits, k, capacity_factor=capacity_factor), *weights)

    assert_kept_graph_gives_the_reused_bits(forward, leaves, grad_out)
    assert counts.times(path, 2, 3)


def test_the_forwards_shared_buffer_starts_each_activation_16_byte_aligned():
    """a and the pre-activations g and u share one allocation in an eager call; rows x ffn x 4
    bytes = 60 here, so each slab is padded: the kept launches take only 16-byte aligned
    pointers."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen, requires_grad=True)
    weights = [torch.randn(2, 8, 5, generator=gen), torch.randn(2, 8, 5, generator=gen),
               torch.randn(2, 5, 8, generator=gen)]
    out = moe.experts(x, moe.route(torch.randn(3, 2, generator=gen), 1), *weights)
    a, gu = out.grad_fn.saved_tensors[2:4]
    g, u = gu.unbind(0)
    assert all(t.shape == (3, 5) and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (a, g, u))
    assert a.untyped_storage().data_ptr() == gu.untyped_storage().data_ptr()  # one allocation
