"""MoE routing against a brute-force per-token construction, and the eager experts reference
against its float64 truth. Tiny shapes: everything here but the cuda-marked tests runs on the
CPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from gates.moe_truth import experts_truth
from suite.arms import moe
from suite.arms.moe import routing as routing_module

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def brute_route(logits, k, renormalize=True, capacity_factor=None):
    """The routing built token by token in plain Python: what `route` must equal."""
    num_tokens, num_experts = logits.shape
    full = torch.softmax(logits.detach().float(), dim=-1).tolist()
    expert_ids, probs = [], []
    for p in full:
        ids = sorted(range(num_experts), key=lambda e: (-p[e], e))[:k]  # ties: lower id first
        chosen = [p[e] for e in ids]
        total = sum(chosen)
        expert_ids.append(ids)
        probs.append([c / total for c in chosen] if renormalize else chosen)
    capacity = None
    if capacity_factor is not None:
        # the factor as thousandths, so the ceiling is integer arithmetic
        capacity = -(-round(capacity_factor * 1000) * num_tokens * k // (1000 * num_experts))
    rows_of = [[] for _ in range(num_experts)]  # per expert, its kept flat rows in token order
    for t in range(num_tokens):
        for s in range(k):
            e = expert_ids[t][s]
            if capacity is None or len(rows_of[e]) < capacity:
                rows_of[e].append(t * k + s)
    offsets, sources = [0], []
    for rows in rows_of:
        sources += rows
        offsets.append(len(sources))
    row_id_map = [-1] * (num_tokens * k)
    for row, flat in enumerate(sources):
        row_id_map[flat] = row
    routed = [sum(ids.count(e) for ids in expert_ids) for e in range(num_experts)]
    return dict(expert_ids=expert_ids, probs=probs, offsets=offsets, row_id_map=row_id_map,
                sources=sources, routed=routed, capacity=capacity)


def check_against_brute(logits, k, renormalize=True, capacity_factor=None):
    got = moe.route(logits, k, renormalize, capacity_factor)
    want = brute_route(logits, k, renormalize, capacity_factor)
    num_tokens, num_experts = logits.shape
    int_fields = (got.expert_ids, got.offsets, got.row_id_map, got.source_of_row, got.token_of_row, got.routed_counts)
    assert all(t.dtype == torch.int32 for t in int_fields)
    assert got.probs.dtype == torch.float32 and got.probs.shape == (num_tokens, k)
    assert got.expert_ids.tolist() == want["expert_ids"]
    want_probs = torch.tensor(want["probs"], dtype=torch.float64).reshape(num_tokens, k)
    torch.testing.assert_close(got.probs.double(), want_probs, rtol=1e-6, atol=0)
    assert got.offsets.tolist() == want["offsets"]
    assert got.row_id_map.tolist() == want["row_id_map"]
    assert got.routed_counts.tolist() == want["routed"]
    assert got.capacity == want["capacity"]
    kept = len(want["sources"])
    assert got.max_rows == (num_tokens * k if got.capacity is None else min(num_tokens * k, num_experts * got.capacity))
    padding = [-1] * (got.max_rows - kept)
    assert got.source_of_row.tolist() == want["sources"] + padding
    assert got.token_of_row.tolist() == [flat // k for flat in want["sources"]] + padding
    assert got.num_rows.item() == kept and got.num_dropped.item() == num_tokens * k - kept
    return got


def random_logits(num_tokens, num_experts, seed=0):
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "num_tokens, num_experts, k", [(16, 8, 1), (13, 8, 2), (9, 8, 8), (30, 16, 8), (7, 5, 3), (1, 3, 2)]
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_brute_force(num_tokens, num_experts, k, renormalize):
    check_against_brute(random_logits(num_tokens, num_experts), k, renormalize)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ties_go_to_the_lower_expert_id(k):
    # few distinct values: most tokens have ties inside and across the top-k boundary
    logits = torch.randint(0, 3, (40, 6), generator=torch.Generator().manual_seed(1)).float()
    logits[0] = 0.0  # all six tied: experts 0..k-1
    got = check_against_brute(logits, k)
    assert got.expert_ids[0].tolist() == list(range(k))


def test_ties_resolve_by_id_whatever_the_column_order():
    # the tied pair sits above a larger value in id order and below it in a reversed layout
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [3.0, 1.0, 3.0, 3.0]])
    assert moe.route(logits, 2).expert_ids.tolist() == [[1, 3], [0, 2]]


def test_an_expert_with_no_tokens_and_all_tokens_to_one_expert():
    logits = random_logits(11, 6)
    logits[:, 4] = -1e4  # never chosen
    got = check_against_brute(logits, 2)
    assert got.routed_counts[4].item() == 0 and got.offsets[4] == got.offsets[5]

    logits = random_logits(11, 6, seed=2)
    logits[:, 2] = 1e4
    got = check_against_brute(logits, 1)
    assert got.offsets.tolist() == [0, 0, 0, 11, 11, 11, 11]
    assert got.token_of_row.tolist() == list(range(11))
    # the same with a capacity: only the first tokens fit
    got = check_against_brute(logits, 1, capacity_factor=1.0)
    assert got.capacity == 2 and got.offsets.tolist() == [0, 0, 0, 2, 2, 2, 2]
    assert got.row_id_map.tolist() == [0, 1] + [-1] * 9


@pytest.mark.parametrize("capacity_factor", [0.25, 0.5, 1.0, 1.1, 1.25, 2.0, 100.0])
@pytest.mark.parametrize("num_tokens, num_experts, k", [(13, 4, 2), (7, 5, 3), (20, 8, 1)])
def test_capacity_drops_the_highest_tokens(num_tokens, num_experts, k, capacity_factor):
    # skewed logits so that some experts overflow
    logits = random_logits(num_tokens, num_experts, seed=3) + torch.linspace(2, 0, num_experts)
    got = check_against_brute(logits, k, capacity_factor=capacity_factor)
    kept_counts = got.offsets.diff()
    assert bool((kept_counts <= got.capacity).all())
    assert torch.equal(kept_counts, got.routed_counts.clamp(max=got.capacity))


def test_capacity_reads_the_factor_as_its_decimal():
    # binary 1.1 is a little above 1.1: a float product would round 11.000000000000002 up to 12
    assert moe.expert_capacity(1.1, 10, 1, 1) == 11
    assert moe.expert_capacity(1.25, 13, 2, 4) == math.ceil(1.25 * 26 / 4)
    assert moe.expert_capacity(0.01, 3, 1, 8) == 1


def test_layout_consistency():
    got = moe.route(random_logits(37, 6, seed=4) + torch.linspace(1, 0, 6), 3, capacity_factor=0.9)
    num_tokens, k = got.expert_ids.shape
    rows = got.row_id_map[got.row_id_map >= 0]
    num_rows = got.num_rows.item()
    assert sorted(rows.tolist()) == list(range(num_rows))  # every kept row appears once
    assert bool((got.row_id_map >= -1).all()) and got.num_dropped.item() > 0
    assert torch.equal(got.kept.reshape(-1), got.row_id_map >= 0)
    flat_ids = got.expert_ids.reshape(-1).long()
    for e in range(got.num_experts):
        start, end = got.offsets[e].item(), got.offsets[e + 1].item()
        sources = got.source_of_row[start:end].long()
        assert bool((flat_ids[sources] == e).all())  # one expert's rows are contiguous
        assert sources.tolist() == sorted(sources.tolist())  # in token order
        assert torch.equal(got.row_id_map[sources], torch.arange(start, end, dtype=torch.int32))
        # what was dropped for this expert comes after every token it kept
        dropped = ((flat_ids == e) & (got.row_id_map < 0)).nonzero().flatten()
        if len(dropped) and len(sources):
            assert dropped.min() > sources.max()
    assert torch.equal(got.token_of_row[:num_rows], got.source_of_row[:num_rows] // k)


def test_renormalisation():
    logits = random_logits(9, 8, seed=5)
    plain = moe.route(logits, 3, renormalize=False)
    norm = moe.route(logits, 3)
    full = torch.softmax(logits, -1)
    # the kernel's softmax, not torch's: the same to fp32 rounding
    torch.testing.assert_close(plain.probs, full.gather(1, plain.expert_ids.long()), rtol=3e-7, atol=0)
    torch.testing.assert_close(norm.probs.sum(-1), torch.ones(9), rtol=0, atol=1e-6)
    torch.testing.assert_close(norm.probs, plain.probs / plain.probs.sum(-1, keepdim=True), rtol=3e-7, atol=0)
    assert torch.equal(moe.route(logits, 1).probs, torch.ones(9, 1))


@pytest.mark.parametrize("renormalize", [True, False])
def test_probs_keep_the_autograd_link_to_the_logits(renormalize):
    logits = random_logits(6, 5, seed=6).requires_grad_()
    routing = moe.route(logits, 2, renormalize)
    upstream = random_logits(6, 2, seed=7)
    (grad,) = torch.autograd.grad(routing.probs, logits, upstream)
    # the same chain in float64 with the choice held fixed
    wide = logits.detach().double().requires_grad_()
    probs = torch.softmax(wide, -1).gather(1, routing.expert_ids.long())
    if renormalize:
        probs = probs / probs.sum(-1, keepdim=True)
    (truth,) = torch.autograd.grad(probs, wide, upstream.double())
    torch.testing.assert_close(grad.double(), truth, rtol=1e-5, atol=1e-7)
    assert logits.grad is None and bool((grad != 0).any())


def test_logits_of_any_float_dtype_route_in_fp32():
    logits = random_logits(8, 4, seed=8)
    half = moe.route(logits.bfloat16(), 2)
    assert half.probs.dtype == torch.float32
    assert torch.equal(half.expert_ids, check_against_brute(logits.bfloat16(), 2).expert_ids)


def test_empty_batch():
    got = moe.route(torch.zeros(0, 4), 2, capacity_factor=1.0)
    assert got.offsets.tolist() == [0] * 5 and got.row_id_map.numel() == 0 and got.max_rows == 0


@pytest.mark.parametrize("bad", [
    dict(logits=torch.zeros(4), k=1),
    dict(logits=torch.zeros(4, 0), k=1),
    dict(logits=torch.zeros(4, 3, dtype=torch.int64), k=1),
    dict(logits=torch.zeros(4, 3), k=0),
    dict(logits=torch.zeros(4, 3), k=4),
    dict(logits=torch.zeros(4, 3), k=1, capacity_factor=0.0),
    dict(logits=torch.zeros(4, 3), k=1, capacity_factor=float("inf")),
])
def test_bad_arguments_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        moe.route(**bad)


# --------------------------------------------------------------------------------------------
# The eager experts reference against its float64 truth
# --------------------------------------------------------------------------------------------


def make_experts(num_tokens=24, num_experts=4, d=16, f=32, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device, dtype)

    x = rand(num_tokens, d)
    w_gate, w_up = rand(num_experts, d, f, scale=d**-0.5), rand(num_experts, d, f, scale=d**-0.5)
    w_down = rand(num_experts, f, d, scale=f**-0.5)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    dout = rand(num_tokens, d)
    return x, w_gate, w_up, w_down, logits, dout


def run_experts(fn, x, routing, weights, dout, dtype=None):
    """out and the gradients for x, the three weights and probs, every input cast to `dtype`."""
    cast = (lambda t: t.detach().to(dtype)) if dtype else (lambda t: t.detach())
    x, probs = cast(x).requires_grad_(), cast(routing.probs).requires_grad_()
    weights = [cast(w).requires_grad_() for w in weights]
    out = fn(x, dataclasses.replace(routing, probs=probs), *weights)
    grads = torch.autograd.grad(out, (x, *weights, probs), cast(dout))
    return (out, *grads)


def brute_experts(x, routing, w_gate, w_up, w_down):
    """float64, token by token: sum over kept slots of probs * FFN_e(x[t])."""
    x, w_gate, w_up, w_down = (t.double() for t in (x, w_gate, w_up, w_down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for s in range(routing.k):
            if routing.row_id_map[t * routing.k + s] < 0:
                continue
            e = routing.expert_ids[t, s]
            ffn = (F.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]
            out[t] += routing.probs[t, s].double() * ffn
    return out


def rel_l2(value, truth):
    return ((value.double() - truth).norm() / truth.norm()).item()


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_truth_is_the_brute_force_sum(capacity_factor):
    x, w_gate, w_up, w_down, logits, _ = make_experts(num_tokens=10, num_experts=3, d=4, f=6)
    routing = moe.route(logits, 2, capacity_factor=capacity_factor)
    truth = experts_truth(x, routing, w_gate, w_up, w_down)["out"]
    assert truth.dtype == torch.float64
    torch.testing.assert_close(truth, brute_experts(x, routing, w_gate, w_up, w_down), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("k, capacity_factor", [(1, None), (2, None), (2, 0.6), (4, 1.0)])
def test_reference_matches_the_float64_truth(dtype, bound, k, capacity_factor):
    x, w_gate, w_up, w_down, logits, dout = make_experts(dtype=dtype)
    routing = moe.route(logits, k, capacity_factor=capacity_factor)
    weights = (w_gate, w_up, w_down)
    got = run_experts(moe.experts_reference, x, routing, weights, dout)
    names = ("out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs")
    truth = [experts_truth(x, routing, *weights, dout)[name] for name in names]
    for name, g, t in zip(names, got, truth):
        want_dtype = torch.float32 if name == "dprobs" else dtype
        assert g.dtype == want_dtype and t.dtype == torch.float64 and g.shape == t.shape, name
        assert rel_l2(g, t) < bound, (name, rel_l2(g, t))


def test_dropped_rows_contribute_nothing():
    x, w_gate, w_up, w_down, logits, dout = make_experts(num_tokens=16, num_experts=4)
    logits[:, 0] += 3.0  # expert 0 overflows
    routing = moe.route(logits, 2, capacity_factor=0.5)
    dropped = ~routing.kept
    assert bool(dropped.any())
    weights = (w_gate, w_up, w_down)
    out, *_, dprobs = run_experts(moe.experts_reference, x, routing, weights, dout)
    assert bool((dprobs[dropped] == 0).all())
    # whatever weight a dropped slot carries, the output is the same
    scrambled = dataclasses.replace(routing, probs=torch.where(dropped, 1e3, routing.probs))
    assert torch.equal(moe.experts_reference(x, scrambled, *weights), out.detach())
    # a token whose every slot was dropped gets zeros
    empty = dropped.all(-1)
    assert bool(empty.any()) and bool((out[empty] == 0).all())


def test_gradients_reach_the_logits_through_the_reference():
    x, w_gate, w_up, w_down, logits, dout = make_experts()
    logits.requires_grad_()
    out = moe.experts_reference(x, moe.route(logits, 2), w_gate, w_up, w_down)
    (grad,) = torch.autograd.grad(out, logits, dout)
    assert grad.shape == logits.shape and bool(grad.isfinite().all()) and bool((grad != 0).any())


def test_reference_refuses_mismatched_shapes():
    x, w_gate, w_up, w_down, logits, _ = make_experts()
    routing = moe.route(logits, 2)
    with pytest.raises(ValueError):
        moe.experts_reference(x[:-1], routing, w_gate, w_up, w_down)
    with pytest.raises(ValueError):
        moe.experts_reference(x, routing, w_gate, w_up, w_down.transpose(1, 2))
    with pytest.raises(ValueError):
        moe.experts_reference(x, routing, w_gate[:-1], w_up[:-1], w_down[:-1])


# --------------------------------------------------------------------------------------------
# On the GPU
# --------------------------------------------------------------------------------------------


def routing_tensors(routing):
    return [routing.probs.view(torch.int32), routing.expert_ids, routing.offsets, routing.row_id_map,
            routing.source_of_row, routing.token_of_row, routing.routed_counts]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_route_never_syncs_with_the_host(capacity_factor):
    logits = torch.randn(4096, 64, device="cuda", requires_grad=True)
    moe.route(logits, 8, capacity_factor=capacity_factor)  # first call: lazy init may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        routing = moe.route(logits, 8, capacity_factor=capacity_factor)
        routing.num_rows, routing.num_dropped, routing.kept  # noqa: B018 - must not sync either
        routing.probs.backward(torch.ones_like(routing.probs))
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("capacity_factor", [None, 1.25])
def test_route_is_deterministic(capacity_factor):
    gen = torch.Generator().manual_seed(9)
    # integer logits: ties everywhere
    logits = torch.randint(0, 4, (8192, 32), generator=gen).float().cuda()
    first, second = (moe.route(logits, 4, capacity_factor=capacity_factor) for _ in range(2))
    for a, b in zip(routing_tensors(first), routing_tensors(second)):
        assert torch.equal(a, b)


@pytest.mark.cuda
@needs_cuda
def test_route_on_the_gpu_matches_the_cpu():
    # integer logits: ties are exact on both devices and distinct values stay far apart
    logits = torch.randint(0, 4, (513, 16), generator=torch.Generator().manual_seed(10)).float()
    cpu, gpu = moe.route(logits, 3, capacity_factor=0.8), moe.route(logits.cuda(), 3, capacity_factor=0.8)
    for a, b in zip(routing_tensors(cpu)[1:], routing_tensors(gpu)[1:]):
        assert torch.equal(a, b.cpu())
    torch.testing.assert_close(cpu.probs, gpu.probs.cpu())


def test_reference_with_rows_found_once_gives_the_same_bits():
    """The bench's reference finds each expert's rows at build time, so its timed call never
    syncs; it must compute exactly what the reference computes."""
    gen = torch.Generator().manual_seed(11)
    tokens, hidden, ffn, num_experts, k = 13, 8, 6, 5, 2
    logits = torch.randn(tokens, num_experts, generator=gen)
    routing = moe.route(logits, k, capacity_factor=0.8)
    x = torch.randn(tokens, hidden, generator=gen)
    weights = (torch.randn(num_experts, hidden, ffn, generator=gen), torch.randn(num_experts, hidden, ffn, generator=gen),
               torch.randn(num_experts, ffn, hidden, generator=gen))
    plain = moe.experts_reference(x, routing, *weights)
    found_once = moe.experts_reference(x, routing, *weights, rows=moe.expert_rows(routing))
    assert torch.equal(plain, found_once)


# --------------------------------------------------------------------------------------------
# Router z-loss and input jitter
# --------------------------------------------------------------------------------------------


def test_z_loss_is_the_mean_squared_logsumexp_and_differentiable():
    logits = random_logits(9, 5, seed=20).requires_grad_()
    routing = moe.route(logits, 2, z_loss=True)
    wide = logits.detach().double().requires_grad_()
    truth = torch.logsumexp(wide, -1).square().mean()
    torch.testing.assert_close(routing.z_loss.double(), truth.detach(), rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(routing.z_loss, logits)
    (want,) = torch.autograd.grad(truth, wide)
    torch.testing.assert_close(grad.double(), want, rtol=1e-5, atol=1e-8)
    assert moe.route(logits, 2).z_loss is None
    assert float(moe.route(torch.zeros(0, 5), 2, z_loss=True).z_loss) == 0.0


def test_jitter_is_reproducible_for_a_seed_and_bounded():
    logits = random_logits(40, 6, seed=21)

    def jittered(seed):
        return moe.route(logits, 2, jitter_eps=0.3, generator=torch.Generator().manual_seed(seed))

    first, again, other = jittered(5), jittered(5), jittered(6)
    assert torch.equal(first.probs, again.probs) and torch.equal(first.expert_ids, again.expert_ids)
    assert not torch.equal(first.probs, other.probs)
    noise = torch.empty_like(logits).uniform_(0.7, 1.3, generator=torch.Generator().manual_seed(5))
    assert bool(((noise >= 0.7) & (noise <= 1.3)).all())
    assert torch.equal(first.probs, moe.route(logits * noise, 2).probs)


@pytest.mark.parametrize("eps", [-0.1, 1.0, float("nan"), "0.1", True])
def test_a_bad_jitter_eps_is_named(eps):
    with pytest.raises(ValueError, match="jitter_eps must be a number in"):
        moe.route(random_logits(4, 3, seed=22), 2, jitter_eps=eps)
    with pytest.raises(ValueError, match="MoEExperts: jitter_eps must be a number in"):
        moe.MoEExperts(8, 6, 3, 2, jitter_eps=eps, impl="eager")


def test_the_layer_leaves_its_z_loss_and_jitters_its_router_input_while_training():
    torch.manual_seed(0)
    layer = moe.MoEExperts(8, 6, 4, 2, impl="eager", z_loss=True, jitter_eps=0.5,
                           generator=torch.Generator().manual_seed(1))
    x = torch.randn(7, 8)
    layer.eval()
    plain = layer(x)
    (grad,) = torch.autograd.grad(layer.last_z_loss, layer.router.weight)
    assert bool((grad != 0).any())
    still = moe.MoEExperts(8, 6, 4, 2, impl="eager")
    still.load_state_dict(layer.state_dict())
    assert torch.equal(plain, still(x))  # no jitter in eval mode
    layer.train()
    assert not torch.equal(layer(x), plain)


# ---- the routing kernels against the torch routing: the same layout, exactly ----------------


def same_routing(got: moe.Routing, want: moe.Routing) -> None:
    for name in ("expert_ids", "offsets", "row_id_map", "source_of_row", "token_of_row", "routed_counts"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert (got.capacity, got.max_rows) == (want.capacity, want.max_rows)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_tokens, num_experts, k, capacity_factor, integer", [
    (50, 7, 3, 0.6, False),  # several programs, loop steps, drops
    (37, 20, 2, None, True),  # ties everywhere, experts past one tile
    (64, 3, 3, 1.0, True),  # every expert chosen by every token
    (5, 9, 8, 0.3, False),  # capacity below one row per token
])
def test_route_kernels_lay_out_what_the_torch_routing_does(num_tokens, num_experts, k, capacity_factor, integer):
    gen = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randint(0, 3, (num_tokens, num_experts), generator=gen).float() if integer
              else torch.randn(num_tokens, num_experts, generator=gen))
    fused = moe.route(logits, k, capacity_factor=capacity_factor, z_loss=True)
    want = moe.route_reference(logits, k, capacity_factor=capacity_factor, z_loss=True)
    same_routing(fused, want)
    torch.testing.assert_close(fused.z_loss, want.z_loss, rtol=1e-6, atol=0)
    weights = torch.rand(num_tokens, k, generator=gen)
    # routing_from_topk's layout: the layout kernel alone
    same_routing(moe.routing_from_topk(want.expert_ids, weights, num_experts, capacity_factor),
                 dataclasses.replace(want, probs=weights))


def test_route_falls_back_to_torch_where_the_kernels_cannot_run(monkeypatch):
    monkeypatch.setattr(routing_module, "runs_on", lambda t: False)
    logits = random_logits(12, 5, seed=3)
    fallen_back = moe.route(logits, 2, capacity_factor=1.0)
    monkeypatch.undo()
    same_routing(fallen_back, moe.route_reference(logits, 2, capacity_factor=1.0))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_tokens, num_experts, k, capacity_factor", [
    (8192, 64, 8, None), (8192, 128, 8, 1.25), (8192, 8, 2, None), (4099, 16, 2, 1.0), (70000, 256, 8, None)])
@pytest.mark.parametrize("integer", [False, True])
def test_route_kernels_on_the_gpu_lay_out_what_the_torch_routing_does(num_tokens, num_experts, k, capacity_factor,
                                                                     integer):
    gen = torch.Generator(device="cuda").manual_seed(num_experts)
    logits = (torch.randint(0, 4, (num_tokens, num_experts), generator=gen, device="cuda").float() if integer
              else 2 * torch.randn(num_tokens, num_experts, generator=gen, device="cuda")).requires_grad_()
    fused = moe.route(logits, k, capacity_factor=capacity_factor, z_loss=True)
    want = moe.route_reference(logits, k, capacity_factor=capacity_factor, z_loss=True)
    same_routing(fused, want)
    upstream = torch.randn(num_tokens, k, generator=gen, device="cuda")
    got = torch.autograd.grad((fused.probs, fused.z_loss), logits, (upstream, torch.tensor(0.3, device="cuda")))
    expected = torch.autograd.grad((want.probs, want.z_loss), logits, (upstream, torch.tensor(0.3, device="cuda")))
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.z_loss, want.z_loss, rtol=1e-5, atol=0)
