"""RMSNorm's Triton kernels: the forward, the backward (with its dw partials and, folded in,
their fixed-order sum), the row dot a long row's backward takes first, and the partials'
reduction. Their launches, and the maths they compute, are `suite.arms.rmsnorm`'s.
"""

import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    X, W, Y, STATS,
    x_row_stride, n_rows, n_cols, n_counters, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr, STORE_STATS: tl.constexpr,
):
    """STATS: rstd of each row, then the backward's `n_counters` arrival counters, zeroed here
    so that the backward of this call starts from zero (0.0f and int32 0 share their bits).
    Without STORE_STATS (no backward to come) STATS is not written."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    wide_rows = rows.to(tl.int64)  # row * stride may pass 2**31 elements
    x_rows = X + wide_rows[:, None] * x_row_stride
    y_rows = Y + wide_rows[:, None] * n_cols
    cols = tl.arange(0, BLOCK_N)
    if LOOPED:
        # Pass 1 sums squares chunk by chunk; pass 2 re-reads x (mostly still in L2).
        sum_sq = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            chunk = start + cols
            mask = row_mask[:, None] & (chunk < n_cols)[None, :]
            x = tl.load(x_rows + chunk[None, :], mask=mask, other=0.0).to(tl.float32)
            sum_sq += x * x
        rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            chunk = start + cols
            col_mask = chunk < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + chunk[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = offset + tl.load(W + chunk, mask=col_mask, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * scale[None, :]
            tl.store(y_rows + chunk[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        col_mask = cols < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        scale = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * scale[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(STATS + rows, rstd, mask=row_mask)
        if tl.program_id(0) == 0:
            for start in range(0, n_counters, BLOCK_N):
                slots = start + cols
                tl.store(STATS + n_rows + slots, tl.zeros([BLOCK_N], tl.float32), mask=slots < n_counters)


@triton.jit
def rms_norm_bwd_row_dot_kernel(
    DY, X, W, GX_SUM,
    dy_row_stride, x_row_stride, n_rows, n_cols, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Looped path only: sum(g * x) per row, which every column stripe of dx needs."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    wide_rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        chunk = start + cols
        col_mask = chunk < n_cols
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + wide_rows[:, None] * x_row_stride + chunk[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + wide_rows[:, None] * dy_row_stride + chunk[None, :], mask=mask, other=0.0)
        scale = offset + tl.load(W + chunk, mask=col_mask, other=0.0).to(tl.float32)
        acc += dy.to(tl.float32) * scale[None, :] * x.to(tl.float32)
    tl.store(GX_SUM + rows, tl.sum(acc, axis=1), mask=row_mask)


@triton.jit
def _sum_rows(ROWS, first, count, row_step, n_cols, cols, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    """Sum of rows first, first + row_step, ... (`count` rows) of a [*, n_cols] fp32 buffer at
    `cols`, added one row after another in that order, so every kernel that sums a set of
    partials through here gets the same bits whatever its layout or program split.

    The sum starts from -0.0 and masked rows load -0.0: x + -0.0 == x for every x, so padding
    never changes a bit. (-0.0 is made from its bits: the compiler turns a literal -0.0 into
    0 - 0.0 = +0.0.) Loads bypass L1 (.cg): other programs wrote these rows.
    """
    negative_zero = tl.full([BLOCK_N], -(2**31), tl.int32).to(tl.float32, bitcast=True)
    acc = negative_zero
    for i in range(0, count, UNROLL):
        for j in tl.static_range(UNROLL):
            row = tl.cast(first + (i + j) * row_step, tl.int64)
            # a row past `count` masks every column (a where, as the 3.9 interpreter's int1
            # scalar & vector gives int32)
            mask = cols < tl.where(i + j < count, n_cols, 0)
            acc += tl.load(ROWS + row * n_cols + cols, mask=mask, other=negative_zero, cache_modifier=".cg")
    return acc


@triton.jit
def rms_norm_bwd_kernel(
    DY, X, W, STATS, GX_SUM, DX, DW_PARTIALS, DW,
    dy_row_stride, x_row_stride, n_rows, n_cols, offset, group_size,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_FITS: tl.constexpr,
    REDUCE_DW: tl.constexpr, FOLD_BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    """Grid (column stripes, G): program (s, p) handles stripe s of row blocks p, p + G, ...

    dx is written as it goes; dy * x * rstd is accumulated in registers and written once, as
    row p of the [G, N] partials. ROW_FITS: one stripe holds a whole row, so sum(g * x) is
    computed here; otherwise the row-dot kernel has put it in GX_SUM.

    REDUCE_DW: sum the partials into DW here too (else `reduce_dw_partials_kernel` does), with
    no second launch and no atomic sums. An arrival counter per group of `group_size` partial
    rows (per stripe) tells the group's last program to finish, which sums the group's rows
    into the group's first row; a counter over the groups tells the last of those, which sums
    the group rows into DW. Each counter is reset by the program that saw it full, so a second
    backward of the same forward starts from zero too. The counters live after the rstd in
    STATS, zeroed by the forward: one slot set per call, never shared between streams.

    Memory ordering: each program's threads store their part of the row, a CTA barrier orders
    those stores before thread 0's acq_rel (gpu scope) counter increment, which releases them;
    the program that sees the count full acquired every earlier release, and Triton broadcasts
    the atomic's result through shared memory behind a barrier, so all its threads read after
    the acquire (and read through L2, see `_sum_rows`). Two levels keep the last program's
    serial work to ~2 sqrt(G) rows (~33 at G = 264) where one level would make it G: one
    program reads at a fraction of the GPU's bandwidth.
    """
    stripe = tl.program_id(0)
    cols = stripe * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    part = tl.program_id(1)
    n_parts = tl.num_programs(1)
    scale = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for block in range(part, tl.cdiv(n_rows, BLOCK_M), n_parts):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        wide_rows = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + wide_rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + wide_rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(STATS + rows, mask=row_mask, other=0.0)
        g = dy * scale[None, :]
        if ROW_FITS:
            gx_sum = tl.sum(g * x, axis=1)
        else:
            gx_sum = tl.load(GX_SUM + rows, mask=row_mask, other=0.0)
        dx = rstd[:, None] * (g - x * (rstd * rstd * (gx_sum / n_cols))[:, None])
        tl.store(DX + wide_rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * (x * rstd[:, None])
    tl.store(DW_PARTIALS + part.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)

    if REDUCE_DW:
        n_groups = tl.cdiv(n_parts, group_size)
        counters = (STATS + n_rows).to(tl.pointer_type(tl.int32), bitcast=True) + stripe * (n_groups + 1)
        group = part // group_size
        first = group * group_size
        group_rows = tl.minimum(group_size, n_parts - first)
        fold_cols = tl.arange(0, FOLD_BLOCK_N)
        tl.debug_barrier()
        if tl.atomic_add(counters + group, 1, sem="acq_rel", scope="gpu") == group_rows - 1:
            tl.store(counters + group, 0)
            for start in range(0, BLOCK_N, FOLD_BLOCK_N):
                chunk = stripe * BLOCK_N + start + fold_cols
                chunk_mask = chunk < n_cols
                group_sum = _sum_rows(DW_PARTIALS, first, group_rows, 1, n_cols, chunk, FOLD_BLOCK_N, UNROLL)
                tl.store(DW_PARTIALS + first.to(tl.int64) * n_cols + chunk, group_sum, mask=chunk_mask)
            tl.debug_barrier()
            if tl.atomic_add(counters + n_groups, 1, sem="acq_rel", scope="gpu") == n_groups - 1:
                tl.store(counters + n_groups, 0)
                for start in range(0, BLOCK_N, FOLD_BLOCK_N):
                    chunk = stripe * BLOCK_N + start + fold_cols
                    chunk_mask = chunk < n_cols
                    total = _sum_rows(DW_PARTIALS, 0, n_groups, group_size, n_cols, chunk, FOLD_BLOCK_N, UNROLL)
                    tl.store(DW + chunk, total.to(DW.dtype.element_ty), mask=chunk_mask)


@triton.jit
def reduce_dw_partials_kernel(
    PARTIALS, DW, n_partials, n_cols, group_size,
    BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
):
    """The folded reduction's order in a launch of its own: each group of `group_size` rows
    summed in order, then the group sums in order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    total = tl.full([BLOCK_N], -(2**31), tl.int32).to(tl.float32, bitcast=True)  # -0.0, see _sum_rows
    for first in range(0, n_partials, group_size):
        group_rows = tl.minimum(group_size, n_partials - first)
        total += _sum_rows(PARTIALS, first, group_rows, 1, n_cols, cols, BLOCK_N, UNROLL)
    tl.store(DW + cols, total.to(DW.dtype.element_ty), mask=col_mask)


