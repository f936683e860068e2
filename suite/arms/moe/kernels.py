"""The experts' Triton kernels: ragged grouped GEMMs over the expert-sorted layout (up, rows,
their TMA forms, the weight gradients), the SwiGLU backward, the combines and the row gather.
Their launchers, and what they read of the layout, are `launch`'s; their tiles `config`'s.
"""

import triton
import triton.language as tl

from suite.arms.moe import activation

GELU_TANH_SCALE = tl.constexpr(activation.GELU_TANH_SCALE)
GELU_TANH_CUBIC = tl.constexpr(activation.GELU_TANH_CUBIC)


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
def up_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U,
    n_experts, d, f, stride_x, s_gu, c_gu, sw_e, sw_k, sw_n, su_e, su_k, su_n, n_tiles_m, n_tiles_n, LIMIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SAVE: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr,
):
    """a = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for one [BLOCK_M, BLOCK_N] tile of
    rows (or its clamped or GeGLU form as ACT says, see `_glu`), gate and up in two accumulators over
    one pass of the gathered x rows; SAVE also stores the pre-activations g and u (the
    backward's inputs). A: [R_max, f]; G, U: [R_max, f] views with row stride s_gu and column
    step c_gu (two halves of one buffer, see `_store_up`)."""
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
        _store_up(A, G, U, rows, row_mask, cols, f, s_gu, c_gu, acc_g, acc_u, LIMIT, SAVE, ACT)


@triton.jit
def _glu(g, u, LIMIT, ACT: tl.constexpr):
    """act(g) * u in fp32; ACT (`activation`'s mode) 0: silu; 1: u clamped to [-LIMIT, LIMIT]
    and g to at most LIMIT before silu; 2: u so, and silu(g) to at most LIMIT; 3: gelu's tanh
    form, g * sigmoid(2 z) (`activation.GeGLU`). NaN passes through a clamp, as through torch's."""
    if ACT == 3:
        z = GELU_TANH_SCALE * (g + GELU_TANH_CUBIC * g * g * g)
        return g * tl.sigmoid(2.0 * z) * u
    if ACT != 0:
        u = tl.clamp(u, -LIMIT, LIMIT, propagate_nan=tl.PropagateNan.ALL)
        if ACT == 1:
            g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    a = g * tl.sigmoid(g)
    if ACT == 2:
        a = tl.minimum(a, LIMIT, propagate_nan=tl.PropagateNan.ALL)
    return a * u


@triton.jit
def _store_up(A, G, U, rows, row_mask, cols, f, s_gu, c_gu, acc_g, acc_u, LIMIT, SAVE: tl.constexpr,
              ACT: tl.constexpr):
    """The up GEMMs' epilogue: a = `_glu`(g, u) in fp32, stored with g and u (SAVE) at the
    tile's rows of the expert and columns below f. g and u are laid out as the weights' gate
    and up are (row stride s_gu, column step c_gu): the backward's dg and du then take their
    place and form the fused weight's gradient operand as they are."""
    a = _glu(acc_g, acc_u, LIMIT, ACT)
    wide_rows = rows.to(tl.int64)[:, None]
    mask = row_mask[:, None] & (cols < f)[None, :]
    tl.store(A + wide_rows * f + cols[None, :], a.to(A.dtype.element_ty), mask=mask)
    if SAVE:
        pair = wide_rows * s_gu + cols[None, :] * c_gu
        tl.store(G + pair, acc_g.to(G.dtype.element_ty), mask=mask)
        tl.store(U + pair, acc_u.to(U.dtype.element_ty), mask=mask)


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
def rows_gemm_kernel(
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
def up_tma_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U, n_experts, d, f, stride_x, s_gu, c_gu, n_tiles_m, n_tiles_n,
    LIMIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SAVE: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, W_NK: tl.constexpr, ACT: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """`up_kernel`'s tile, sums and bits, the weights' tiles through TMA descriptors (x's
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
        _store_up(A, G, U, rows, row_mask, col0 + tl.arange(0, BLOCK_N), f, s_gu, c_gu, acc_g, acc_u, LIMIT,
                  SAVE, ACT)


@triton.jit
def rows_tma_kernel(
    A, A2, W, W2, OFFSETS, C, n_experts, n_k, n_n, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    TWO: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr, W_NK: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    """`rows_gemm_kernel`'s tile, sums and bits, A, A2, W and W2 through TMA descriptors
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
def swiglu_backward_kernel(D_A, G, U, DG, DU, OFFSETS, n_experts, f, s_da, s_gu, c_gu, LIMIT,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACT: tl.constexpr):
    """dg = d_a * u * silu'(g) and du = d_a * silu(g), element by element over the kept rows
    (the first offsets[E] rows), one [BLOCK_R, BLOCK_C] tile a program; with ACT (`_glu`)
    through the clamped values, and no gradient where a clamp held its value past a bound (as
    torch's clamp: at the bound it passes), or gelu's in silu's place. D_A: [R_max, f], row
    stride s_da; G, U, DG, DU: [R_max, f] views with row stride s_gu and column step c_gu (the
    halves of one buffer laid out as the weights' gate and up). D_A may be DU itself, and DG and
    DU may be G and U (each element is read before the same program writes it)."""
    n_rows = tl.load(OFFSETS + n_experts)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R < n_rows:
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < n_rows)[:, None] & (cols < f)[None, :]
        wide_rows = rows.to(tl.int64)[:, None]
        pair = wide_rows * s_gu + cols[None, :] * c_gu
        d_a = tl.load(D_A + wide_rows * s_da + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + pair, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + pair, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            sig = tl.sigmoid(g)
            dg = d_a * u * sig * (1.0 + g * (1.0 - sig))
            du = d_a * g * sig
        elif ACT == 3:
            z = GELU_TANH_SCALE * (g + GELU_TANH_CUBIC * g * g * g)
            sig = tl.sigmoid(2.0 * z)
            # gelu' = s + 2 g s (1 - s) z'(g); where s (1 - s) is 0 its term is, whatever g^2 is
            slope = g * sig * (1.0 - sig)
            slope = tl.where(slope != 0.0, slope * 2.0 * GELU_TANH_SCALE * (1.0 + 3.0 * GELU_TANH_CUBIC * g * g), 0.0)
            dg = d_a * u * (sig + slope)
            du = d_a * g * sig
        else:
            u_passes = (u >= -LIMIT) & (u <= LIMIT)
            u = tl.clamp(u, -LIMIT, LIMIT, propagate_nan=tl.PropagateNan.ALL)
            if ACT == 1:  # the gate clamped, then silu of it
                g_passes = g <= LIMIT
                g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
            sig = tl.sigmoid(g)
            silu = g * sig
            if ACT == 2:  # silu of the gate, then clamped
                g_passes = silu <= LIMIT
                silu = tl.minimum(silu, LIMIT, propagate_nan=tl.PropagateNan.ALL)
            dg = tl.where(g_passes, d_a * u * sig * (1.0 + g * (1.0 - sig)), 0.0)
            du = tl.where(u_passes, d_a * silu, 0.0)
        tl.store(DG + pair, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + pair, du.to(DU.dtype.element_ty), mask=mask)


@triton.jit
def weight_grad_kernel(
    X, TOKEN_OF_ROW, GRAD, GRAD2, OFFSETS, DW, DW2, n_i, n_j, stride_x, s_gr, c_gr, s_we, s_wi, s_wj,
    BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr, TWO: tl.constexpr, UPCAST: tl.constexpr, GROUP_M: tl.constexpr,
):
    """DW[e] = X_e^T @ GRAD_e (and DW2[e] = X_e^T @ GRAD2_e with TWO, X_e read once for both):
    program (tile, e) owns one [BLOCK_I, BLOCK_J] tile of expert e's [n_i, n_j] gradient and
    loops over e's rows in order, so no two programs add into one value (no atomics) and an
    empty expert gets zeros. X_e: rows of X gathered through TOKEN_OF_ROW with GATHER, else
    the sorted rows themselves; GRAD, GRAD2: [R_max, n_j] views with row stride s_gr and
    column step c_gr; DW, DW2: [E, n_i, n_j] views with strides (s_we, s_wi, s_wj), so a
    gradient lands in its parameter's own layout (a model's [E, out, in], gate and up halves
    of one tensor) with no copy after."""
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
        grad_offs = rows.to(tl.int64)[:, None] * s_gr + jj[None, :] * c_gr
        grad_mask = row_mask[:, None] & j_mask[None, :]
        acc = _dot(xt, tl.load(GRAD + grad_offs, mask=grad_mask, other=0.0), acc, UPCAST)
        if TWO:
            acc2 = _dot(xt, tl.load(GRAD2 + grad_offs, mask=grad_mask, other=0.0), acc2, UPCAST)
    out = expert.to(tl.int64) * s_we + ii.to(tl.int64)[:, None] * s_wi + jj.to(tl.int64)[None, :] * s_wj
    mask = i_mask[:, None] & j_mask[None, :]
    tl.store(DW + out, acc.to(DW.dtype.element_ty), mask=mask)
    if TWO:
        tl.store(DW2 + out, acc2.to(DW2.dtype.element_ty), mask=mask)


@triton.jit
def combine_kernel(
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
def combine_bwd_kernel(
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
def gather_rows_kernel(X, TOKEN_OF_ROW, OFFSETS, OUT, n_experts, d, stride_x,
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


