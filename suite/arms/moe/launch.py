"""The experts' launchers: ragged grouped GEMMs over the expert-sorted layout, each GEMM, the
SwiGLU backward and the combines as an entry point, and a layer's launches planned once per
call shape (`LayerPlan`).

The layout (made by the routing): R kept rows sorted by expert; expert e owns rows
offsets[e]:offsets[e+1] (int32 [E+1], offsets[0] = 0); token_of_row (int32 [R_max]) gives each
sorted row's token, rows past offsets[E] unused; row_id_map (int32 [T*k]) gives the sorted row
of (token t, slot s) at t*k + s, -1 for a dropped slot; probs fp32 [T, k].

On sm90 cards, in bf16 and at layers as large as the model presets, the row GEMMs (up, down,
dx; d_a where grouped_mm does not take it) read their dense operand tiles through TMA
descriptors (`config.tma_gemms`: the same tiles, sums and bits as the pointer kernels), and the
weight gradients and d_a's GEMM go through torch._grouped_mm (torch's CUTLASS grouped GEMMs;
`config.vendor_gemms`), on x's rows gathered into the sorted order first
(`kernels.gather_rows_kernel`): at the model presets these took less time than our pointer kernels (the one exception, down at
mixtral on one of two machines; scripts/moe_tune.py, figures in docs/tuning.md). Other cards
and the rtx profile keep the pointer kernels.

Nothing here reads R or a per-expert count on the host: a GEMM over rows launches over an upper
bound of row tiles, cdiv(R_max, BLOCK_M) + E (each expert adds at most one partial tile), and
each program finds its expert and rows from `offsets` on the device (`kernels._expert_tile`); programs
past the last tile do nothing. All sums run in a fixed order (no atomics), so a run reproduces
its bits. Math is fp32 (fp32 accumulators, SwiGLU in fp32); tl.dot takes the operands in their
own dtype: bf16 / fp16 on tensor cores (the training path), fp32 at full ("ieee") precision, no
TF32 (the parity path: exact, and slow on a GPU).

The pieces of one MoE layer, forward and backward:

    a, g, u = expert_up(x, w_gate, w_up, token_of_row, offsets)
    y_rows = expert_down(a, w_down, offsets)
    out = combine(y_rows, row_id_map, probs)
    grad_rows, grad_probs = combine_backward(grad_out, y_rows, probs, row_id_map)
    dg, du, dw_down = expert_down_backward(grad_rows, a, g, u, w_down, offsets)
    dx_rows, dw_gate, dw_up = expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets)
    dx = combine(dx_rows, row_id_map, top_k=k)
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from suite.arms.moe import config, kernels
from suite.arms.moe.activation import PLAIN, GatedActivation, as_activation
from suite.arms.moe.weights import GateUpLayout
from suite.triton_support import (
    FLOAT_DTYPES,
    DescriptorLaunch,
    PlannedLaunch,
    cdiv,
    descriptor_strides,
    interpreted,
    next_pow2,
    require_runnable,
)


# --------------------------------------------------------------------------------------------
# Checks and buffers
# --------------------------------------------------------------------------------------------


def _buffer(given, fn: str, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The caller's buffer when it matches (reused as is), a new one when None."""
    if given is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(given.shape) != shape or given.dtype != dtype or given.device != device or not given.is_contiguous():
        raise ValueError(
            f"{fn}: {name} must be a contiguous {dtype} tensor of shape {shape} on {device}, got "
            f"{'a non-contiguous ' if not given.is_contiguous() else ''}{given.dtype} tensor of shape "
            f"{tuple(given.shape)} on {given.device}; pass a matching tensor, or None to allocate one"
        )
    return given


def _check(ok: bool, fn: str, message: str | Callable[[], str]) -> None:
    """Raise with the message when not ok. A message that formats shapes or dtypes is given
    as a lambda: formatted on every call, they cost an entry point more host time than its
    kernel takes at a small shape (`python scripts/moe_host_probe.py --calls 1000`)."""
    if not ok:
        raise ValueError(f"{fn}: {message if isinstance(message, str) else message()}")


def _check_index(t: torch.Tensor, fn: str, name: str, device) -> None:
    _check(t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), fn,
           lambda: f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    _check(t.device == device, fn, lambda: f"{name} is on {t.device}, the data on {device}")


def _check_rows(t: torch.Tensor, fn: str, name: str, n_rows: int, width: int, dtype, device) -> None:
    _check(t.shape == (n_rows, width) and t.is_contiguous(), fn,
           lambda: f"{name} must be a contiguous ({n_rows}, {width}) tensor, got " + (
               f"shape {tuple(t.shape)}" if t.is_contiguous()
               else f"a non-contiguous one of shape {tuple(t.shape)} (pass .contiguous())"))
    _check(t.dtype == dtype and t.device == device, fn,
           lambda: f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")


def _check_weight(w: torch.Tensor, fn: str, name: str, shape: tuple, dtype, device) -> None:
    _check(w.shape == shape, fn, lambda: f"{name} must have shape {shape}, got {tuple(w.shape)}")
    _check(w.dtype == dtype and w.device == device, fn,
           lambda: f"{name} must be {dtype} on {device} (x's), got {w.dtype} on {w.device}")


def _check_dtype(x: torch.Tensor, fn: str) -> None:
    _check(x.dtype in FLOAT_DTYPES, fn, lambda: f"tensors must be bfloat16, float16 or float32, not {x.dtype}")


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and interpreted()


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def up_launch(n_rows, n_experts, d, f, x_stride, wg_strides, wu_strides, dtype, device, save=True,
              tma=True, warp_specialize=False, pair_strides=None,
              activation: GatedActivation = PLAIN) -> PlannedLaunch | DescriptorLaunch:
    """Called with (x, w_gate, w_up, token_of_row, offsets, a, g, u); the weights through
    descriptors where `config.tma_gemms` takes the layer (unless tma is False) and their strides allow,
    each stored either [E, d, f] or [E, f, d] (then passed as its transposed view), both alike.
    pair_strides: g's and u's (row stride, column step), (f, 1) when None."""
    cfg = config.gemm_config("up", n_rows // n_experts, f, dtype, device)
    tiles = (cdiv(n_rows, cfg.block_m) + n_experts, cdiv(f, cfg.block_n))
    grid = _row_tile_grid(tiles, cfg)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
                SAVE=save, UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, ACT=activation.mode,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    pair = pair_strides or (f, 1)
    limit = activation.kernel_limit
    pointers = PlannedLaunch(kernels.up_kernel, grid,
                             (n_experts, d, f, x_stride, *pair, *wg_strides, *wu_strides, *tiles, limit),
                             (dtype, dtype, dtype, torch.int32, torch.int32, dtype, dtype, dtype), **meta)
    w_nk = wg_strides[2] != 1  # stored [E, f, d]: d the unit-stride dim, if any
    stored = [(e, n, k) if w_nk else (e, k, n) for e, k, n in (wg_strides, wu_strides)]
    if not (tma and config.tma_gemms(n_rows, n_experts, d, f, dtype, device) and w_nk == (wu_strides[2] != 1)
            and all(descriptor_strides(s, dtype.itemsize) for s in stored)):
        return pointers
    w_block = [1, cfg.block_n, cfg.block_k] if w_nk else [1, cfg.block_k, cfg.block_n]
    return DescriptorLaunch(kernels.up_tma_kernel, grid, (n_experts, d, f, x_stride, *pair, *tiles, limit),
                            (None, w_block, w_block, None, None, None, None, None), pointers, **meta, W_NK=w_nk,
                            WARP_SPECIALIZE=warp_specialize)


def rows_launch(kind, n_rows, n_k, n_n, n_experts, w_strides, w2_strides, two, dtype, device,
                tma=True, warp_specialize=False, layer=None) -> PlannedLaunch | DescriptorLaunch:
    """c[r] = a[r] @ W[e] (+ a2[r] @ W2[e] when two) over the ragged rows, W[e] read as [K, N]
    through w_strides (e, k, n), at GEMM kind `kind`'s tile; called with (a, a2, w, w2, offsets, c).
    a, a2 and the weights through descriptors where `config.tma_gemms` takes the layer (unless tma is
    False) and the strides allow: a weight then stored either [E, K, N] or [E, N, K], whether
    passed as stored or as a transposed view (a model's [E, out, in] storage). warp_specialize:
    the TMA kernel's loop warp-specialized (an experiment, scripts/moe_tune.py: Triton 3.6's
    Hopper pass fails on a 4-warp tile, and at the model presets' tile it gained at mixtral
    alone). layer: the layer's (d, f) for the TMA rule, where K or N is not one of them (dx over
    a fused weight's 2f)."""
    cfg = config.gemm_config(kind, n_rows // n_experts, n_n, dtype, device)
    tiles = (cdiv(n_rows, cfg.block_m) + n_experts, cdiv(n_n, cfg.block_n))
    grid = _row_tile_grid(tiles, cfg)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
                TWO=two, UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    pointers = PlannedLaunch(kernels.rows_gemm_kernel, grid, (n_experts, n_k, n_n, *w_strides, *w2_strides, *tiles),
                             (dtype, dtype, dtype, dtype, torch.int32, dtype), **meta)
    d, f = layer or ((n_k, n_n) if kind == "swiglu_grad" else (n_n, n_k))  # d_a's K is d; down's and dx's N
    w_nk = w_strides[2] != 1  # stored [E, N, K]: its K dim the unit-stride one, if any
    stored = [(e, n, k) if w_nk else (e, k, n) for e, k, n in (w_strides, w2_strides)]
    if not (tma and config.tma_gemms(n_rows, n_experts, d, f, dtype, device) and w_nk == (w2_strides[2] != 1)
            and descriptor_strides((n_k, 1), dtype.itemsize)
            and all(descriptor_strides(s, dtype.itemsize) for s in stored)):
        return pointers
    a_block = [cfg.block_m, cfg.block_k]
    w_block = [1, cfg.block_n, cfg.block_k] if w_nk else [1, cfg.block_k, cfg.block_n]
    second = (a_block, w_block) if two else (None, None)  # one pair: the second never read
    return DescriptorLaunch(kernels.rows_tma_kernel, grid, (n_experts, n_k, n_n, *tiles),
                            (a_block, second[0], w_block, second[1], None, None), pointers, **meta, W_NK=w_nk,
                            WARP_SPECIALIZE=warp_specialize)


def _swiglu_launch(n_rows, f, n_experts, da_stride, pair_strides, dtype, device,
                   activation: GatedActivation = PLAIN) -> PlannedLaunch:
    """dg, du from d_a (row stride da_stride) and the pre-activations (g, u, dg and du all of
    pair_strides: row stride, column step); called with (d_a, gate, up, dg, du, offsets)."""
    block = 64 if interpreted() and device.type != "cuda" else config.SWIGLU_BLOCK
    block_c = min(config.SWIGLU_COLUMNS, next_pow2(f), block)
    block_r = block // block_c
    return PlannedLaunch(kernels.swiglu_backward_kernel, (cdiv(n_rows, block_r), cdiv(f, block_c)),
                         (n_experts, f, da_stride, *pair_strides, activation.kernel_limit),
                         (dtype,) * 5 + (torch.int32,), BLOCK_R=block_r, BLOCK_C=block_c, ACT=activation.mode,
                         num_warps=4)


def _weight_grad_launch(n_experts, n_i, n_j, x_stride, gather, two, dtype, device, grad_strides=None,
                        dw_strides=None) -> PlannedLaunch:
    """dw[e] = x_e^T @ grad_e (and dw2[e] = x_e^T @ grad2_e when two), x_e gathered through
    token_of_row when gather; called with (x, token_of_row or grad, grad, grad2, offsets, dw, dw2).
    grad_strides: grad's and grad2's (row stride, column step), (n_j, 1) when None; dw_strides:
    dw's and dw2's (expert, row, column) strides, contiguous when None."""
    # the weight's rows take the place of the token rows: 128-row tiles once it has 128
    cfg = config.gemm_config("weight_grad_two" if two else "weight_grad", n_i, n_j, dtype, device, n_i * n_j)
    scalars = (n_i, n_j, x_stride, *(grad_strides or (n_j, 1)), *(dw_strides or (n_i * n_j, n_j, 1)))
    return PlannedLaunch(
        kernels.weight_grad_kernel, (cdiv(n_i, cfg.block_m) * cdiv(n_j, cfg.block_n), n_experts), scalars,
        (dtype, torch.int32 if gather else dtype, dtype, dtype, torch.int32, dtype, dtype),
        BLOCK_I=cfg.block_m, BLOCK_J=cfg.block_n, BLOCK_R=cfg.block_k, GATHER=gather, TWO=two,
        UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _combine_launch(n_tokens, d, top_k, weighted, dtype, device) -> PlannedLaunch:
    """Called with (rows, row_id_map, probs or rows, out)."""
    cfg = config.combine_config(n_tokens, d, device)
    return PlannedLaunch(
        kernels.combine_kernel, (cdiv(n_tokens, cfg.block_t), cdiv(d, cfg.block_d)), (n_tokens, d),
        (dtype, torch.int32, torch.float32 if weighted else dtype, dtype),
        TOP_K=top_k, WEIGHTED=weighted, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )


def _gather_launch(n_rows, d, x_stride, n_experts, dtype, device) -> PlannedLaunch:
    """x's rows in the sorted order; called with (x, token_of_row, offsets, out). A row stream,
    at the combines' tiles."""
    cfg = config.combine_config(n_rows, d, device)
    return PlannedLaunch(
        kernels.gather_rows_kernel, (cdiv(n_rows, cfg.block_t), cdiv(d, cfg.block_d)), (n_experts, d, x_stride),
        (dtype, torch.int32, torch.int32, dtype), BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )


def _combine_bwd_launch(n_tokens, d, top_k, dtype, device) -> PlannedLaunch:
    """Called with (grad_out, y_rows, row_id_map, probs, grad_rows, grad_probs)."""
    cfg = config.combine_config(n_tokens, d, device)
    return PlannedLaunch(
        kernels.combine_bwd_kernel, (cdiv(n_tokens, cfg.block_t),), (n_tokens, d),
        (dtype, dtype, torch.int32, torch.float32, dtype, torch.float32),
        TOP_K=top_k, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, BLOCK_S=next_pow2(top_k), num_warps=cfg.num_warps,
    )


def expert_up(x, w_gate, w_up, token_of_row, offsets, *, out=None, gate_out=None, up_out=None,
              save_preactivations: bool = True, activation: GatedActivation | None = None):
    """a[r] = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for every sorted row r of expert e
    (tok = token_of_row[r]; clamped, or gelu for silu, as `activation` says); x [T, d], w_gate and
    w_up [E, d, f].
    -> (a, g, u), each [R_max, f] in x's dtype, g and u the pre-activations (None without
    save_preactivations). Rows past offsets[E] are left unwritten. out / gate_out / up_out:
    caller-owned buffers, reused."""
    fn = "expert_up"
    activation = as_activation(activation, fn)
    _check_dtype(x, fn)
    require_runnable(x, fn)
    _check(x.dim() == 2 and x.stride(1) == 1, fn, lambda: f"x must be 2-D (T, d) with unit column stride, got {tuple(x.shape)}")
    n_experts, d, f = w_gate.shape if w_gate.dim() == 3 else (0, 0, 0)
    _check(w_gate.dim() == 3 and d == x.shape[1], fn, lambda: f"w_gate must be (E, d={x.shape[1]}, f), got {tuple(w_gate.shape)}")
    _check_weight(w_up, fn, "w_up", (n_experts, d, f), x.dtype, x.device)
    _check_weight(w_gate, fn, "w_gate", (n_experts, d, f), x.dtype, x.device)
    _check_index(token_of_row, fn, "token_of_row", x.device)
    _check_index(offsets, fn, "offsets", x.device)
    _check(offsets.shape[0] == n_experts + 1, fn, lambda: f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    n_rows = token_of_row.shape[0]
    a = _buffer(out, fn, "out", (n_rows, f), x.dtype, x.device)
    g = _buffer(gate_out, fn, "gate_out", (n_rows, f), x.dtype, x.device) if save_preactivations else None
    u = _buffer(up_out, fn, "up_out", (n_rows, f), x.dtype, x.device) if save_preactivations else None
    if n_rows and n_experts and f:
        up_launch(n_rows, n_experts, d, f, x.stride(0), w_gate.stride(), w_up.stride(), x.dtype, x.device,
                  save_preactivations, activation=activation)(x, w_gate, w_up, token_of_row, offsets, a,
                                                              a if g is None else g, a if u is None else u)
    return a, g, u


def expert_down(a, w_down, offsets, *, out=None):
    """y_rows[r] = a[r] @ w_down[e] for every sorted row r of expert e; a [R_max, f], w_down
    [E, f, d]. -> y_rows [R_max, d] in a's dtype, rows past offsets[E] unwritten. out: a
    caller-owned buffer, reused."""
    fn = "expert_down"
    _check_dtype(a, fn)
    require_runnable(a, fn)
    _check(w_down.dim() == 3, fn, lambda: f"w_down must be (E, f, d), got {tuple(w_down.shape)}")
    n_experts, f, d = w_down.shape
    _check_rows(a, fn, "a", a.shape[0], f, w_down.dtype, w_down.device)
    _check_index(offsets, fn, "offsets", a.device)
    _check(offsets.shape[0] == n_experts + 1, fn, lambda: f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    n_rows = a.shape[0]
    y = _buffer(out, fn, "out", (n_rows, d), a.dtype, a.device)
    grouped_rows("rows", a, w_down, w_down.stride(), offsets, y)
    return y


def _row_tile_grid(tiles: tuple[int, int], cfg: config.GemmConfig) -> tuple[int, ...]:
    """The launch grid over (row tiles, column tiles): 2-D, or 1-D when the tiles go in groups."""
    return tiles if cfg.group_m == 0 else (tiles[0] * tiles[1],)


def grouped_rows(kind, a, w, w_strides, offsets, c, a2=None, w2=None, w2_strides=None):
    """c[r] = a[r] @ W[e] (+ a2[r] @ W2[e]) over the ragged rows (see rows_launch)."""
    n_rows, n_k = a.shape
    n_n = c.shape[1]
    n_experts = offsets.shape[0] - 1
    if n_rows and n_experts and n_n:
        rows_launch(kind, n_rows, n_k, n_n, n_experts, w_strides, w2_strides or w_strides, a2 is not None, a.dtype,
                     a.device)(a, a if a2 is None else a2, w, w if w2 is None else w2, offsets, c)


def swiglu_backward(d_a, gate, up, offsets, dg, du, activation: GatedActivation = PLAIN):
    """dg, du from d_a and the pre-activations, over the kept rows; d_a may be du (in place).
    gate, up, dg and du share one layout (row stride, column step), d_a has unit columns."""
    if d_a.numel():
        _swiglu_launch(d_a.shape[0], d_a.shape[1], offsets.shape[0] - 1, d_a.stride(0), gate.stride(), d_a.dtype,
                       d_a.device, activation)(d_a, gate, up, dg, du, offsets)


def weight_grad(x, token_of_row, grad, offsets, dw, grad2=None, dw2=None):
    """dw[e] = x_e^T @ grad_e (and dw2[e] = x_e^T @ grad2_e); x_e gathered through token_of_row
    when given. grad and grad2 share one layout, dw and dw2 another (any strides)."""
    n_experts, n_i, n_j = dw.shape
    if n_experts and n_i and n_j:
        _weight_grad_launch(n_experts, n_i, n_j, x.stride(0), token_of_row is not None, grad2 is not None,
                            grad.dtype, grad.device, grad.stride(), dw.stride())(
            x, grad if token_of_row is None else token_of_row, grad, grad if grad2 is None else grad2, offsets, dw,
            dw if dw2 is None else dw2)


def combine(rows, row_id_map, probs=None, *, top_k: int | None = None, out=None):
    """out[t] = sum over slots s = 0..k-1, in that order, of probs[t, s] * rows[row_id_map[t*k + s]]
    (dropped slots, -1, skipped), summed in fp32, out [T, d] in rows' dtype. Without probs, the
    plain sum (the gather of dx rows back to tokens); k is then `top_k`. out: a caller-owned
    buffer, reused."""
    fn = "combine"
    _check_dtype(rows, fn)
    require_runnable(rows, fn)
    _check(rows.dim() == 2 and rows.is_contiguous(), fn, lambda: f"rows must be a contiguous (R_max, d) tensor, got {tuple(rows.shape)}")
    _check_index(row_id_map, fn, "row_id_map", rows.device)
    if probs is not None:
        _check(probs.dim() == 2 and probs.dtype == torch.float32 and probs.is_contiguous(), fn,
               lambda: f"probs must be a contiguous (T, k) float32 tensor, got {probs.dtype} of shape {tuple(probs.shape)}")
        _check(probs.device == rows.device, fn, lambda: f"probs is on {probs.device}, rows on {rows.device}")
        _check(top_k in (None, probs.shape[1]), fn, lambda: f"top_k={top_k} but probs has {probs.shape[1]} slots")
        top_k = probs.shape[1]
    _check(top_k is not None and top_k > 0, fn, "pass probs, or top_k for the unweighted sum")
    _check(row_id_map.shape[0] % top_k == 0, fn, lambda: f"row_id_map has {row_id_map.shape[0]} slots, no multiple of k={top_k}")
    n_tokens, d = row_id_map.shape[0] // top_k, rows.shape[1]
    _check(probs is None or probs.shape[0] == n_tokens, fn, lambda: f"probs must have T = {n_tokens} rows, got {probs.shape[0] if probs is not None else 0}")
    result = _buffer(out, fn, "out", (n_tokens, d), rows.dtype, rows.device)
    if n_tokens and d:
        _combine_launch(n_tokens, d, top_k, probs is not None, rows.dtype, rows.device)(
            rows, row_id_map, rows if probs is None else probs, result)
    return result


def combine_backward(grad_out, y_rows, probs, row_id_map, *, grad_rows_out=None, grad_probs_out=None):
    """The combine's backward in one pass over grad_out [T, d]: -> (grad_rows [R_max, d] in
    grad_out's dtype, grad_rows[row_id_map[t*k + s]] = grad_out[t] * probs[t, s]; grad_probs
    fp32 [T, k], grad_probs[t, s] = <grad_out[t], y_rows[row]>, 0 for a dropped slot). Rows
    past offsets[E] are unwritten. grad_rows_out / grad_probs_out: caller-owned, reused."""
    fn = "combine_backward"
    _check_dtype(grad_out, fn)
    require_runnable(grad_out, fn)
    _check(probs.dim() == 2 and probs.dtype == torch.float32 and probs.is_contiguous(), fn,
           lambda: f"probs must be a contiguous (T, k) float32 tensor, got {probs.dtype} of shape {tuple(probs.shape)}")
    n_tokens, top_k = probs.shape
    _check(grad_out.dim() == 2 and grad_out.shape[0] == n_tokens, fn,
           lambda: f"grad_out must be (T={n_tokens}, d), got {tuple(grad_out.shape)}")
    d = grad_out.shape[1]
    _check_rows(grad_out, fn, "grad_out", n_tokens, d, grad_out.dtype, probs.device)
    _check_rows(y_rows, fn, "y_rows", y_rows.shape[0], d, grad_out.dtype, grad_out.device)
    _check_index(row_id_map, fn, "row_id_map", grad_out.device)
    _check(row_id_map.shape[0] == n_tokens * top_k, fn, lambda: f"row_id_map must have T * k = {n_tokens * top_k} slots, got {row_id_map.shape[0]}")
    grad_rows = _buffer(grad_rows_out, fn, "grad_rows_out", tuple(y_rows.shape), grad_out.dtype, grad_out.device)
    grad_probs = _buffer(grad_probs_out, fn, "grad_probs_out", (n_tokens, top_k), torch.float32, grad_out.device)
    if n_tokens:
        _combine_bwd_launch(n_tokens, d, top_k, grad_out.dtype, grad_out.device)(
            grad_out, y_rows, row_id_map, probs, grad_rows, grad_probs)
    return grad_rows, grad_probs


def expert_down_backward(grad_rows, a, gate, up, w_down, offsets, *, dg_out=None, du_out=None, dw_down_out=None,
                         activation: GatedActivation | None = None):
    """Backward of expert_down and of the SwiGLU: d_a = grad_rows @ w_down[e]^T (written in
    du's buffer, in a's dtype as eager autograd keeps it), then one elementwise pass gives
    dg = d_a * u * silu'(g) and du = d_a * silu(g) in fp32 (gate, up: the forward's
    pre-activations; through the clamps `activation` names, if any, or with gelu for silu);
    dW_down[e] = a_e^T @
    grad_rows_e. -> (dg, du [R_max, f] in a's dtype, dw_down [E, f, d] in w_down's dtype; an
    empty expert's is zero). dg_out / du_out / dw_down_out: caller-owned, reused."""
    fn = "expert_down_backward"
    activation = as_activation(activation, fn)
    _check_dtype(a, fn)
    require_runnable(a, fn)
    _check(w_down.dim() == 3, fn, lambda: f"w_down must be (E, f, d), got {tuple(w_down.shape)}")
    n_experts, f, d = w_down.shape
    n_rows = a.shape[0]
    _check_rows(a, fn, "a", n_rows, f, w_down.dtype, w_down.device)
    for name, t in (("gate", gate), ("up", up)):
        _check_rows(t, fn, name, n_rows, f, a.dtype, a.device)
    _check_rows(grad_rows, fn, "grad_rows", n_rows, d, a.dtype, a.device)
    _check_index(offsets, fn, "offsets", a.device)
    _check(offsets.shape[0] == n_experts + 1, fn, lambda: f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    dg = _buffer(dg_out, fn, "dg_out", (n_rows, f), a.dtype, a.device)
    du = _buffer(du_out, fn, "du_out", (n_rows, f), a.dtype, a.device)
    # d_a goes into du before gate and up are read, and dg is written before du in each element
    _check(len({dg.data_ptr(), du.data_ptr(), gate.data_ptr(), up.data_ptr()}) == 4, fn,
           "dg_out and du_out must be buffers of their own, not gate, up or each other; pass other tensors")
    w_down_t = w_down.transpose(1, 2)
    if (dw_down_out is None and n_rows and config.vendor_gemms(n_rows, n_experts, d, f, a.dtype, a.device)
            and config.grouped_mm_ready(grad_rows, a.t(), w_down_t)):
        ends = offsets[1:]  # torch._grouped_mm's groups end there; rows past offsets[E] are not read
        swiglu_backward(torch._grouped_mm(grad_rows, w_down_t, offs=ends), gate, up, offsets, dg, du, activation)
        return dg, du, torch._grouped_mm(a.t(), grad_rows, offs=ends)
    dw_down = _buffer(dw_down_out, fn, "dw_down_out", (n_experts, f, d), w_down.dtype, a.device)
    s_e, s_f, s_d = w_down.stride()
    grouped_rows("swiglu_grad", grad_rows, w_down, (s_e, s_d, s_f), offsets, du)  # d_a, in du's buffer
    swiglu_backward(du, gate, up, offsets, dg, du, activation)
    weight_grad(a, None, grad_rows, offsets, dw_down)
    return dg, du, dw_down


def expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets, *, dx_rows_out=None, dw_gate_out=None,
                       dw_up_out=None):
    """Backward of expert_up's two GEMMs: dx_rows = dg @ w_gate[e]^T + du @ w_up[e]^T in one
    accumulator; dW_gate[e] = x_e^T @ dg_e and dW_up[e] = x_e^T @ du_e in one kernel (x_e: the expert's
    token rows, gathered through token_of_row). -> (dx_rows [R_max, d] in x's dtype,
    dw_gate and dw_up [E, d, f] in the weights' dtype). dx = combine(dx_rows, row_id_map,
    top_k=k). dx_rows_out / dw_gate_out / dw_up_out: caller-owned, reused; without the last two
    a layer that `config.vendor_gemms` takes gets its weight gradients from torch._grouped_mm."""
    fn = "expert_up_backward"
    _check_dtype(x, fn)
    require_runnable(x, fn)
    _check(x.dim() == 2 and x.stride(1) == 1, fn, lambda: f"x must be 2-D (T, d) with unit column stride, got {tuple(x.shape)}")
    _check(w_gate.dim() == 3, fn, lambda: f"w_gate must be (E, d, f), got {tuple(w_gate.shape)}")
    n_experts, d, f = w_gate.shape
    _check_weight(w_gate, fn, "w_gate", (n_experts, x.shape[1], f), x.dtype, x.device)
    _check_weight(w_up, fn, "w_up", (n_experts, d, f), x.dtype, x.device)
    _check_index(token_of_row, fn, "token_of_row", x.device)
    _check_index(offsets, fn, "offsets", x.device)
    _check(offsets.shape[0] == n_experts + 1, fn, lambda: f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    n_rows = token_of_row.shape[0]
    for name, t in (("dg", dg), ("du", du)):
        _check_rows(t, fn, name, n_rows, f, x.dtype, x.device)
    dx_rows = _buffer(dx_rows_out, fn, "dx_rows_out", (n_rows, d), x.dtype, x.device)
    g_e, g_d, g_f = w_gate.stride()
    u_e, u_d, u_f = w_up.stride()
    grouped_rows("dx", dg, w_gate, (g_e, g_f, g_d), offsets, dx_rows, a2=du, w2=w_up, w2_strides=(u_e, u_f, u_d))
    if (dw_gate_out is None and dw_up_out is None and n_rows
            and config.vendor_gemms(n_rows, n_experts, d, f, x.dtype, x.device) and config.grouped_mm_ready(dg, du)):
        x_rows = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
        _gather_launch(n_rows, d, x.stride(0), n_experts, x.dtype, x.device)(x, token_of_row, offsets, x_rows)
        return (dx_rows, *vendor_dw_gate_up(x_rows, dg, du, offsets))
    dw_gate = _buffer(dw_gate_out, fn, "dw_gate_out", (n_experts, d, f), w_gate.dtype, x.device)
    dw_up = _buffer(dw_up_out, fn, "dw_up_out", (n_experts, d, f), w_up.dtype, x.device)
    weight_grad(x, token_of_row, dg, offsets, dw_gate, grad2=du, dw2=dw_up)
    return dx_rows, dw_gate, dw_up


def vendor_dw_gate_up(x_rows, dg, du, offsets):
    """dW_gate and dW_up through torch._grouped_mm, x_rows: x's rows in the sorted order."""
    ends = offsets[1:]
    return torch._grouped_mm(x_rows.t(), dg, offs=ends), torch._grouped_mm(x_rows.t(), du, offs=ends)


# --------------------------------------------------------------------------------------------
# One layer's launches, planned once per call shape
# --------------------------------------------------------------------------------------------


class LayerPlan:
    """One MoE layer's ten launches (forward and backward) at one call shape, made once: the
    entry points' checks and tile choices are paid when the plan is made, so a call pays its
    buffers and its launches alone (see PlannedLaunch). For `suite.arms.moe.experts`, which
    checked its arguments; `layer_plan` makes and keeps the plans.

    The weights are the layer's autograd inputs: (w_gate, w_up, w_down), any strides, or with a
    `GateUpLayout`, a model's (gate_up, down), whose gradients come back in that layout. The
    forward's pre-activations g and u share one buffer, gu, laid out as the weights' gate and
    up are: [R, 2f] in gate_up's order under a layout, else [2, R, f]. The backward's dg and du
    take gu's layout, so under a layout they are one [R, 2f] operand: of dx (one GEMM over
    gate_up's 2f) and of gate_up's gradient, written in the parameter's own layout."""

    def __init__(self, n_tokens, d, f, n_experts, top_k, n_rows, x_stride, weights, layout: GateUpLayout | None,
                 dtype, device, activation: GatedActivation = PLAIN):
        self.n_tokens, self.d, self.f, self.n_experts, self.top_k, self.n_rows = n_tokens, d, f, n_experts, top_k, n_rows
        self.dtype, self.device, self.layout = dtype, device, layout
        self.weight_shapes = [tuple(w.shape) for w in weights]
        self.gu_shape = (2, n_rows, f) if layout is None else (n_rows, 2 * f)
        self.pair_strides = (f, 1) if layout is None else (2 * f, 1 if layout.concatenated else 2)
        wg, wu, wd = (w.stride() for w in self.views(weights))
        # the strides the weight gradients' [E, d, f] and [E, f, d] views are written through
        dwg, _, dwd = (w.stride() for w in self.views([torch.empty(s, device="meta") for s in self.weight_shapes]))
        (g_e, g_d, g_f), (u_e, u_d, u_f), (s_e, s_f, s_d) = wg, wu, wd
        self.up = up_launch(n_rows, n_experts, d, f, x_stride, wg, wu, dtype, device, pair_strides=self.pair_strides,
                            activation=activation)
        self.down = rows_launch("rows", n_rows, f, d, n_experts, wd, wd, False, dtype, device)
        self.combine = _combine_launch(n_tokens, d, top_k, True, dtype, device)
        self.combine_bwd = _combine_bwd_launch(n_tokens, d, top_k, dtype, device)
        self.d_a = rows_launch("swiglu_grad", n_rows, d, f, n_experts, (s_e, s_d, s_f), (s_e, s_d, s_f), False, dtype,
                               device)
        self.swiglu = _swiglu_launch(n_rows, f, n_experts, f, self.pair_strides, dtype, device, activation)
        self.dw_down = _weight_grad_launch(n_experts, f, d, f, False, False, dtype, device, dw_strides=dwd)
        if layout is None:
            self.dx = rows_launch("dx", n_rows, f, d, n_experts, (g_e, g_f, g_d), (u_e, u_f, u_d), True, dtype, device)
        else:  # dgu [R, 2f] against gate_up's 2f rows: one GEMM
            rows_strides = layout.rows_strides(weights[0])
            self.dx = rows_launch("dx", n_rows, 2 * f, d, n_experts, rows_strides, rows_strides, False, dtype, device,
                                  layer=(d, f))
        self.dw_gate_up = _weight_grad_launch(n_experts, d, f, x_stride, True, True, dtype, device,
                                              grad_strides=self.pair_strides, dw_strides=dwg)
        self.combine_dx = _combine_launch(n_tokens, d, top_k, False, dtype, device)
        self.vendor = config.vendor_gemms(n_rows, n_experts, d, f, dtype, device)
        if self.vendor:
            self.gather = _gather_launch(n_rows, d, x_stride, n_experts, dtype, device)

    def views(self, weights):
        """(w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d]) of the weights as given."""
        return weights if self.layout is None else self.layout.views(*weights)

    def halves(self, gu):
        """g and u (or dg and du) of a pair buffer in gu's layout."""
        return gu.unbind(0) if self.layout is None else self.layout.halves(gu)

    def _empty(self, *shape, dtype=None):
        return torch.empty(shape, dtype=dtype or self.dtype, device=self.device)

    def forward(self, x, probs, weights, token_of_row, offsets, row_id_map, one_buffer=False):
        """expert_up, expert_down and combine: -> (out, a, gu, y_rows). one_buffer: a and gu as
        views of one allocation (not for a custom op, whose outputs must not share memory)."""
        rows, f = self.n_rows, self.f
        w_gate, w_up, w_down = self.views(weights)
        if one_buffer:  # each [R, f] slab starts 16-byte aligned, as the kept launches need
            n = rows * f
            slab = -(-n * self.dtype.itemsize // 16) * 16 // self.dtype.itemsize
            flat = torch.empty(3 * slab, dtype=self.dtype, device=self.device)
            a = flat[:n].view(rows, f)
            gu = (flat.as_strided((2, rows, f), (slab, f, 1), slab) if self.layout is None
                  else flat[slab:slab + 2 * n].view(rows, 2 * f))
        else:
            a, gu = self._empty(rows, f), self._empty(*self.gu_shape)
        y_rows, out = self._empty(rows, self.d), self._empty(self.n_tokens, self.d)
        self.up(x, w_gate, w_up, token_of_row, offsets, a, *self.halves(gu))
        self.down(a, a, w_down, w_down, offsets, y_rows)
        self.combine(y_rows, row_id_map, probs, out)
        return out, a, gu, y_rows

    def backward(self, grad_out, x, probs, weights, a, gu, y_rows, token_of_row, offsets, row_id_map,
                 reuse_saved=False, wanted=(True, True, True)):
        """combine_backward, expert_down_backward, expert_up_backward and the combine of dx:
        -> (dx, grad_probs, the weights' gradients in their shapes and layout). reuse_saved: the
        forward's a, gu and y_rows are dead after this backward (autograd keeps no graph), so its
        temporaries go into them, each once the launches that read it are done. wanted: whether
        dx, gate and up's gradient, and down's are needed; one not wanted is None and its GEMMs
        are not run (frozen experts cost what they cost stock's grouped_mm)."""
        rows, d, f, layout = self.n_rows, self.d, self.f, self.layout
        want_dx, want_gate_up, want_down = wanted
        w_down = weights[2] if layout is None else layout.down_view(weights[1])
        grad_rows, grad_probs = self._empty(rows, d), self._empty(self.n_tokens, self.top_k, dtype=torch.float32)
        self.combine_bwd(grad_out, y_rows, row_id_map, probs, grad_rows, grad_probs)
        w_down_t = w_down.transpose(1, 2)
        # a weight view may be misaligned; under a layout dg and du go to grouped_mm as one [R, 2f]
        pairs = self.halves(gu) if layout is None else (gu,)
        if self.vendor and config.grouped_mm_ready(a.t(), w_down_t, *pairs):
            return self._vendor_backward(grad_rows, grad_probs, x, weights, w_down_t, a, gu, y_rows, token_of_row,
                                         offsets, row_id_map, reuse_saved, wanted)
        d_down = None
        if want_down:
            d_down = self._empty(*self.weight_shapes[-1])
            d_down_view = d_down if layout is None else layout.down_view(d_down)
            self.dw_down(a, grad_rows, grad_rows, grad_rows, offsets, d_down_view, d_down_view)
        if not (want_dx or want_gate_up):  # nothing below the SwiGLU is wanted
            return None, grad_probs, (*self._unwanted_gate_up(), d_down)
        if reuse_saved:  # a read: d_a there; dg and du over g and u (swiglu reads each first)
            d_a, dgu, dx_rows = a, gu, y_rows
        else:
            dgu, dx_rows = self._empty(*self.gu_shape), self._empty(rows, d)
            d_a = dgu[1] if layout is None else self._empty(rows, f)  # du's [R, f] rows, where they are whole
        self.d_a(grad_rows, grad_rows, w_down, w_down, offsets, d_a)
        dg, du = self.halves(dgu)
        self.swiglu(d_a, *self.halves(gu), dg, du, offsets)
        dx = self._dx(weights, dgu, offsets, dx_rows, row_id_map) if want_dx else None
        gate_up_grads = self._unwanted_gate_up()
        if want_gate_up:
            if layout is None:
                gate_up_grads = d_gate, d_up = self._empty(self.n_experts, d, f), self._empty(self.n_experts, d, f)
            else:
                gate_up_grads = (self._empty(*self.weight_shapes[0]),)
                d_gate, d_up = layout.gate_up_views(gate_up_grads[0])
            self.dw_gate_up(x, token_of_row, dg, du, offsets, d_gate, d_up)
        return dx, grad_probs, (*gate_up_grads, d_down)

    def _unwanted_gate_up(self):
        """gate and up's gradients where they are not wanted: (None, None), or a layout's (None,)."""
        return (None,) if self.layout is not None else (None, None)

    def _dx(self, weights, dgu, offsets, dx_rows, row_id_map):
        """dx: dx_rows = dg @ w_gate[e]^T + du @ w_up[e]^T in one accumulator (under a layout one
        GEMM of dgu against gate_up's 2f rows, else the two pairs in turn), then each token's k
        rows summed in slot order, so dx repeats its bits run to run."""
        if self.layout is None:
            self.dx(*self.halves(dgu), weights[0], weights[1], offsets, dx_rows)
        else:
            self.dx(dgu, dgu, weights[0], weights[0], offsets, dx_rows)
        dx = self._empty(self.n_tokens, self.d)
        self.combine_dx(dx_rows, row_id_map, dx_rows, dx)
        return dx

    def _vendor_backward(self, grad_rows, grad_probs, x, weights, w_down_t, a, gu, y_rows, token_of_row, offsets,
                         row_id_map, reuse_saved, wanted):
        """backward's rest with torch._grouped_mm for d_a and the weight gradients (`config.vendor_gemms`),
        the same sums as expert_down_backward and expert_up_backward take there. Each gradient
        GEMM's [E, M, N] output is its parameter's layout: [out, in] GEMMs for a model's
        [E, out, in] weights, and gate_up's in one GEMM over dgu."""
        ends = offsets[1:]
        layout = self.layout
        want_dx, want_gate_up, want_down = wanted
        out_in = layout is not None and not layout.transposed
        grouped_mm = torch._grouped_mm
        d_down = None
        if want_down:
            d_down = grouped_mm(grad_rows.t(), a, offs=ends) if out_in else grouped_mm(a.t(), grad_rows, offs=ends)
        if not (want_dx or want_gate_up):
            return None, grad_probs, (*self._unwanted_gate_up(), d_down)
        d_a = grouped_mm(grad_rows, w_down_t, offs=ends)
        if reuse_saved:  # dg and du over g and u (swiglu reads each first); x's rows in y_rows
            dgu, x_rows = gu, y_rows
        else:
            dgu, x_rows = self._empty(*self.gu_shape), self._empty(self.n_rows, self.d)
        dg, du = self.halves(dgu)
        self.swiglu(d_a, *self.halves(gu), dg, du, offsets)
        grads = (*self._unwanted_gate_up(), d_down)
        if want_gate_up:
            self.gather(x, token_of_row, offsets, x_rows)
            if layout is None:
                grads = (*vendor_dw_gate_up(x_rows, dg, du, offsets), d_down)
            else:
                d_gate_up = grouped_mm(dgu.t(), x_rows, offs=ends) if out_in else grouped_mm(x_rows.t(), dgu, offs=ends)
                grads = (d_gate_up, d_down)
        # dx's rows go where x's were, which are read by now
        return self._dx(weights, dgu, offsets, x_rows, row_id_map) if want_dx else None, grad_probs, grads


_layer_plans: dict[tuple, LayerPlan] = {}
config.kept_choices.append(_layer_plans)


def layer_plan(x, weights, layout: GateUpLayout | None, n_rows: int, top_k: int,
               activation: GatedActivation = PLAIN) -> LayerPlan | None:
    """The kept LayerPlan of this call shape and activation, or None where the entry points must
    take the call (an empty dimension, a dtype or device they refuse: they name it). weights:
    (w_gate, w_up, w_down), or a model's (gate_up, down) in `layout`."""
    n_tokens, d = x.shape
    n_experts, _, f = weights[0].shape if layout is None else layout.dims(weights[0])
    dtype, device = x.dtype, x.device
    if not (n_tokens and d and f and n_experts and n_rows and dtype in FLOAT_DTYPES and x.stride(1) == 1
            and all(w.dtype == dtype and w.device == device for w in weights)
            and (device.type == "cuda" or interpreted())):
        return None
    key = (n_tokens, d, f, n_experts, top_k, n_rows, x.stride(0), tuple(w.stride() for w in weights), layout,
           activation, dtype, device, os.environ.get("SUITE_PROFILE"))
    plan = _layer_plans.get(key)
    if plan is None:
        if len(_layer_plans) >= config.MAX_KEPT_CONFIGS:
            _layer_plans.clear()
        plan = _layer_plans[key] = LayerPlan(n_tokens, d, f, n_experts, top_k, n_rows, x.stride(0), weights, layout,
                                             dtype, device, activation)
    return plan
