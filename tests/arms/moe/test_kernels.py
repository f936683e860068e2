"""The MoE expert kernels against plain torch (float64) on a hand-built ragged layout.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py): shapes stay tiny,
and fp32 carries the tight checks (the interpreter's bf16 tl.dot is wrong; the kernels upcast
bf16 there, so bf16 runs too, at bf16 tolerance).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from rtxcheck import assert_fit_rtx, record_compiled
from suite.arms.moe import config
from suite.arms.moe import launch as mk
from suite.device_profile import RTX_SMEM_BYTES
from suite.harness.parity import poisoned_allocations

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# T tokens, top-k, hidden d, expert width f: d and f are no multiple of the 16-wide
# interpreter tiles, T * k is no multiple of the row tile.
T, K, D, F = 15, 2, 40, 24
# Rows per expert: expert 0 spans two row tiles, experts 1 and 5 are empty, E is no power of
# two; one slot is dropped.
COUNTS = (18, 0, 4, 5, 2, 0)
E = len(COUNTS)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_layout(seed=0):
    """-> dict of the routing's outputs plus expert_of_row, R and the per-slot experts."""
    gen = torch.Generator().manual_seed(seed)
    slots = [e for e, n in enumerate(COUNTS) for _ in range(n)] + [-1] * (T * K - sum(COUNTS))
    assert len(slots) == T * K and slots.count(-1) == 1
    slot_expert = torch.tensor(slots)[torch.randperm(T * K, generator=gen)]
    kept = (slot_expert >= 0).nonzero().flatten()
    order = kept[torch.sort(slot_expert[kept], stable=True).indices]  # slot of each sorted row
    n_rows = order.numel()
    row_id_map = torch.full((T * K,), -1, dtype=torch.int32)
    row_id_map[order] = torch.arange(n_rows, dtype=torch.int32)
    token_of_row = torch.full((T * K,), -1, dtype=torch.int32)  # unused rows hold -1: never read
    token_of_row[:n_rows] = (order // K).int()
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(COUNTS), 0)
    probs = torch.rand(T, K, generator=gen)
    return {
        "token_of_row": token_of_row.to(DEVICE), "row_id_map": row_id_map.to(DEVICE),
        "offsets": offsets.to(DEVICE), "probs": probs.to(DEVICE),
        "expert_of_row": slot_expert[order], "R": n_rows,
    }


def make_weights(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    w_gate = torch.randn(E, D, F, generator=gen) / D**0.5
    w_up = torch.randn(E, D, F, generator=gen) / D**0.5
    w_down = torch.randn(E, F, D, generator=gen) / F**0.5
    return [t.to(DEVICE, dtype) for t in (x, w_gate, w_up, w_down)]


def assert_close(value, truth, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(value.double(), truth, rtol=tol, atol=tol * truth.abs().max().item())


def per_row(layout, fn):
    """Stack fn(row, expert) over the R kept rows, in float64."""
    rows = [fn(r, int(e)) for r, e in enumerate(layout["expert_of_row"])]
    return torch.stack(rows)


# ---- forward up ----


def up_reference(layout, x, w_gate, w_up):
    tok = layout["token_of_row"].long().cpu()
    x64, wg, wu = x.double().cpu(), w_gate.double().cpu(), w_up.double().cpu()
    g = per_row(layout, lambda r, e: x64[tok[r]] @ wg[e])
    u = per_row(layout, lambda r, e: x64[tok[r]] @ wu[e])
    return torch.nn.functional.silu(g) * u, g, u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_expert_up_matches_torch(dtype):
    layout = make_layout()
    x, w_gate, w_up, _ = make_weights(dtype)
    a, g, u = mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"])
    R = layout["R"]
    assert a.shape == g.shape == u.shape == (T * K, F) and a.dtype == dtype
    for value, truth in zip((a, g, u), up_reference(layout, x, w_gate, w_up)):
        assert_close(value[:R].cpu(), truth, dtype)


def test_expert_up_reuses_given_buffers_and_can_skip_the_preactivations():
    layout = make_layout()
    x, w_gate, w_up, _ = make_weights(torch.float32)
    bufs = [torch.empty(T * K, F, device=DEVICE) for _ in range(3)]
    a, g, u = mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"],
                           out=bufs[0], gate_out=bufs[1], up_out=bufs[2])
    assert [t.data_ptr() for t in (a, g, u)] == [b.data_ptr() for b in bufs]
    a2, g2, u2 = mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"],
                              save_preactivations=False)
    assert g2 is None and u2 is None
    R = layout["R"]
    assert torch.equal(a2[:R], a[:R])  # deterministic, and independent of SAVE


@pytest.mark.parametrize(
    "bad",
    [
        lambda: torch.empty(T * K, F + 1, device=DEVICE),
        lambda: torch.empty(T * K, F, device=DEVICE, dtype=torch.float16),
        lambda: torch.empty(F, T * K, device=DEVICE).t(),
    ],
    ids=["shape", "dtype", "not-contiguous"],
)
def test_a_wrong_buffer_is_refused_with_the_fix(bad):
    layout = make_layout()
    x, w_gate, w_up, _ = make_weights(torch.float32)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \(30, 24\)"):
        mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"], out=bad())


def test_layout_of_the_wrong_dtype_is_refused():
    layout = make_layout()
    x, w_gate, w_up, _ = make_weights(torch.float32)
    with pytest.raises(ValueError, match="offsets must be a contiguous 1-D int32"):
        mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"].long())


# ---- forward down and the combine ----


def down_reference(layout, a, w_down):
    a64, wd = a.double().cpu(), w_down.double().cpu()
    return per_row(layout, lambda r, e: a64[r] @ wd[e])


def combine_reference(layout, rows, probs=None):
    """Slots summed in order 0..k-1, dropped ones skipped, in float64."""
    row_id_map = layout["row_id_map"].long().cpu()
    rows64 = rows.double().cpu()
    out = torch.zeros(T, rows.shape[1], dtype=torch.float64)
    for t in range(T):
        for s in range(K):
            row = row_id_map[t * K + s]
            if row >= 0:
                weight = 1.0 if probs is None else probs[t, s].double().cpu()
                out[t] += weight * rows64[row]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_expert_down_matches_torch(dtype):
    layout = make_layout()
    _, _, _, w_down = make_weights(dtype)
    a = torch.randn(T * K, F).to(DEVICE, dtype)
    y = mk.expert_down(a, w_down, layout["offsets"])
    assert y.shape == (T * K, D) and y.dtype == dtype
    assert_close(y[: layout["R"]].cpu(), down_reference(layout, a[: layout["R"]], w_down), dtype)


def test_expert_down_reuses_out_and_refuses_a_wrong_one():
    layout = make_layout()
    _, _, _, w_down = make_weights(torch.float32)
    a = torch.randn(T * K, F, device=DEVICE)
    buf = torch.empty(T * K, D, device=DEVICE)
    assert mk.expert_down(a, w_down, layout["offsets"], out=buf).data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError, match=r"expert_down: out must be a contiguous torch.float32 tensor of shape \(30, 40\)"):
        mk.expert_down(a, w_down, layout["offsets"], out=torch.empty(T * K, D + 1, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_sums_the_weighted_slots_in_order(dtype):
    layout = make_layout()
    rows = torch.randn(T * K, D).to(DEVICE, dtype)
    out = mk.combine(rows, layout["row_id_map"], layout["probs"])
    assert out.shape == (T, D) and out.dtype == dtype
    assert_close(out.cpu(), combine_reference(layout, rows, layout["probs"]), dtype)
    # the token with the dropped slot gets its kept slot alone (K = 2)
    dropped = int((layout["row_id_map"] < 0).nonzero()[0])
    t, other = dropped // K, layout["row_id_map"][dropped // K * K + 1 - dropped % K]
    expected = layout["probs"][t, 1 - dropped % K] * rows[other].float()
    assert torch.equal(out[t], expected.to(dtype))


def test_combine_without_probs_is_the_plain_sum_and_reuses_out():
    layout = make_layout()
    rows = torch.randn(T * K, D, device=DEVICE)
    buf = torch.empty(T, D, device=DEVICE)
    out = mk.combine(rows, layout["row_id_map"], top_k=K, out=buf)
    assert out.data_ptr() == buf.data_ptr()
    assert_close(out.cpu(), combine_reference(layout, rows), torch.float32)
    with pytest.raises(ValueError, match="pass probs, or top_k"):
        mk.combine(rows, layout["row_id_map"])


def test_forward_end_to_end_matches_a_per_expert_torch_moe():
    layout = make_layout()
    x, w_gate, w_up, w_down = make_weights(torch.float32)
    a, _, _ = mk.expert_up(x, w_gate, w_up, layout["token_of_row"], layout["offsets"], save_preactivations=False)
    out = mk.combine(mk.expert_down(a, w_down, layout["offsets"]), layout["row_id_map"], layout["probs"])
    # the plain MoE: each (token, slot) through its expert, weighted and summed
    truth = torch.zeros(T, D, dtype=torch.float64)
    x64, wg, wu, wd = (t.double().cpu() for t in (x, w_gate, w_up, w_down))
    for slot, row in enumerate(layout["row_id_map"].tolist()):
        if row >= 0:
            t, e = slot // K, int(layout["expert_of_row"][row])
            h = torch.nn.functional.silu(x64[t] @ wg[e]) * (x64[t] @ wu[e])
            truth[t] += layout["probs"][t, slot % K].double().cpu() * (h @ wd[e])
    assert_close(out.cpu(), truth, torch.float32)


# ---- backward ----


def randn_rows(width, dtype, seed):
    return torch.randn(T * K, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def per_expert_weight_grad(layout, lhs_rows, grad_rows):
    """dW[e] = lhs_e^T @ grad_e over each expert's rows, float64; zero for an empty expert."""
    offsets = layout["offsets"].tolist()
    lhs, grad = lhs_rows.double().cpu(), grad_rows.double().cpu()
    return torch.stack([lhs[offsets[e]:offsets[e + 1]].T @ grad[offsets[e]:offsets[e + 1]] for e in range(E)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_backward_matches_autograd_of_the_combine(dtype):
    layout = make_layout()
    R = layout["R"]
    y_rows = randn_rows(D, dtype, 2)
    grad_out = torch.randn(T, D, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    grad_rows, grad_probs = mk.combine_backward(grad_out, y_rows, layout["probs"], layout["row_id_map"])
    assert grad_rows.shape == (T * K, D) and grad_rows.dtype == dtype and grad_probs.dtype == torch.float32
    y64 = y_rows[:R].double().cpu().requires_grad_()
    p64 = layout["probs"].double().cpu().requires_grad_()
    combine_reference(layout, y64, p64).backward(grad_out.double().cpu())
    assert_close(grad_rows[:R].cpu(), y64.grad, dtype)
    assert_close(grad_probs.cpu(), p64.grad, torch.float32 if dtype == torch.float32 else dtype)
    dropped = int((layout["row_id_map"] < 0).nonzero()[0])
    assert grad_probs.flatten()[dropped] == 0


def test_combine_backward_reuses_its_buffers():
    layout = make_layout()
    y_rows = randn_rows(D, torch.float32, 2)
    grad_out = torch.randn(T, D, device=DEVICE)
    bufs = torch.empty(T * K, D, device=DEVICE), torch.empty(T, K, device=DEVICE)
    got = mk.combine_backward(grad_out, y_rows, layout["probs"], layout["row_id_map"],
                              grad_rows_out=bufs[0], grad_probs_out=bufs[1])
    assert [t.data_ptr() for t in got] == [b.data_ptr() for b in bufs]
    with pytest.raises(ValueError, match=r"grad_probs_out must be a contiguous torch.float32 tensor of shape \(15, 2\)"):
        mk.combine_backward(grad_out, y_rows, layout["probs"], layout["row_id_map"],
                            grad_probs_out=torch.empty(T, K, device=DEVICE, dtype=torch.float16))


def test_a_non_contiguous_input_is_named_as_such():
    layout = make_layout()
    y_rows = randn_rows(D, torch.float32, 2)
    strided = torch.randn(T, 2 * D, device=DEVICE)[:, :D]
    with pytest.raises(ValueError, match=r"grad_out must be a contiguous \(15, 40\) tensor, got a non-contiguous "
                                         r"one of shape \(15, 40\) \(pass \.contiguous\(\)\)"):
        mk.combine_backward(strided, y_rows, layout["probs"], layout["row_id_map"])


def test_a_kept_tile_follows_the_profile(monkeypatch):
    # tiles are kept per call shape (host time), so the key must hold SUITE_PROFILE, whose
    # shared-memory limit the choice reads
    monkeypatch.setattr(config, "interpreted", lambda: False)
    monkeypatch.setattr(config, "smem_limit",
                        lambda device: RTX_SMEM_BYTES if os.environ.get("SUITE_PROFILE") == "rtx" else 232448)
    config.forget()
    args = ("rows", 1024, 2816, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("SUITE_PROFILE", "none")
    hopper = config.gemm_config(*args)
    assert config.gemm_config(*args) is hopper  # kept
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    rtx = config.gemm_config(*args)
    assert rtx.smem_bytes <= RTX_SMEM_BYTES < hopper.smem_bytes
    monkeypatch.setenv("SUITE_PROFILE", "none")
    assert config.gemm_config(*args) is hopper


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_down_backward_matches_torch(dtype):
    layout = make_layout()
    R = layout["R"]
    _, _, _, w_down = make_weights(dtype)
    a, gate, up, grad_rows = randn_rows(F, dtype, 4), randn_rows(F, dtype, 5), randn_rows(F, dtype, 6), randn_rows(D, dtype, 7)
    dg, du, dw_down = mk.expert_down_backward(grad_rows, a, gate, up, w_down, layout["offsets"])
    assert dg.shape == du.shape == (T * K, F) and dw_down.shape == w_down.shape and dw_down.dtype == dtype
    wd = w_down.double().cpu()
    d_a = per_row(layout, lambda r, e: grad_rows[r].double().cpu() @ wd[e].T)
    g64 = gate[:R].double().cpu().requires_grad_()
    u64 = up[:R].double().cpu().requires_grad_()
    (torch.nn.functional.silu(g64) * u64).backward(d_a)
    assert_close(dg[:R].cpu(), g64.grad, dtype)
    assert_close(du[:R].cpu(), u64.grad, dtype)
    assert_close(dw_down.cpu(), per_expert_weight_grad(layout, a[:R], grad_rows[:R]), dtype)
    assert torch.count_nonzero(dw_down[1]) == torch.count_nonzero(dw_down[5]) == 0  # the empty experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_up_backward_and_the_gather_back_match_torch(dtype):
    layout = make_layout()
    R = layout["R"]
    x, w_gate, w_up, _ = make_weights(dtype)
    dg, du = randn_rows(F, dtype, 8), randn_rows(F, dtype, 9)
    dx_rows, dw_gate, dw_up = mk.expert_up_backward(dg, du, x, w_gate, w_up, layout["token_of_row"], layout["offsets"])
    assert dx_rows.shape == (T * K, D) and dw_gate.shape == dw_up.shape == w_gate.shape
    wg, wu = w_gate.double().cpu(), w_up.double().cpu()
    dg64, du64 = dg.double().cpu(), du.double().cpu()
    truth = per_row(layout, lambda r, e: dg64[r] @ wg[e].T + du64[r] @ wu[e].T)
    assert_close(dx_rows[:R].cpu(), truth, dtype)
    x_rows = x[layout["token_of_row"][:R].long()]
    assert_close(dw_gate.cpu(), per_expert_weight_grad(layout, x_rows, dg[:R]), dtype)
    assert_close(dw_up.cpu(), per_expert_weight_grad(layout, x_rows, du[:R]), dtype)
    dx = mk.combine(dx_rows, layout["row_id_map"], top_k=K)
    assert_close(dx.cpu(), combine_reference(layout, dx_rows[:R]), dtype)


def test_the_swiglu_backward_refuses_outputs_that_alias_its_inputs():
    """d_a is written into du's buffer before gate and up are read: du_out=up would read its own
    d_a as u. Such buffers are refused with the fix."""
    layout = make_layout()
    _, _, _, w_down = make_weights(torch.float32)
    a, gate, up, grad_rows = (randn_rows(F, torch.float32, 4), randn_rows(F, torch.float32, 5),
                              randn_rows(F, torch.float32, 6), randn_rows(D, torch.float32, 7))
    for aliased in ({"du_out": up}, {"dg_out": gate}, {"dg_out": up}):
        with pytest.raises(ValueError, match="buffers of their own"):
            mk.expert_down_backward(grad_rows, a, gate, up, w_down, layout["offsets"], **aliased)
    shared = torch.empty_like(up)
    with pytest.raises(ValueError, match="buffers of their own"):
        mk.expert_down_backward(grad_rows, a, gate, up, w_down, layout["offsets"], dg_out=shared, du_out=shared)


def test_backward_buffers_are_reused_and_checked():
    layout = make_layout()
    x, w_gate, w_up, w_down = make_weights(torch.float32)
    rows_f = [randn_rows(F, torch.float32, s) for s in range(3)]
    grad_rows = randn_rows(D, torch.float32, 3)
    down_bufs = torch.empty(T * K, F, device=DEVICE), torch.empty(T * K, F, device=DEVICE), torch.empty_like(w_down)
    got = mk.expert_down_backward(grad_rows, *rows_f, w_down, layout["offsets"],
                                  dg_out=down_bufs[0], du_out=down_bufs[1], dw_down_out=down_bufs[2])
    assert [t.data_ptr() for t in got] == [b.data_ptr() for b in down_bufs]
    up_bufs = torch.empty(T * K, D, device=DEVICE), torch.empty_like(w_gate), torch.empty_like(w_up)
    got = mk.expert_up_backward(rows_f[0], rows_f[1], x, w_gate, w_up, layout["token_of_row"], layout["offsets"],
                                dx_rows_out=up_bufs[0], dw_gate_out=up_bufs[1], dw_up_out=up_bufs[2])
    assert [t.data_ptr() for t in got] == [b.data_ptr() for b in up_bufs]
    with pytest.raises(ValueError, match=r"dw_up_out must be a contiguous torch.float32 tensor of shape \(6, 40, 24\)"):
        mk.expert_up_backward(rows_f[0], rows_f[1], x, w_gate, w_up, layout["token_of_row"], layout["offsets"],
                              dw_up_out=torch.empty(E, F, D, device=DEVICE))


def layer(layout, x, w_gate, w_up, w_down, grad_out):
    """all_kernels on a hand-built layout."""
    return all_kernels(x, w_gate, w_up, w_down, layout["token_of_row"], layout["row_id_map"], layout["offsets"],
                       layout["probs"], grad_out)


def test_full_backward_matches_autograd_of_the_per_expert_moe_and_repeats_bit_for_bit():
    layout = make_layout()
    x, w_gate, w_up, w_down = make_weights(torch.float32)
    probs, row_id_map = layout["probs"], layout["row_id_map"]
    grad_out = torch.randn(T, D, generator=torch.Generator().manual_seed(11)).to(DEVICE)

    def kernels():
        return layer(layout, x, w_gate, w_up, w_down, grad_out)[1:]

    leaves = [t.double().cpu().requires_grad_() for t in (x, probs, w_gate, w_up, w_down)]
    x64, p64, wg, wu, wd = leaves
    out = torch.zeros(T, D, dtype=torch.float64)
    for slot, row in enumerate(row_id_map.tolist()):
        if row >= 0:
            t, e = slot // K, int(layout["expert_of_row"][row])
            h = torch.nn.functional.silu(x64[t] @ wg[e]) * (x64[t] @ wu[e])
            out = out.index_add(0, torch.tensor([t]), (p64[t, slot % K] * (h @ wd[e]))[None])
    out.backward(grad_out.double().cpu())
    first = kernels()
    for value, leaf in zip(first, leaves):
        assert_close(value.cpu(), leaf.grad, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first, kernels()))


@pytest.mark.parametrize("group_m", [2, 3])
def test_grouped_tile_order_gives_the_same_bits(monkeypatch, group_m):
    """Tiles walked in groups of row tiles (for L2 reuse) compute every tile as before: the
    forward and backward repeat the 2-D grid's outputs bit for bit, partial last groups too."""
    layout = make_layout()
    weights = make_weights(torch.float32)
    grad_out = torch.randn(T, D, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    plain = layer(layout, *weights, grad_out)
    chosen = config.choose_gemm_config
    configs = []

    def grouped(*args):
        configs.append(dataclasses.replace(chosen(*args), group_m=group_m))
        return configs[-1]

    with config.forced(gemm=grouped), poisoned_allocations():  # a tile the grouped order skipped would stay NaN
        assert all(torch.equal(a, b) for a, b in zip(plain, layer(layout, *weights, grad_out)))
    assert len(configs) == 6 and all(c.group_m == group_m for c in configs)  # every GEMM launch


# ---- tile configs fit the RTX card's shared memory ----

# (rows per expert, N) classes: decode-like and prefill-like, narrow and wide outputs
SHAPE_CLASSES = [(8, 768), (64, 1024), (512, 2048), (4096, 14336), (1024, 24), (300, 4096)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows_per_expert, n", SHAPE_CLASSES)
@pytest.mark.parametrize("kind", sorted(config.GEMM_KINDS))
@pytest.mark.parametrize("weight_elems", [0, 1 << 26])
def test_every_config_fits_rtx_shared_memory_by_its_estimate(monkeypatch, dtype, rows_per_expert, n, kind, weight_elems):
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    cfg = config.gemm_config(kind, rows_per_expert, n, dtype, torch.device("cuda", 0), weight_elems)
    assert cfg.smem_bytes <= RTX_SMEM_BYTES
    assert cfg.num_stages >= 2  # every class still pipelines on the RTX card
    assert (cfg.n_a, cfg.n_b) == config.GEMM_KINDS[kind][0]
    if cfg.n_b == 2:  # two accumulators of 128 columns spill on sm_120 (tests/harness/test_cross_compile.py)
        assert cfg.block_n <= 64


def test_the_h200_takes_the_measured_tiles_unshrunk(monkeypatch):
    """Off the rtx profile, a many-rows bf16 layer gets GEMM_KINDS' tiles as measured (its
    sweep's winners fit the H200's shared memory, so nothing may shrink them)."""
    monkeypatch.setenv("SUITE_PROFILE", "none")
    monkeypatch.setattr(config, "smem_limit", lambda device: 232448)
    for kind, (_, (block_m, block_n, block_k, stages, warps, group_m)) in config.GEMM_KINDS.items():
        cfg = config.gemm_config(kind, 1024, 4096, torch.bfloat16, torch.device("cuda", 0))
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps, cfg.group_m) == (
            block_m, block_n, block_k, stages, warps, group_m), kind


GPU_SHAPES = [(512, 1024, 768, 16, 2), (4096, 2048, 1408, 8, 2)]  # decode-like and prefill-like
ALL_KERNELS = {"up_kernel", "rows_gemm_kernel", "swiglu_backward_kernel", "combine_kernel", "combine_bwd_kernel",
               "weight_grad_kernel"}


def run_every_kernel(tokens, d, f, experts, k):
    """Forward and backward once in bf16 on a balanced layout, every kernel variant launched."""
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, d, f, device="cuda", dtype=torch.bfloat16)
    w_down = w.transpose(1, 2).contiguous()
    expert = torch.arange(tokens * k, device="cuda") % experts
    order = torch.sort(expert, stable=True).indices
    token_of_row = (order // k).int()
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(torch.bincount(expert, minlength=experts), 0)
    row_id_map = torch.empty(tokens * k, dtype=torch.int32, device="cuda")
    row_id_map[order] = torch.arange(tokens * k, dtype=torch.int32, device="cuda")
    probs = torch.rand(tokens, k, device="cuda")
    a, g, u = mk.expert_up(x, w, w, token_of_row, offsets)
    y = mk.expert_down(a, w_down, offsets)
    mk.combine(y, row_id_map, probs)
    grad_rows, _ = mk.combine_backward(torch.randn_like(x), y, probs, row_id_map)
    dg, du, _ = mk.expert_down_backward(grad_rows, a, g, u, w_down, offsets)
    mk.expert_up_backward(dg, du, x, w, w, token_of_row, offsets)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("tokens, d, f, experts, k", GPU_SHAPES)
def test_compiled_kernels_fit_rtx_shared_memory(monkeypatch, tokens, d, f, experts, k):
    recorded = record_compiled(monkeypatch)
    run_every_kernel(tokens, d, f, experts, k)
    assert {name for name, _ in recorded} == ALL_KERNELS
    assert_fit_rtx(recorded)


# ---- on the GPU: bf16 at a realistic size, and no host sync ----


def random_layout(tokens, k, experts, seed, device="cuda"):
    """Skewed routing with expert 1 empty and about 5% of the slots dropped, as the routing
    would lay it out."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(experts, generator=gen) ** 2
    weights[1] = 0
    slot_expert = torch.multinomial(weights, tokens * k, replacement=True, generator=gen)
    slot_expert[torch.rand(tokens * k, generator=gen) < 0.05] = -1
    kept = (slot_expert >= 0).nonzero().flatten()
    order = kept[torch.sort(slot_expert[kept], stable=True).indices]
    row_id_map = torch.full((tokens * k,), -1, dtype=torch.int32)
    row_id_map[order] = torch.arange(order.numel(), dtype=torch.int32)
    token_of_row = torch.zeros(tokens * k, dtype=torch.int32)
    token_of_row[: order.numel()] = (order // k).int()
    offsets = torch.zeros(experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(slot_expert[kept], minlength=experts), 0)
    probs = torch.rand(tokens, k, generator=gen)
    return [t.to(device) for t in (token_of_row, row_id_map, offsets, probs)] + [slot_expert.to(device)]


def torch_moe(x, w_gate, w_up, w_down, probs, slot_expert):
    """The plain MoE, expert by expert over (token, slot) pairs, in x's dtype."""
    k = probs.shape[1]
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        slots = (slot_expert == e).nonzero().flatten()
        tokens = slots // k
        h = torch.nn.functional.silu(x[tokens] @ w_gate[e]) * (x[tokens] @ w_up[e])
        out = out.index_add(0, tokens, probs.flatten()[slots, None] * (h @ w_down[e]))
    return out


def all_kernels(x, w_gate, w_up, w_down, token_of_row, row_id_map, offsets, probs, grad_out):
    a, g, u = mk.expert_up(x, w_gate, w_up, token_of_row, offsets)
    y_rows = mk.expert_down(a, w_down, offsets)
    out = mk.combine(y_rows, row_id_map, probs)
    grad_rows, grad_probs = mk.combine_backward(grad_out, y_rows, probs, row_id_map)
    dg, du, dw_down = mk.expert_down_backward(grad_rows, a, g, u, w_down, offsets)
    dx_rows, dw_gate, dw_up = mk.expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets)
    return out, mk.combine(dx_rows, row_id_map, top_k=probs.shape[1]), grad_probs, dw_gate, dw_up, dw_down


def rel_l2(value, truth):
    return ((value.double() - truth.double()).norm() / truth.double().norm()).item()


@pytest.mark.cuda
@needs_cuda
def test_bf16_forward_and_backward_match_fp32_torch_on_the_gpu():
    tokens, k, d, f, experts = 2048, 2, 520, 352, 8  # d, f no multiple of the tiles
    token_of_row, row_id_map, offsets, probs, slot_expert = random_layout(tokens, k, experts, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(tokens, d, device="cuda", generator=gen)
    ws = [torch.randn(experts, *shape, device="cuda", generator=gen) / shape[0] ** 0.5
          for shape in ((d, f), (d, f), (f, d))]
    grad_out = torch.randn(tokens, d, device="cuda", generator=gen)
    leaves = [t.clone().requires_grad_() for t in (x, probs, *ws)]
    torch_moe(leaves[0], leaves[2], leaves[3], leaves[4], leaves[1], slot_expert).backward(grad_out)
    truth_out = torch_moe(x, *ws, probs, slot_expert)
    bf16 = [t.bfloat16() for t in (x, *ws)]
    got = all_kernels(bf16[0], *bf16[1:], token_of_row, row_id_map, offsets, probs, grad_out.bfloat16())
    truths = [truth_out, leaves[0].grad, leaves[1].grad, leaves[2].grad, leaves[3].grad, leaves[4].grad]
    for name, value, truth in zip(["out", "dx", "dprobs", "dw_gate", "dw_up", "dw_down"], got, truths):
        assert rel_l2(value, truth) < 1e-2, name
    assert torch.count_nonzero(got[5][1]) == 0  # the empty expert
    assert all(torch.equal(a, b) for a, b in zip(got, all_kernels(
        bf16[0], *bf16[1:], token_of_row, row_id_map, offsets, probs, grad_out.bfloat16())))


@pytest.mark.cuda
@needs_cuda
def test_no_kernel_syncs_with_the_host():
    token_of_row, row_id_map, offsets, probs, _ = random_layout(256, 2, 8, seed=7)
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 128, 96, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(8, 96, 128, device="cuda", dtype=torch.bfloat16)
    args = (x, w, w, w_down, token_of_row, row_id_map, offsets, probs, torch.randn_like(x))
    all_kernels(*args)  # compiled first: compiling may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        all_kernels(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
