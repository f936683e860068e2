"""The MoE arm's integers from outside: `routing_from_topk` lays out a model's own top-k choice,
and a `Routing` built by hand is checked before any kernel indexes memory with it. On the CPU a
bad index is a ValueError naming the field; on a GPU a device-side assert with the same words
(the cuda tests run it in a child process, since such an assert ends the CUDA context)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from suite.arms import moe

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, HIDDEN, FFN, EXPERTS, K = 7, 12, 10, 4, 2


def logits(seed: int = 0, tokens: int = TOKENS, experts: int = EXPERTS) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def experts_inputs(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    weights = (torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) / HIDDEN**0.5,
               torch.randn(EXPERTS, HIDDEN, FFN, generator=gen) / HIDDEN**0.5,
               torch.randn(EXPERTS, FFN, HIDDEN, generator=gen) / FFN**0.5)
    return x, weights


def same_layout(a: moe.Routing, b: moe.Routing) -> None:
    for name in ("expert_ids", "offsets", "row_id_map", "source_of_row", "token_of_row", "routed_counts"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.num_experts, a.k, a.capacity, a.max_rows) == (b.num_experts, b.k, b.capacity, b.max_rows)


# ---- routing_from_topk ---------------------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [None, 0.75, 1.0])
@pytest.mark.parametrize("from_topk", [moe.routing_from_topk, moe.routing_from_topk_reference])
def test_routing_from_topk_lays_out_what_route_lays_out(capacity_factor, from_topk):
    """The kernels' layout and the reference's torch ops' alike (the gate judges one by the other)."""
    given = logits(2)
    routed = moe.route(given, K, capacity_factor=capacity_factor)
    for dtype in (torch.int64, torch.int32, torch.int16):
        laid_out = from_topk(routed.expert_ids.to(dtype), routed.probs, EXPERTS, capacity_factor)
        same_layout(laid_out, routed)
        assert torch.equal(laid_out.probs, routed.probs)


def test_routing_from_topk_keeps_the_weights_autograd_link():
    given = logits(3).requires_grad_()
    weights, ids = torch.topk(torch.softmax(given, -1), K)
    routing = moe.routing_from_topk(ids, weights.bfloat16(), EXPERTS)
    assert routing.probs.dtype == torch.float32
    (grad,) = torch.autograd.grad(routing.probs.sum(), given)
    assert bool((grad != 0).any())


@pytest.mark.parametrize("bad_id", [EXPERTS, -1, 2**40])
def test_routing_from_topk_refuses_an_expert_id_out_of_range(bad_id):
    ids = moe.route(logits(4), K).expert_ids.long()
    ids[3, 1] = bad_id
    with pytest.raises(ValueError, match=rf"routing_from_topk: top_k_index holds an expert id outside 0..{EXPERTS - 1}"):
        moe.routing_from_topk(ids, torch.ones(TOKENS, K), EXPERTS)


@pytest.mark.parametrize("args, error, says", [
    ((torch.zeros(TOKENS, K), torch.ones(TOKENS, K), EXPERTS), TypeError, "top_k_index must hold integer expert ids"),
    ((torch.zeros(TOKENS, K, dtype=torch.long), torch.ones(TOKENS, K + 1), EXPERTS), ValueError, "must share one shape"),
    ((torch.zeros(TOKENS, dtype=torch.long), torch.ones(TOKENS), EXPERTS), ValueError, "must be a tensor [tokens, k]"),
    ((torch.zeros(TOKENS, K, dtype=torch.long), torch.ones(TOKENS, K, dtype=torch.long), EXPERTS), TypeError,
     "top_k_weights must be floating point"),
    ((torch.zeros(TOKENS, K, dtype=torch.long), torch.ones(TOKENS, K), 0), ValueError, "num_experts must be a positive int"),
    ((torch.zeros(TOKENS, K, dtype=torch.long), torch.ones(TOKENS, K), 4.0), ValueError, "num_experts must be a positive int"),
])
def test_routing_from_topk_names_a_malformed_argument(args, error, says):
    for from_topk in (moe.routing_from_topk, moe.routing_from_topk_reference):
        with pytest.raises(error, match=rf"^{from_topk.__name__}: .*{re.escape(says)}"):
            from_topk(*args)


def test_a_token_may_name_an_expert_twice():
    """Not an index fault: both of its rows are computed and weighted, as two experts would be."""
    x, weights = experts_inputs()
    ids = moe.route(logits(5), K).expert_ids.long()
    ids[2] = 3
    probs = torch.full((TOKENS, K), 0.5)
    routing = moe.routing_from_topk(ids, probs, EXPERTS)
    out = moe.experts(x, routing, *weights)
    torch.testing.assert_close(out, moe.experts_reference(x, routing, *weights), rtol=1e-5, atol=1e-6)


# ---- a Routing built by hand ---------------------------------------------------------------


def valid(capacity_factor=0.75) -> moe.Routing:
    return moe.route(logits(6), K, capacity_factor=capacity_factor)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_a_valid_layout_built_by_hand_is_accepted(capacity_factor):
    routing = valid(capacity_factor)
    same_layout(moe.Routing(**{f.name: getattr(routing, f.name) for f in dataclasses.fields(routing)}), routing)
    same_layout(dataclasses.replace(routing, probs=routing.probs.double()), routing)


def edited(field: str, edit) -> dict:
    """The fields of a valid routing with one index tensor edited in a copy."""
    routing = valid()
    tensor = getattr(routing, field).clone()
    edit(tensor, routing)
    return {field: tensor}


def first_dropped(routing: moe.Routing) -> int:
    return int((routing.row_id_map < 0).nonzero()[0, 0])


# each index field, edited the ways a hand-built layout goes wrong: past its tensors, negative
# below -1, or pointing at the wrong row
BAD_FIELDS = {
    "expert_ids past the experts": ("expert_ids", lambda t, r: t.__setitem__((0, 0), EXPERTS), "expert_ids hold an id outside"),
    "expert_ids negative": ("expert_ids", lambda t, r: t.__setitem__((0, 0), -1), "expert_ids hold an id outside"),
    "offsets past max_rows": ("offsets", lambda t, r: t.__setitem__(-1, r.max_rows + 5), "offsets must rise from 0"),
    "offsets negative": ("offsets", lambda t, r: t.__setitem__(1, -3), "offsets must rise from 0"),
    "offsets not from 0": ("offsets", lambda t, r: t.__setitem__(0, 1), "offsets must rise from 0"),
    "token_of_row -5": ("token_of_row", lambda t, r: t.__setitem__(0, -5), "token_of_row must be source_of_row // k"),
    "token_of_row past the tokens": ("token_of_row", lambda t, r: t.__setitem__(0, TOKENS), "token_of_row must be"),
    "token_of_row another token": ("token_of_row", lambda t, r: t.__setitem__(0, (t[0] + 1) % TOKENS),
                                   "token_of_row must be"),
    "row_id_map -2": ("row_id_map", lambda t, r: t.__setitem__(0, -2), "row_id_map must hold -1 or a row"),
    "row_id_map past the rows": ("row_id_map", lambda t, r: t.__setitem__(0, r.max_rows), "row_id_map must hold -1"),
    "row_id_map a dropped slot given a row": ("row_id_map", lambda t, r: t.__setitem__(first_dropped(r), 0),
                                              "source_of_row[row_id_map[j]] must be j"),
    "row_id_map two slots swapped": ("row_id_map", lambda t, r: t.__setitem__(slice(0, 2), t[:2].flip(0).clone()),
                                     "source_of_row[row_id_map[j]] must be j"),
    "source_of_row past the slots": ("source_of_row", lambda t, r: t.__setitem__(0, TOKENS * K),
                                     "source_of_row must hold a flat index"),
    "source_of_row -2": ("source_of_row", lambda t, r: t.__setitem__(0, -2), "source_of_row must hold a flat index"),
    "routed_counts below the kept rows": ("routed_counts", lambda t, r: t.zero_(),
                                          "keeps more rows (offsets) than were routed"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_hand_built_routing_with_a_bad_index_is_refused_naming_the_field(case):
    field, edit, says = BAD_FIELDS[case]
    with pytest.raises(ValueError, match="Routing: .*" + re.escape(says)):
        dataclasses.replace(valid(), **edited(field, edit))


@pytest.mark.parametrize("change, error, says", [
    (dict(offsets=torch.zeros(EXPERTS + 1, dtype=torch.int64)), TypeError, "offsets must be torch.int32"),
    (dict(token_of_row=torch.zeros(3, dtype=torch.int32)), ValueError, "token_of_row must have shape"),
    (dict(k=K + 1), ValueError, "k (3) must be expert_ids.shape[1]"),
    (dict(k=2.0), TypeError, "k must be an int"),
    (dict(max_rows=10**6), ValueError, "max_rows must be in 0..14"),
    (dict(capacity=0), ValueError, "capacity must be a positive int"),
    (dict(row_id_map=None), TypeError, "row_id_map must be a tensor"),
])
def test_a_hand_built_routing_of_the_wrong_form_is_refused(change, error, says):
    with pytest.raises(error, match=re.escape(says)):
        dataclasses.replace(valid(), **change)


# ---- the other arguments of the public entries ---------------------------------------------


@pytest.mark.parametrize("k, error, says", [
    (2.0, TypeError, "route: k must be an int (the experts each token picks), got float 2.0"),
    ("2", TypeError, "route: k must be an int (the experts each token picks), got str '2'"),
    (True, TypeError, "route: k must be an int"),
])
def test_route_names_a_k_that_is_not_an_int(k, error, says):
    with pytest.raises(error) as raised:
        moe.route(logits(), k)
    assert says in str(raised.value)


@pytest.mark.parametrize("capacity_factor", ["1.0", float("nan"), -1.0, True])
def test_route_names_a_bad_capacity_factor(capacity_factor):
    with pytest.raises(ValueError, match="capacity_factor must be a positive number or None"):
        moe.route(logits(), K, capacity_factor=capacity_factor)


@pytest.mark.parametrize("fn", [moe.experts, moe.experts_reference])
def test_experts_names_a_missing_routing_and_a_flat_weight(fn):
    x, (w_gate, w_up, w_down) = experts_inputs()
    routing = moe.route(logits(), K)
    with pytest.raises(TypeError, match=r"experts: routing must be a Routing from route\(\) or routing_from_topk\(\), got NoneType"):
        fn(x, None, w_gate, w_up, w_down)
    with pytest.raises(ValueError, match=r"experts: w_gate must be \[experts, hidden, ffn\], got shape \(48, 10\)"):
        fn(x, routing, w_gate.reshape(-1, FFN), w_up, w_down)
    with pytest.raises(TypeError, match="experts: w_down must be a tensor, got list"):
        fn(x, routing, w_gate, w_up, [w_down])


# ---- on the GPU ----------------------------------------------------------------------------


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


@pytest.mark.cuda
@needs_cuda
def test_routing_from_topk_never_syncs_with_the_host():
    ids = torch.randint(0, 64, (4096, 8), device="cuda")
    weights = torch.rand(4096, 8, device="cuda")
    moe.routing_from_topk(ids, weights, 64)  # first call: lazy init may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.routing_from_topk(ids, weights, 64, capacity_factor=1.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("what, code, says", [
    ("an expert id past the experts", "ids[5, 1] = 64; moe.routing_from_topk(ids, w, 64)",
     "routing_from_topk: top_k_index holds an expert id outside 0..63"),
    ("offsets past the rows", "r = moe.route(logits, 8); off = r.offsets.clone(); off[-1] = 10**6; "
     "dataclasses.replace(r, offsets=off)", "Routing: offsets must rise from 0"),
    ("token_of_row -5", "r = moe.route(logits, 8); t = r.token_of_row.clone(); t[0] = -5; "
     "dataclasses.replace(r, token_of_row=t)", "Routing: token_of_row must be"),
])
def test_a_bad_index_on_the_gpu_stops_at_a_device_assert_not_a_bad_read(what, code, says):
    """The child routes a bad layout into the kernels: a device-side assert must stop it, with
    the check's words on stderr, before any kernel reads out of bounds (no segfault, no
    illegal address)."""
    child = run_child(f"""
        import dataclasses, torch
        from suite.arms import moe
        torch.manual_seed(0)
        logits = torch.randn(4096, 64, device="cuda")
        ids = torch.topk(logits, 8).indices
        w = torch.rand(4096, 8, device="cuda")
        {code}
        torch.cuda.synchronize()
        print("NOT STOPPED")
    """)
    assert child.returncode not in (0, -11, 139), child.stdout + child.stderr
    assert "NOT STOPPED" not in child.stdout
    assert "device-side assert" in child.stderr and says in child.stderr, child.stderr[-3000:]
    assert "illegal memory access" not in child.stderr
