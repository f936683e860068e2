"""MoE SwiGLU experts: ragged grouped GEMMs over the expert-sorted layout, with their launchers.

The layout (made by the routing): R kept rows sorted by expert; expert e owns rows
offsets[e]:offsets[e+1] (int32 [E+1], offsets[0] = 0); token_of_row (int32 [R_max]) gives each
sorted row's token, rows past offsets[E] unused; row_id_map (int32 [T*k]) gives the sorted row
of (token t, slot s) at t*k + s, -1 for a dropped slot; probs fp32 [T, k].

On sm90 cards, in bf16 and at layers as large as the model presets, the row GEMMs (up, down,
dx; d_a where grouped_mm does not take it) read their dense operand tiles through TMA
descriptors (`_tma_gemms`: the same tiles, sums and bits as the pointer kernels), and the
weight gradients and d_a's GEMM go through torch._grouped_mm (torch's CUTLASS grouped GEMMs;
`_vendor_gemms`), on x's rows gathered into the sorted order first (`_gather_rows_kernel`): at
the model presets these took less time than our pointer kernels (the one exception, down at
mixtral on one of two machines; scripts/moe_tune.py, figures in docs/tuning.md). Other cards
and the rtx profile keep the pointer kernels.

Nothing here reads R or a per-expert count on the host: a GEMM over rows launches over an upper
bound of row tiles, cdiv(R_max, BLOCK_M) + E (each expert adds at most one partial tile), and
each program finds its expert and rows from `offsets` on the device (`_expert_tile`); programs
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
from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl

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
from suite.device_profile import active_profile, smem_limit



# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _expert_tile(OFFSETS, n_experts, tile, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row tile `tile` of the ragged layout, each expert's ceil(rows / BLOCK_M) tiles counted in
    expert order -> (expert, first row, end row); expert is n_experts past the last tile."""
    experts = tl.arange(0, BLOCK_E)
    valid = experts < n_experts
    starts = tl.load(OFFSETS + experts, mask=valid, other=0)
    ends = tl.load(OFFSETS + experts + 1, mask=valid, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, axis=0)
    # empty experts end where the one before them does, so they are counted past, never picked
    expert = tl.sum(((tiles_end <= tile) & valid).to(tl.int32), axis=0)
    this = experts == expert
    first_tile = tl.sum(tl.where(this, tiles_end - tiles, 0), axis=0)
    row_start = tl.sum(tl.where(this, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(this, ends, 0), axis=0)
    return expert, row_start, row_end


@triton.jit
def _tile_tokens(TOKEN_OF_ROW, row_start, row_end, BLOCK_M: tl.constexpr):
    """A row tile's rows, which of them are its expert's, and their tokens (int64, for x's
    addresses; token 0 past the expert's rows) -> (rows, row_mask, tokens)."""
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    return rows, row_mask, tl.load(TOKEN_OF_ROW + rows, mask=row_mask, other=0).to(tl.int64)


@triton.jit
def _grouped(pid, n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """Program pid of a 1-D grid walked in groups of GROUP_M row tiles, each group over every
    column tile -> (row tile, column tile): a group's A rows and a column tile's B stay in L2
    together while the group runs."""
    per_group = GROUP_M * n_tiles_n
    first_m = pid // per_group * GROUP_M
    size_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    return first_m + pid % per_group % size_m, pid % per_group // size_m


@triton.jit
def _tile_ids(n_tiles_m, n_tiles_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program. GROUP_M 0: a 2-D grid, row tiles first, so
    each column tile streams every A row again. GROUP_M > 0: a 1-D grid in groups (_grouped).
    The order only: each tile's sum, and so its bits, are the same."""
    if GROUP_M == 0:
        return tl.program_id(0), tl.program_id(1)
    return _grouped(tl.program_id(0), n_tiles_m, n_tiles_n, GROUP_M)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    # UPCAST: the interpreter's bf16 tl.dot is wrong; fp32 operands are exact there
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _up_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U,
    n_experts, d, f, stride_x, sw_e, sw_k, sw_n, su_e, su_k, su_n, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SAVE: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr,
):
    """a = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for one [BLOCK_M, BLOCK_N] tile of
    rows, gate and up in two accumulators over one pass of the gathered x rows; SAVE also
    stores the pre-activations g and u (the backward's inputs). A, G, U: [R_max, f]."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows, row_mask, tokens = _tile_tokens(TOKEN_OF_ROW, row_start, row_end, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < f
        wide_cols = cols.to(tl.int64)  # a transposed weight steps by a row per column
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
        wide_expert = expert.to(tl.int64)
        wg_ptrs = W_GATE + wide_expert * sw_e + ks[:, None].to(tl.int64) * sw_k + wide_cols[None, :] * sw_n
        wu_ptrs = W_UP + wide_expert * su_e + ks[:, None].to(tl.int64) * su_k + wide_cols[None, :] * su_n
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, d, BLOCK_K):
            k_mask = ks < d - k0
            x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & col_mask[None, :]
            acc_g = _dot(x, tl.load(wg_ptrs, mask=w_mask, other=0.0), acc_g, UPCAST)
            acc_u = _dot(x, tl.load(wu_ptrs, mask=w_mask, other=0.0), acc_u, UPCAST)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * sw_k
            wu_ptrs += BLOCK_K * su_k
        _store_up(A, G, U, rows, row_mask, cols, f, acc_g, acc_u, SAVE)


@triton.jit
def _store_up(A, G, U, rows, row_mask, cols, f, acc_g, acc_u, SAVE: tl.constexpr):
    """The up GEMMs' epilogue: a = silu(g) * u in fp32, stored with g and u (SAVE) at the
    tile's rows of the expert and columns below f."""
    a = acc_g * tl.sigmoid(acc_g) * acc_u
    out = rows.to(tl.int64)[:, None] * f + cols[None, :]
    mask = row_mask[:, None] & (cols < f)[None, :]
    tl.store(A + out, a.to(A.dtype.element_ty), mask=mask)
    if SAVE:
        tl.store(G + out, acc_g.to(G.dtype.element_ty), mask=mask)
        tl.store(U + out, acc_u.to(U.dtype.element_ty), mask=mask)


@triton.jit
def _accumulate(A, a_offs, b_ptrs, row_mask, col_mask, n_k, sb_k, acc, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """acc + A[rows, :n_k] @ B[:n_k, cols], BLOCK_K of the reduced dim a step; a_offs: the A
    tile's offsets at k = 0, b_ptrs: the B tile's pointers at k = 0."""
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, n_k, BLOCK_K):
        k_mask = ks < n_k - k0
        a = tl.load(A + a_offs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = _dot(a, b, acc, UPCAST)
        a_offs += BLOCK_K
        b_ptrs += BLOCK_K * sb_k
    return acc


@triton.jit
def _rows_gemm_kernel(
    A, A2, B, B2, OFFSETS, C,
    n_experts, n_k, n_n, sb_e, sb_k, sb_n, sb2_e, sb2_k, sb2_n, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TWO: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[r] = A[r] @ B[e] (+ A2[r] @ B2[e] with TWO: one accumulator over the concatenated K,
    the first pair's K then the second's) for one [BLOCK_M, BLOCK_N] tile of expert e's rows.
    A, A2: [R_max, n_k], C: [R_max, n_n], all contiguous; B[e], B2[e] read through their
    strides (a transposed weight is its strides swapped). The pairs run one after the other,
    not interleaved in one loop: a step then buffers one pair's tiles, not both, so the tile can
    be as wide as a one-pair GEMM's."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        wide_rows = rows.to(tl.int64)
        wide_expert = expert.to(tl.int64)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_n
        wide_cols = cols.to(tl.int64)  # a transposed weight steps by a row per column
        ks = tl.arange(0, BLOCK_K)
        a_offs = wide_rows[:, None] * n_k + ks[None, :]
        b_ptrs = B + wide_expert * sb_e + ks[:, None].to(tl.int64) * sb_k + wide_cols[None, :] * sb_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc = _accumulate(A, a_offs, b_ptrs, row_mask, col_mask, n_k, sb_k, acc, BLOCK_K, UPCAST)
        if TWO:
            b2_ptrs = B2 + wide_expert * sb2_e + ks[:, None].to(tl.int64) * sb2_k + wide_cols[None, :] * sb2_n
            acc = _accumulate(A2, a_offs, b2_ptrs, row_mask, col_mask, n_k, sb2_k, acc, BLOCK_K, UPCAST)
        _store_rows(C, rows, row_end, cols, n_n, acc)


@triton.jit
def _store_rows(C, rows, row_end, cols, n_n, acc):
    """A rows GEMM's epilogue: acc at the tile's rows of the expert (below row_end) and
    columns below n_n of C [R_max, n_n]."""
    mask = (rows < row_end)[:, None] & (cols < n_n)[None, :]
    tl.store(C + rows.to(tl.int64)[:, None] * n_n + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _weight_tile(W, expert, k0, col0, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, W_NK: tl.constexpr):
    """W[expert][k0:k0+BLOCK_K, col0:col0+BLOCK_N] through W's descriptor as a [BLOCK_K,
    BLOCK_N] tile; W_NK: the weight is stored [E, N, K] (as d_a and dx read MoEExperts' weights,
    and up and down read a model's [E, out, in] ones) and its tile comes [BLOCK_N, BLOCK_K]."""
    if W_NK:
        tile = tl.trans(tl.reshape(W.load([expert, col0, k0]), [BLOCK_N, BLOCK_K]))
    else:
        tile = tl.reshape(W.load([expert, k0, col0]), [BLOCK_K, BLOCK_N])
    return tile


@triton.jit
def _up_tma_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U, n_experts, d, f, stride_x, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SAVE: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, W_NK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """`_up_kernel`'s tile, sums and bits, the weights' tiles through TMA descriptors (x's
    rows, gathered by token, still through pointers); W_NK: the weights stored [E, f, d] (a
    model's [E, out, in]); WARP_SPECIALIZE: Triton's warp-specialized loop (loads in a producer
    warp, the MMAs in the others)."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows, row_mask, tokens = _tile_tokens(TOKEN_OF_ROW, row_start, row_end, BLOCK_M)
        col0 = tile_n * BLOCK_N
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, d, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            x = tl.load(x_ptrs, mask=row_mask[:, None] & (ks < d - k0)[None, :], other=0.0)
            acc_g = _dot(x, _weight_tile(W_GATE, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK), acc_g, UPCAST)
            acc_u = _dot(x, _weight_tile(W_UP, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK), acc_u, UPCAST)
            x_ptrs += BLOCK_K
        _store_up(A, G, U, rows, row_mask, col0 + tl.arange(0, BLOCK_N), f, acc_g, acc_u, SAVE)


@triton.jit
def _rows_tma_kernel(
    A, A2, W, W2, OFFSETS, C, n_experts, n_k, n_n, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TWO: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, W_NK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """`_rows_gemm_kernel`'s tile, sums and bits, A, A2, W and W2 through TMA descriptors
    (WARP_SPECIALIZE: Triton's warp-specialized loop, a producer warp feeding the MMA warps). A
    tile's A rows may run past its expert's into the next one's (their products are never
    stored; each output row is its own A row's alone) or past the tensor (read as zeros, as
    K and N past the weight are)."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        col0 = tile_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in tl.range(0, n_k, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
            acc = _dot(A.load([row_start, k0]), _weight_tile(W, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK), acc, UPCAST)
        if TWO:
            for k0 in tl.range(0, n_k, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
                acc = _dot(A2.load([row_start, k0]), _weight_tile(W2, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK), acc,
                           UPCAST)
        _store_rows(C, row_start + tl.arange(0, BLOCK_M), row_end, col0 + tl.arange(0, BLOCK_N), n_n, acc)


@triton.jit
def _swiglu_backward_kernel(D_A, G, U, DG, DU, OFFSETS, n_experts, f, BLOCK: tl.constexpr):
    """dg = d_a * u * silu'(g) and du = d_a * silu(g), element by element over the kept rows
    (the first offsets[E] rows of [R_max, f]); D_A may be DU itself, and DG and DU may be G and
    U (each element is read before the same program writes it)."""
    n = tl.load(OFFSETS + n_experts).to(tl.int64) * f
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    d_a = tl.load(D_A + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    tl.store(DG + offs, (d_a * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (d_a * g * sig).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_kernel(
    X, TOKEN_OF_ROW, GRAD, GRAD2, OFFSETS, DW, DW2, n_i, n_j, stride_x,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr, TWO: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr,
):
    """DW[e] = X_e^T @ GRAD_e (and DW2[e] = X_e^T @ GRAD2_e with TWO, X_e read once for both):
    program (tile, e) owns one [BLOCK_I, BLOCK_J] tile of expert e's [n_i, n_j] gradient and
    loops over e's rows in order, so no two programs add into one value (no atomics) and an
    empty expert gets zeros. X_e: rows of X gathered through TOKEN_OF_ROW with GATHER, else
    the sorted rows themselves; GRAD, GRAD2: [R_max, n_j]."""
    expert = tl.program_id(1)
    tiles_i, tiles_j = tl.cdiv(n_i, BLOCK_I), tl.cdiv(n_j, BLOCK_J)
    if GROUP_M == 0:  # i tiles outer: a run of programs shares one slice of X, streams GRAD
        tile_i, tile_j = tl.program_id(0) // tiles_j, tl.program_id(0) % tiles_j
    else:
        tile_i, tile_j = _grouped(tl.program_id(0), tiles_i, tiles_j, GROUP_M)
    ii = tile_i * BLOCK_I + tl.arange(0, BLOCK_I)
    jj = tile_j * BLOCK_J + tl.arange(0, BLOCK_J)
    i_mask = ii < n_i
    j_mask = jj < n_j
    row_start = tl.load(OFFSETS + expert)
    row_end = tl.load(OFFSETS + expert + 1)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    acc2 = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
    if GATHER:
        next_src = tl.load(TOKEN_OF_ROW + row_start + rs, mask=row_start + rs < row_end, other=0).to(tl.int64)
    for r0 in range(row_start, row_end, BLOCK_R):
        rows = r0 + rs
        row_mask = rows < row_end
        if GATHER:
            # the step's token indices came from the step before: the x load then waits on no
            # load of its own step, so the pipeliner buffers it every stage ahead, not two
            src = next_src
            ahead = rows + BLOCK_R
            next_src = tl.load(TOKEN_OF_ROW + ahead, mask=ahead < row_end, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        xt = tl.load(X + src[None, :] * stride_x + ii[:, None], mask=i_mask[:, None] & row_mask[None, :], other=0.0)
        grad_offs = rows.to(tl.int64)[:, None] * n_j + jj[None, :]
        grad_mask = row_mask[:, None] & j_mask[None, :]
        acc = _dot(xt, tl.load(GRAD + grad_offs, mask=grad_mask, other=0.0), acc, UPCAST)
        if TWO:
            acc2 = _dot(xt, tl.load(GRAD2 + grad_offs, mask=grad_mask, other=0.0), acc2, UPCAST)
    out = expert.to(tl.int64) * n_i * n_j + ii.to(tl.int64)[:, None] * n_j + jj[None, :]
    mask = i_mask[:, None] & j_mask[None, :]
    tl.store(DW + out, acc.to(DW.dtype.element_ty), mask=mask)
    if TWO:
        tl.store(DW2 + out, acc2.to(DW2.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    ROWS, ROW_ID_MAP, PROBS, OUT, n_tokens, d,
    TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """OUT[t] = sum over slots s = 0..TOP_K-1, in that order, of probs[t, s] * ROWS[row] (or of
    ROWS[row] without WEIGHTED), row = row_id_map[t * TOP_K + s], dropped slots (-1) skipped."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    slot0 = tokens.to(tl.int64) * TOP_K
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < d
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for s in tl.static_range(TOP_K):
        row = tl.load(ROW_ID_MAP + slot0 + s, mask=token_mask, other=-1)
        kept = row >= 0
        y = tl.load(ROWS + row.to(tl.int64)[:, None] * d + cols[None, :], mask=kept[:, None] & col_mask[None, :],
                    other=0.0).to(tl.float32)
        if WEIGHTED:
            y *= tl.load(PROBS + slot0 + s, mask=kept, other=0.0)[:, None]
        acc += y
    out = tokens.to(tl.int64)[:, None] * d + cols[None, :]
    tl.store(OUT + out, acc.to(OUT.dtype.element_ty), mask=token_mask[:, None] & col_mask[None, :])


@triton.jit
def _combine_bwd_kernel(
    GRAD_OUT, Y_ROWS, ROW_ID_MAP, PROBS, GRAD_ROWS, GRAD_PROBS, n_tokens, d,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """The combine's backward in one pass over grad_out: for each kept slot (t, s) at sorted
    row r, grad_rows[r] = grad_out[t] * probs[t, s] and grad_probs[t, s] = <grad_out[t], y_rows[r]>
    (fp32). A program owns whole tokens, so each dot is its own sum over the column chunks, in
    order; dropped slots get grad_probs 0 and write no row."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    wide_tokens = tokens.to(tl.int64)
    slots = tl.arange(0, BLOCK_S)
    slot_offs = wide_tokens[:, None] * TOP_K + slots[None, :]
    slot_mask = token_mask[:, None] & (slots < TOP_K)[None, :]
    # each slot's row and probability, loaded once: the loop below only streams the rows
    rows = tl.load(ROW_ID_MAP + slot_offs, mask=slot_mask, other=-1)
    probs = tl.load(PROBS + slot_offs, mask=rows >= 0, other=0.0)
    dots = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
    for d0 in range(0, d, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < d
        grad = tl.load(GRAD_OUT + wide_tokens[:, None] * d + cols[None, :], mask=token_mask[:, None] & col_mask[None, :],
                       other=0.0).to(tl.float32)
        # every slot's load before any store: the compiler keeps a load after a store it cannot
        # prove does not alias it, which would serialise the slots' memory round trips
        for s in tl.static_range(TOP_K):
            this = slots[None, :] == s
            row = tl.sum(tl.where(this, rows, 0), axis=1)
            offs = row.to(tl.int64)[:, None] * d + cols[None, :]
            y = tl.load(Y_ROWS + offs, mask=(row >= 0)[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            dots += tl.where(this, tl.sum(grad * y, axis=1)[:, None], 0.0)
        for s in tl.static_range(TOP_K):
            this = slots[None, :] == s
            row = tl.sum(tl.where(this, rows, 0), axis=1)
            p = tl.sum(tl.where(this, probs, 0.0), axis=1)
            offs = row.to(tl.int64)[:, None] * d + cols[None, :]
            tl.store(GRAD_ROWS + offs, (grad * p[:, None]).to(GRAD_ROWS.dtype.element_ty),
                     mask=(row >= 0)[:, None] & col_mask[None, :])
    tl.store(GRAD_PROBS + slot_offs, dots, mask=slot_mask)


@triton.jit
def _gather_rows_kernel(X, TOKEN_OF_ROW, OFFSETS, OUT, n_experts, d, stride_x,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[r] = X[token_of_row[r]] for the kept rows r < offsets[E]; the rows past them are
    left unwritten (token_of_row holds no token there)."""
    n_rows = tl.load(OFFSETS + n_experts)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_rows
    tokens = tl.load(TOKEN_OF_ROW + rows, mask=row_mask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (cols < d)[None, :]
    x = tl.load(X + tokens[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(OUT + rows.to(tl.int64)[:, None] * d + cols[None, :], x, mask=mask)


# --------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tiles: block_m rows (for a weight gradient, rows of the weight),
    block_n output columns, block_k of the reduced dim (for a weight gradient, token rows) per
    step; num_stages steps buffered in shared memory."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    n_a: int  # operand tiles of [block_m, block_k] per step
    n_b: int  # operand tiles of [block_k, block_n] per step
    itemsize: int
    group_m: int = 0  # tile order: 0 the 2-D grid, > 0 groups of that many row tiles (_tile_ids)

    @property
    def smem_bytes(self) -> int:
        """Shared memory the pipelined operand buffers take, counting all num_stages buffers,
        plus the compiler's own scratch (barriers, layout conversions; the epilogue reuses the
        operand buffers once the loop is done)."""
        per_stage = (self.n_a * self.block_m * self.block_k + self.n_b * self.block_k * self.block_n) * self.itemsize
        return self.num_stages * per_stage + _SMEM_SCRATCH


# One tile per GEMM kind (no autotuning): the fastest, or within 4% of it, at every model
# preset in `scripts/moe_tune.py --sweep` on the H200 (figures: docs/tuning.md). block_n is per
# B tile (kinds with two B tiles hold block_m x 2*block_n accumulators); group_m walks the row
# tiles in groups so a group's A rows stay in L2 across the column tiles (_tile_ids).
#   kind            (n_a, n_b)  block_m, block_n, block_k, stages, warps, group_m
GEMM_KINDS = {
    "up": ((1, 2), (128, 128, 64, 4, 8, 16)),
    "rows": ((1, 1), (128, 256, 64, 4, 8, 16)),  # expert_down: y = a @ w_down
    "swiglu_grad": ((1, 1), (128, 256, 64, 4, 8, 8)),  # d_a = grad_rows @ w_down^T
    "dx": ((1, 1), (128, 256, 64, 4, 8, 16)),  # dg @ w_gate^T then du @ w_up^T, one accumulator
    "weight_grad": ((1, 1), (128, 128, 64, 3, 8, 0)),  # dW_down
    "weight_grad_two": ((1, 2), (128, 128, 64, 3, 8, 0)),  # dW_gate and dW_up
}
# From this many elements per expert (mixtral's 4096 x 14336) the gate/up weight gradient outgrows
# the L2: taller tiles in groups then pay, 256x(2x64) grouped by 16 (scripts/moe_tune.py --sweep;
# figures: docs/tuning.md).
_BIG_WEIGHT = 1 << 24
# Average rows per expert below which a 128-row tile is mostly masked (decode-like batches):
# 64-row tiles at 4 warps there (not measured: no bench preset has under 512 rows an expert).
_MANY_ROWS = 128
# Measured on the H200 (triton 3.6): the dx kernel at 64x128x64 (then with both operand pairs
# buffered a step), 2 stages of bf16, took 102400 bytes against 98304 for its operand buffers;
# twice that margin is kept.
_SMEM_SCRATCH = 8192


# Chosen tiles, kept per call shape: choosing one costs about half an entry point's host time
# (launches stubbed: `python scripts/moe_host_probe.py --calls 1000` on a CPU).
_MAX_KEPT_CONFIGS = 256
_gemm_configs: dict[tuple, GemmConfig] = {}


def _gemm_config(kind: str, rows: int, n: int, dtype: torch.dtype, device, weight_elems: int = 0) -> GemmConfig:
    """The tile of GEMM `kind` (GEMM_KINDS) for `rows` average rows per expert (for a weight
    gradient, the weight's rows) and n output columns, held to the device profile's shared
    memory; weight_elems: a weight gradient's elements per expert."""
    # the key holds everything the choice reads, SUITE_PROFILE (smem_limit's) too
    key = (kind, rows, n, dtype, device, weight_elems, os.environ.get("SUITE_PROFILE"), interpreted())
    config = _gemm_configs.get(key)
    if config is None:
        if len(_gemm_configs) >= _MAX_KEPT_CONFIGS:
            _gemm_configs.clear()
        config = _gemm_configs[key] = _choose_gemm_config(kind, rows, n, dtype, device, weight_elems)
    return config


def _choose_gemm_config(kind: str, rows: int, n: int, dtype: torch.dtype, device, weight_elems: int) -> GemmConfig:
    (n_a, n_b), (block_m, block_n, block_k, stages, num_warps, group_m) = GEMM_KINDS[kind]
    itemsize = dtype.itemsize
    if interpreted() and device.type != "cuda":
        # tiny test shapes still take several tiles, steps, groups and masked edges
        return GemmConfig(16, 16, 16, 4, 1, n_a, n_b, itemsize, 2 if group_m else 0)
    if rows < _MANY_ROWS:
        block_m, block_n, num_warps = 64, min(block_n, 128), 4
    if kind == "weight_grad_two" and weight_elems >= _BIG_WEIGHT:
        block_m, block_n, group_m = 256, 64, 16
    block_n = max(16, min(block_n, next_pow2(n)))
    if itemsize == 4:
        block_k //= 2  # fp32 (the parity path): the same bytes a step
    limit = smem_limit(device)
    # where the whole tile cannot double-buffer (the RTX card's 99 KB), narrow the reduced step,
    # then the columns, before giving up the pipelining
    shrinks = [(block_n, block_k), (block_n, block_k // 2), (block_n // 2, block_k // 2)]
    for min_stages in (2, 1):
        for n_cols, k_step in shrinks:
            for n_stages in range(stages, min_stages - 1, -1):
                config = GemmConfig(block_m, max(16, n_cols), max(16, k_step), num_warps, n_stages, n_a, n_b, itemsize,
                                    group_m)
                if config.smem_bytes <= limit:
                    return config
    raise AssertionError(f"no tile fits {limit} bytes of shared memory: {config}")


# torch._grouped_mm's weight gradients and d_a beat our pointer kernels on the H200 at olmoe,
# qwen3-30b-a3b, mixtral and top2-small (moe_tune's grouped_mm entries; figures in
# docs/tuning.md): the fewest rows an expert and least f there qwen3-30b-a3b's, which also has
# the least work an expert (rows x d x f), the least d top2-small's. A layer below any of these,
# where each op's host time counts more, keeps our kernels until measured.
_VENDOR_MIN_ROWS = 512  # average rows per expert
_VENDOR_MIN_D = 1024
_VENDOR_MIN_F = 768
_VENDOR_MIN_WORK = 512 * 2048 * 768


def _measured_on_sm90(n_rows: int, n_experts: int, d: int, f: int, dtype: torch.dtype, device) -> bool:
    """A bf16 layer on an sm90 card, outside the rtx profile, with 16-byte rows (d and f
    multiples of 8), no smaller than the smallest model preset measured there."""
    if device.type != "cuda" or interpreted() or dtype != torch.bfloat16 or d % 8 or f % 8:
        return False
    if active_profile(device) == "rtx" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return (n_rows >= _VENDOR_MIN_ROWS * n_experts and d >= _VENDOR_MIN_D and f >= _VENDOR_MIN_F
            and n_rows * d * f >= _VENDOR_MIN_WORK * n_experts)


def _vendor_gemms(n_rows: int, n_experts: int, d: int, f: int, dtype: torch.dtype, device) -> bool:
    """Whether a layer of this shape takes torch._grouped_mm for its weight gradients and d_a:
    only on sm90 (`_measured_on_sm90`), where torch runs its CUTLASS grouped GEMMs (on sm120
    and older cards it copies the offsets to the host, a sync, and loops over the experts; on
    sm100 an expert with no rows has been reported to get a nonzero weight gradient,
    pytorch/pytorch#172439)."""
    return _measured_on_sm90(n_rows, n_experts, d, f, dtype, device)


def _tma_gemms(n_rows: int, n_experts: int, d: int, f: int, dtype: torch.dtype, device) -> bool:
    """Whether a layer of this shape feeds its row GEMMs (up, down, d_a, dx) through TMA
    descriptors (`_up_tma_kernel`, `_rows_tma_kernel`): with the same bits, the layer's GEMMs
    took less time together than on the pointer kernels at every layer measured on the H200,
    though a few lost alone (down at mixtral on one of two machines and on a model's [E, out,
    in] weights, dx there too; d_a at mixtral and top2-small, where it runs on grouped_mm,
    `_vendor_gemms`); scripts/moe_tune.py, docs/tuning.md. Not measured on sm100 or the RTX
    card (sm120, whose tiles the rtx profile holds), nor at smaller layers, where a descriptor
    launch's host time weighs more: those keep the pointer kernels (`_measured_on_sm90`)."""
    return _measured_on_sm90(n_rows, n_experts, d, f, dtype, device)


def _grouped_mm_ready(*operands: torch.Tensor) -> bool:
    """Whether torch._grouped_mm's CUTLASS path takes each operand (it raises on the rest): a
    unit stride in one of the last two dims, the other of them at least the unit dim's size (no
    overlapping rows), and 16-byte aligned pointers and strides."""
    for t in operands:
        step = 16 // t.element_size()
        if t.stride(-1) == 1:
            lead, extent = t.stride(-2), t.shape[-1]
        elif t.stride(-2) == 1:
            lead, extent = t.stride(-1), t.shape[-2]
        else:
            return False
        if t.data_ptr() % 16 or lead < max(1, extent) or any(s % step for s in t.stride() if s != 1):
            return False
    return True


# The SwiGLU backward's elementwise pass: elements a program (bf16: 16 a thread at 4 warps).
SWIGLU_BLOCK = 2048


@dataclass(frozen=True)
class CombineConfig:
    """A combine's tiles: block_t tokens x block_d columns a program, num_warps warps."""

    block_t: int
    block_d: int
    num_warps: int


# The combines stream rows, 8 tokens x 128 columns a program at 8 warps: enough programs to keep
# the memory busy (the combine backward's best tile in scripts/moe_tune.py --sweep; figures:
# docs/tuning.md). The forward combine and dx's gather take the same tiles, unswept.
COMBINE = CombineConfig(8, 128, 8)


def _combine_config(n_tokens: int, d: int, device) -> CombineConfig:
    if interpreted() and device.type != "cuda":
        return CombineConfig(8, 16, 4)  # several programs and masked edges at test sizes
    return CombineConfig(COMBINE.block_t, min(COMBINE.block_d, max(16, next_pow2(d))), COMBINE.num_warps)


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


def _up_launch(n_rows, n_experts, d, f, x_stride, wg_strides, wu_strides, dtype, device, save=True,
               tma=True, warp_specialize=False) -> PlannedLaunch | DescriptorLaunch:
    """Called with (x, w_gate, w_up, token_of_row, offsets, a, g, u); the weights through
    descriptors where `_tma_gemms` takes the layer (unless tma is False) and their strides allow,
    each stored either [E, d, f] or [E, f, d] (then passed as its transposed view), both alike."""
    cfg = _gemm_config("up", n_rows // n_experts, f, dtype, device)
    tiles = (cdiv(n_rows, cfg.block_m) + n_experts, cdiv(f, cfg.block_n))
    grid = _row_tile_grid(tiles, cfg)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
                SAVE=save, UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    pointers = PlannedLaunch(_up_kernel, grid, (n_experts, d, f, x_stride, *wg_strides, *wu_strides, *tiles),
                             (dtype, dtype, dtype, torch.int32, torch.int32, dtype, dtype, dtype), **meta)
    w_nk = wg_strides[2] != 1  # stored [E, f, d]: d the unit-stride dim, if any
    stored = [(e, n, k) if w_nk else (e, k, n) for e, k, n in (wg_strides, wu_strides)]
    if not (tma and _tma_gemms(n_rows, n_experts, d, f, dtype, device) and w_nk == (wu_strides[2] != 1)
            and all(descriptor_strides(s, dtype.itemsize) for s in stored)):
        return pointers
    w_block = [1, cfg.block_n, cfg.block_k] if w_nk else [1, cfg.block_k, cfg.block_n]
    return DescriptorLaunch(_up_tma_kernel, grid, (n_experts, d, f, x_stride, *tiles),
                            (None, w_block, w_block, None, None, None, None, None), pointers, **meta, W_NK=w_nk,
                            WARP_SPECIALIZE=warp_specialize)


def _rows_launch(kind, n_rows, n_k, n_n, n_experts, w_strides, w2_strides, two, dtype, device,
                 tma=True, warp_specialize=False) -> PlannedLaunch | DescriptorLaunch:
    """c[r] = a[r] @ W[e] (+ a2[r] @ W2[e] when two) over the ragged rows, W[e] read as [K, N]
    through w_strides (e, k, n), at GEMM kind `kind`'s tile; called with (a, a2, w, w2, offsets, c).
    a, a2 and the weights through descriptors where `_tma_gemms` takes the layer (unless tma is
    False) and the strides allow: a weight then stored either [E, K, N] or [E, N, K], whether
    passed as stored or as a transposed view (a model's [E, out, in] storage). warp_specialize:
    the TMA kernel's loop warp-specialized (an experiment, scripts/moe_tune.py: Triton 3.6's
    Hopper pass fails on a 4-warp tile, and at the model presets' tile it gained at mixtral
    alone)."""
    cfg = _gemm_config(kind, n_rows // n_experts, n_n, dtype, device)
    tiles = (cdiv(n_rows, cfg.block_m) + n_experts, cdiv(n_n, cfg.block_n))
    grid = _row_tile_grid(tiles, cfg)
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
                TWO=two, UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    pointers = PlannedLaunch(_rows_gemm_kernel, grid, (n_experts, n_k, n_n, *w_strides, *w2_strides, *tiles),
                             (dtype, dtype, dtype, dtype, torch.int32, dtype), **meta)
    d, f = (n_k, n_n) if kind == "swiglu_grad" else (n_n, n_k)  # d_a's K is d; down's and dx's N
    w_nk = w_strides[2] != 1  # stored [E, N, K]: its K dim the unit-stride one, if any
    stored = [(e, n, k) if w_nk else (e, k, n) for e, k, n in (w_strides, w2_strides)]
    if not (tma and _tma_gemms(n_rows, n_experts, d, f, dtype, device) and w_nk == (w2_strides[2] != 1)
            and descriptor_strides((n_k, 1), dtype.itemsize)
            and all(descriptor_strides(s, dtype.itemsize) for s in stored)):
        return pointers
    a_block = [cfg.block_m, cfg.block_k]
    w_block = [1, cfg.block_n, cfg.block_k] if w_nk else [1, cfg.block_k, cfg.block_n]
    second = (a_block, w_block) if two else (None, None)  # one pair: the second never read
    return DescriptorLaunch(_rows_tma_kernel, grid, (n_experts, n_k, n_n, *tiles),
                            (a_block, second[0], w_block, second[1], None, None), pointers, **meta, W_NK=w_nk,
                            WARP_SPECIALIZE=warp_specialize)


def _swiglu_launch(n_rows, f, n_experts, dtype, device) -> PlannedLaunch:
    """dg, du from d_a and the pre-activations; called with (d_a, gate, up, dg, du, offsets)."""
    block = 64 if interpreted() and device.type != "cuda" else SWIGLU_BLOCK
    return PlannedLaunch(_swiglu_backward_kernel, (cdiv(n_rows * f, block),), (n_experts, f),
                         (dtype,) * 5 + (torch.int32,), BLOCK=block, num_warps=4)


def _weight_grad_launch(n_experts, n_i, n_j, x_stride, gather, two, dtype, device) -> PlannedLaunch:
    """dw[e] = x_e^T @ grad_e (and dw2[e] = x_e^T @ grad2_e when two), x_e gathered through
    token_of_row when gather; called with (x, token_of_row or grad, grad, grad2, offsets, dw, dw2)."""
    # the weight's rows take the place of the token rows: 128-row tiles once it has 128
    cfg = _gemm_config("weight_grad_two" if two else "weight_grad", n_i, n_j, dtype, device, n_i * n_j)
    return PlannedLaunch(
        _weight_grad_kernel, (cdiv(n_i, cfg.block_m) * cdiv(n_j, cfg.block_n), n_experts), (n_i, n_j, x_stride),
        (dtype, torch.int32 if gather else dtype, dtype, dtype, torch.int32, dtype, dtype),
        BLOCK_I=cfg.block_m, BLOCK_J=cfg.block_n, BLOCK_R=cfg.block_k, GATHER=gather, TWO=two,
        UPCAST=_upcast(dtype), GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def _combine_launch(n_tokens, d, top_k, weighted, dtype, device) -> PlannedLaunch:
    """Called with (rows, row_id_map, probs or rows, out)."""
    cfg = _combine_config(n_tokens, d, device)
    return PlannedLaunch(
        _combine_kernel, (cdiv(n_tokens, cfg.block_t), cdiv(d, cfg.block_d)), (n_tokens, d),
        (dtype, torch.int32, torch.float32 if weighted else dtype, dtype),
        TOP_K=top_k, WEIGHTED=weighted, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )


def _gather_launch(n_rows, d, x_stride, n_experts, dtype, device) -> PlannedLaunch:
    """x's rows in the sorted order; called with (x, token_of_row, offsets, out). A row stream,
    at the combines' tiles."""
    cfg = _combine_config(n_rows, d, device)
    return PlannedLaunch(
        _gather_rows_kernel, (cdiv(n_rows, cfg.block_t), cdiv(d, cfg.block_d)), (n_experts, d, x_stride),
        (dtype, torch.int32, torch.int32, dtype), BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps,
    )


def _combine_bwd_launch(n_tokens, d, top_k, dtype, device) -> PlannedLaunch:
    """Called with (grad_out, y_rows, row_id_map, probs, grad_rows, grad_probs)."""
    cfg = _combine_config(n_tokens, d, device)
    return PlannedLaunch(
        _combine_bwd_kernel, (cdiv(n_tokens, cfg.block_t),), (n_tokens, d),
        (dtype, dtype, torch.int32, torch.float32, dtype, torch.float32),
        TOP_K=top_k, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, BLOCK_S=next_pow2(top_k), num_warps=cfg.num_warps,
    )


def expert_up(x, w_gate, w_up, token_of_row, offsets, *, out=None, gate_out=None, up_out=None,
              save_preactivations: bool = True):
    """a[r] = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for every sorted row r of expert e
    (tok = token_of_row[r]); x [T, d], w_gate and w_up [E, d, f]. -> (a, g, u), each [R_max, f]
    in x's dtype, g and u the pre-activations (None without save_preactivations). Rows past
    offsets[E] are left unwritten. out / gate_out / up_out: caller-owned buffers, reused."""
    fn = "expert_up"
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
        _up_launch(n_rows, n_experts, d, f, x.stride(0), w_gate.stride(), w_up.stride(), x.dtype, x.device,
                   save_preactivations)(x, w_gate, w_up, token_of_row, offsets, a, a if g is None else g,
                                        a if u is None else u)
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
    _grouped_rows("rows", a, w_down, w_down.stride(), offsets, y)
    return y


def _row_tile_grid(tiles: tuple[int, int], cfg: GemmConfig) -> tuple[int, ...]:
    """The launch grid over (row tiles, column tiles): 2-D, or 1-D when the tiles go in groups."""
    return tiles if cfg.group_m == 0 else (tiles[0] * tiles[1],)


def _grouped_rows(kind, a, w, w_strides, offsets, c, a2=None, w2=None, w2_strides=None):
    """c[r] = a[r] @ W[e] (+ a2[r] @ W2[e]) over the ragged rows (see _rows_launch)."""
    n_rows, n_k = a.shape
    n_n = c.shape[1]
    n_experts = offsets.shape[0] - 1
    if n_rows and n_experts and n_n:
        _rows_launch(kind, n_rows, n_k, n_n, n_experts, w_strides, w2_strides or w_strides, a2 is not None, a.dtype,
                     a.device)(a, a if a2 is None else a2, w, w if w2 is None else w2, offsets, c)


def _swiglu_backward(d_a, gate, up, offsets, dg, du):
    """dg, du from d_a and the pre-activations, over the kept rows; d_a may be du (in place)."""
    if d_a.numel():
        _swiglu_launch(d_a.shape[0], d_a.shape[1], offsets.shape[0] - 1, d_a.dtype, d_a.device)(
            d_a, gate, up, dg, du, offsets)


def _weight_grad(x, token_of_row, grad, offsets, dw, grad2=None, dw2=None):
    """dw[e] = x_e^T @ grad_e (and dw2[e] = x_e^T @ grad2_e); x_e gathered through token_of_row
    when given."""
    n_experts, n_i, n_j = dw.shape
    if n_experts and n_i and n_j:
        _weight_grad_launch(n_experts, n_i, n_j, x.stride(0), token_of_row is not None, grad2 is not None,
                            grad.dtype, grad.device)(
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


def expert_down_backward(grad_rows, a, gate, up, w_down, offsets, *, dg_out=None, du_out=None, dw_down_out=None):
    """Backward of expert_down and of the SwiGLU: d_a = grad_rows @ w_down[e]^T (written in
    du's buffer, in a's dtype as eager autograd keeps it), then one elementwise pass gives
    dg = d_a * u * silu'(g) and du = d_a * silu(g) in fp32 (gate, up: the forward's
    pre-activations); dW_down[e] = a_e^T @ grad_rows_e. -> (dg, du [R_max, f] in a's dtype,
    dw_down [E, f, d] in w_down's dtype; an empty expert's is zero). dg_out / du_out /
    dw_down_out: caller-owned, reused."""
    fn = "expert_down_backward"
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
    if (dw_down_out is None and n_rows and _vendor_gemms(n_rows, n_experts, d, f, a.dtype, a.device)
            and _grouped_mm_ready(grad_rows, a.t(), w_down_t)):
        ends = offsets[1:]  # torch._grouped_mm's groups end there; rows past offsets[E] are not read
        _swiglu_backward(torch._grouped_mm(grad_rows, w_down_t, offs=ends), gate, up, offsets, dg, du)
        return dg, du, torch._grouped_mm(a.t(), grad_rows, offs=ends)
    dw_down = _buffer(dw_down_out, fn, "dw_down_out", (n_experts, f, d), w_down.dtype, a.device)
    s_e, s_f, s_d = w_down.stride()
    _grouped_rows("swiglu_grad", grad_rows, w_down, (s_e, s_d, s_f), offsets, du)  # d_a, in du's buffer
    _swiglu_backward(du, gate, up, offsets, dg, du)
    _weight_grad(a, None, grad_rows, offsets, dw_down)
    return dg, du, dw_down


def expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets, *, dx_rows_out=None, dw_gate_out=None,
                       dw_up_out=None):
    """Backward of expert_up's two GEMMs: dx_rows = dg @ w_gate[e]^T + du @ w_up[e]^T in one
    accumulator; dW_gate[e] = x_e^T @ dg_e and dW_up[e] = x_e^T @ du_e in one kernel (x_e: the expert's
    token rows, gathered through token_of_row). -> (dx_rows [R_max, d] in x's dtype,
    dw_gate and dw_up [E, d, f] in the weights' dtype). dx = combine(dx_rows, row_id_map,
    top_k=k). dx_rows_out / dw_gate_out / dw_up_out: caller-owned, reused; without the last two
    a layer that `_vendor_gemms` takes gets its weight gradients from torch._grouped_mm."""
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
    _grouped_rows("dx", dg, w_gate, (g_e, g_f, g_d), offsets, dx_rows, a2=du, w2=w_up, w2_strides=(u_e, u_f, u_d))
    if (dw_gate_out is None and dw_up_out is None and n_rows
            and _vendor_gemms(n_rows, n_experts, d, f, x.dtype, x.device) and _grouped_mm_ready(dg, du)):
        x_rows = torch.empty((n_rows, d), dtype=x.dtype, device=x.device)
        _gather_launch(n_rows, d, x.stride(0), n_experts, x.dtype, x.device)(x, token_of_row, offsets, x_rows)
        return (dx_rows, *_vendor_dw_gate_up(x_rows, dg, du, offsets))
    dw_gate = _buffer(dw_gate_out, fn, "dw_gate_out", (n_experts, d, f), w_gate.dtype, x.device)
    dw_up = _buffer(dw_up_out, fn, "dw_up_out", (n_experts, d, f), w_up.dtype, x.device)
    _weight_grad(x, token_of_row, dg, offsets, dw_gate, grad2=du, dw2=dw_up)
    return dx_rows, dw_gate, dw_up


def _vendor_dw_gate_up(x_rows, dg, du, offsets):
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
    checked its arguments; `layer_plan` makes and keeps the plans."""

    def __init__(self, n_tokens, d, f, n_experts, top_k, n_rows, x_stride, wg_strides, wu_strides, wd_strides,
                 dtype, device):
        self.n_tokens, self.d, self.f, self.n_experts, self.top_k, self.n_rows = n_tokens, d, f, n_experts, top_k, n_rows
        self.dtype, self.device = dtype, device
        g_e, g_d, g_f = wg_strides
        u_e, u_d, u_f = wu_strides
        s_e, s_f, s_d = wd_strides
        self.up = _up_launch(n_rows, n_experts, d, f, x_stride, wg_strides, wu_strides, dtype, device)
        self.down = _rows_launch("rows", n_rows, f, d, n_experts, wd_strides, wd_strides, False, dtype, device)
        self.combine = _combine_launch(n_tokens, d, top_k, True, dtype, device)
        self.combine_bwd = _combine_bwd_launch(n_tokens, d, top_k, dtype, device)
        self.d_a = _rows_launch("swiglu_grad", n_rows, d, f, n_experts, (s_e, s_d, s_f), (s_e, s_d, s_f), False, dtype,
                                device)
        self.swiglu = _swiglu_launch(n_rows, f, n_experts, dtype, device)
        self.dw_down = _weight_grad_launch(n_experts, f, d, f, False, False, dtype, device)
        self.dx = _rows_launch("dx", n_rows, f, d, n_experts, (g_e, g_f, g_d), (u_e, u_f, u_d), True, dtype, device)
        self.dw_gate_up = _weight_grad_launch(n_experts, d, f, x_stride, True, True, dtype, device)
        self.combine_dx = _combine_launch(n_tokens, d, top_k, False, dtype, device)
        self.vendor = _vendor_gemms(n_rows, n_experts, d, f, dtype, device)
        if self.vendor:
            self.gather = _gather_launch(n_rows, d, x_stride, n_experts, dtype, device)

    def _empty(self, *shape, dtype=None):
        return torch.empty(shape, dtype=dtype or self.dtype, device=self.device)

    def forward(self, x, probs, w_gate, w_up, w_down, token_of_row, offsets, row_id_map, one_buffer=False):
        """expert_up, expert_down and combine: -> (out, a, g, u, y_rows). one_buffer: a, g and u
        as views of one allocation (not for a custom op, whose outputs must not share memory)."""
        rows, f = self.n_rows, self.f
        if one_buffer:  # each slab starts 16-byte aligned, as the kept launches need
            n = rows * f
            slab = -(-n * self.dtype.itemsize // 16) * 16 // self.dtype.itemsize
            flat = torch.empty(3 * slab, dtype=self.dtype, device=self.device)
            a, g, u = flat.as_strided((3, rows, f), (slab, f, 1)).unbind(0)  # two calls, not six
        else:
            a, g, u = self._empty(rows, f), self._empty(rows, f), self._empty(rows, f)
        y_rows, out = self._empty(rows, self.d), self._empty(self.n_tokens, self.d)
        self.up(x, w_gate, w_up, token_of_row, offsets, a, g, u)
        self.down(a, a, w_down, w_down, offsets, y_rows)
        self.combine(y_rows, row_id_map, probs, out)
        return out, a, g, u, y_rows

    def backward(self, grad_out, x, probs, w_gate, w_up, w_down, a, g, u, y_rows, token_of_row, offsets, row_id_map,
                 reuse_saved=False):
        """combine_backward, expert_down_backward, expert_up_backward and the combine of dx:
        -> (dx, grad_probs, dw_gate, dw_up, dw_down). reuse_saved: the forward's a, g, u and
        y_rows are dead after this backward (autograd keeps no graph), so its temporaries go
        into them, each once the launches that read it are done: three allocations fewer."""
        rows, d, f, n_experts = self.n_rows, self.d, self.f, self.n_experts
        grad_rows, grad_probs = self._empty(rows, d), self._empty(self.n_tokens, self.top_k, dtype=torch.float32)
        self.combine_bwd(grad_out, y_rows, row_id_map, probs, grad_rows, grad_probs)
        w_down_t = w_down.transpose(1, 2)
        if self.vendor and _grouped_mm_ready(a.t(), w_down_t, g, u):  # a weight view may be misaligned
            return self._vendor_backward(grad_rows, grad_probs, x, w_gate, w_up, w_down_t, a, g, u, y_rows,
                                         token_of_row, offsets, row_id_map, reuse_saved)
        dw_down = self._empty(n_experts, f, d)
        self.dw_down(a, grad_rows, grad_rows, grad_rows, offsets, dw_down, dw_down)
        if reuse_saved:  # a read: d_a there; dg and du over g and u (swiglu reads each first)
            d_a, dg, du, dx_rows = a, g, u, y_rows
        else:
            dg, du, dx_rows = self._empty(rows, f), self._empty(rows, f), self._empty(rows, d)
            d_a = du
        self.d_a(grad_rows, grad_rows, w_down, w_down, offsets, d_a)
        self.swiglu(d_a, g, u, dg, du, offsets)
        dw_gate, dw_up = self._empty(n_experts, d, f), self._empty(n_experts, d, f)
        self.dx(dg, du, w_gate, w_up, offsets, dx_rows)
        self.dw_gate_up(x, token_of_row, dg, du, offsets, dw_gate, dw_up)
        dx = self._empty(self.n_tokens, d)
        # each token's k slots summed in slot order, so dx repeats its bits run to run
        self.combine_dx(dx_rows, row_id_map, dx_rows, dx)
        return dx, grad_probs, dw_gate, dw_up, dw_down

    def _vendor_backward(self, grad_rows, grad_probs, x, w_gate, w_up, w_down_t, a, g, u, y_rows, token_of_row,
                         offsets, row_id_map, reuse_saved):
        """backward's rest with torch._grouped_mm for d_a and the weight gradients (`_vendor_gemms`),
        the same sums as expert_down_backward and expert_up_backward take there."""
        ends = offsets[1:]
        dw_down = torch._grouped_mm(a.t(), grad_rows, offs=ends)
        d_a = torch._grouped_mm(grad_rows, w_down_t, offs=ends)
        if reuse_saved:  # dg and du over g and u (swiglu reads each first); x's rows in y_rows
            dg, du, x_rows = g, u, y_rows
        else:
            dg, du, x_rows = self._empty(self.n_rows, self.f), self._empty(self.n_rows, self.f), self._empty(
                self.n_rows, self.d)
        self.swiglu(d_a, g, u, dg, du, offsets)
        self.gather(x, token_of_row, offsets, x_rows)
        dw_gate, dw_up = _vendor_dw_gate_up(x_rows, dg, du, offsets)
        dx_rows = x_rows  # x's rows are read by now
        self.dx(dg, du, w_gate, w_up, offsets, dx_rows)
        dx = self._empty(self.n_tokens, self.d)
        self.combine_dx(dx_rows, row_id_map, dx_rows, dx)
        return dx, grad_probs, dw_gate, dw_up, dw_down


_layer_plans: dict[tuple, LayerPlan] = {}


def layer_plan(x, w_gate, w_up, w_down, n_rows: int, top_k: int) -> LayerPlan | None:
    """The kept LayerPlan of this call shape, or None where the entry points must take the call
    (an empty dimension, a dtype or device they refuse: they name it)."""
    n_tokens, d = x.shape
    n_experts, _, f = w_gate.shape
    dtype, device = x.dtype, x.device
    if not (n_tokens and d and f and n_experts and n_rows and dtype in FLOAT_DTYPES and x.stride(1) == 1
            and w_gate.dtype == dtype and w_up.dtype == dtype and w_down.dtype == dtype
            and w_gate.device == device and w_up.device == device and w_down.device == device
            and (device.type == "cuda" or interpreted())):
        return None
    key = (n_tokens, d, f, n_experts, top_k, n_rows, x.stride(0), w_gate.stride(), w_up.stride(), w_down.stride(),
           dtype, device, os.environ.get("SUITE_PROFILE"))
    plan = _layer_plans.get(key)
    if plan is None:
        if len(_layer_plans) >= _MAX_KEPT_CONFIGS:
            _layer_plans.clear()
        plan = _layer_plans[key] = LayerPlan(n_tokens, d, f, n_experts, top_k, n_rows, x.stride(0), w_gate.stride(),
                                             w_up.stride(), w_down.stride(), dtype, device)
    return plan
