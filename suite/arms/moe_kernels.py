"""MoE SwiGLU experts: ragged grouped GEMMs over the expert-sorted layout, with their launchers.

The layout (made by the routing): R kept rows sorted by expert; expert e owns rows
offsets[e]:offsets[e+1] (int32 [E+1], offsets[0] = 0); token_of_row (int32 [R_max]) gives each
sorted row's token, rows past offsets[E] unused; row_id_map (int32 [T*k]) gives the sorted row
of (token t, slot s) at t*k + s, -1 for a dropped slot; probs fp32 [T, k].

Nothing here reads R or a per-expert count on the host: a GEMM over rows launches over an upper
bound of row tiles, cdiv(R_max, BLOCK_M) + E (each expert adds at most one partial tile), and
each program finds its expert and rows from `offsets` on the device (`_expert_tile`); programs
past the last tile do nothing. All sums run in a fixed order (no atomics), so a run reproduces
its bits. Math is fp32 (fp32 accumulators, SwiGLU in fp32); tl.dot takes the operands in their
own dtype, fp32 at full ("ieee") precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from suite.arms.triton_support import interpreting, launch
from suite.device_profile import smem_limit
from suite.errors import CouldNotRun

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
def _dot(a, b, acc, UPCAST: tl.constexpr):
    # UPCAST: the interpreter's bf16 tl.dot is wrong; fp32 operands are exact there
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _up_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U,
    n_experts, d, f, stride_x, sw_e, sw_k, sw_n, su_e, su_k, su_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    SAVE: tl.constexpr, UPCAST: tl.constexpr,
):
    """a = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for one [BLOCK_M, BLOCK_N] tile of
    rows, gate and up in two accumulators over one pass of the gathered x rows; SAVE also
    stores the pre-activations g and u (the backward's inputs). A, G, U: [R_max, f]."""
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        tokens = tl.load(TOKEN_OF_ROW + rows, mask=row_mask, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < f
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
        wide_expert = expert.to(tl.int64)
        wg_ptrs = W_GATE + wide_expert * sw_e + ks[:, None].to(tl.int64) * sw_k + cols[None, :] * sw_n
        wu_ptrs = W_UP + wide_expert * su_e + ks[:, None].to(tl.int64) * su_k + cols[None, :] * su_n
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
        a = acc_g * tl.sigmoid(acc_g) * acc_u
        out = rows.to(tl.int64)[:, None] * f + cols[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        tl.store(A + out, a.to(A.dtype.element_ty), mask=mask)
        if SAVE:
            tl.store(G + out, acc_g.to(G.dtype.element_ty), mask=mask)
            tl.store(U + out, acc_u.to(U.dtype.element_ty), mask=mask)


@triton.jit
def _rows_gemm_kernel(
    A, B, OFFSETS, C,
    n_experts, n_k, n_n, sb_e, sb_k, sb_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """C[r] = A[r] @ B[e] for one [BLOCK_M, BLOCK_N] tile of expert e's rows. A: [R_max, n_k],
    C: [R_max, n_n], both contiguous; B[e] read through its strides (a transposed weight is
    its strides swapped)."""
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        wide_rows = rows.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n_n
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = A + wide_rows[:, None] * n_k + ks[None, :]
        b_ptrs = B + expert.to(tl.int64) * sb_e + ks[:, None].to(tl.int64) * sb_k + cols[None, :] * sb_n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            k_mask = ks < n_k - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * sb_k
        out = wide_rows[:, None] * n_n + cols[None, :]
        tl.store(C + out, acc.to(C.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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


# --------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One grouped GEMM's tiles: BLOCK_M rows (or, for a weight gradient, rows of the weight),
    BLOCK_N output columns, BLOCK_K of the reduced dim per step; `stages` buffered steps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    n_a: int  # operand tiles of [block_m, block_k] per step
    n_b: int  # operand tiles of [block_k, block_n] per step
    itemsize: int

    @property
    def smem_bytes(self) -> int:
        """Shared memory the pipelined operand buffers take (what bounds a config)."""
        per_stage = (self.n_a * self.block_m * self.block_k + self.n_b * self.block_k * self.block_n) * self.itemsize
        return self.num_stages * per_stage


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _interpreting() -> bool:
    return interpreting(_up_kernel)


# Tiles by shape class (no autotuning): rows per expert few (decode-like, many experts) or many,
# output columns narrow or wide. The reduced dim steps by 64 two-byte values (32 fp32: the same
# bytes). Under the interpreter, 16 everywhere: tiny test shapes then still take several tiles,
# several steps and masked edges.
_MANY_ROWS = 128  # average rows per expert from which 128-row tiles pay off
_MAX_STAGES = 4


def _gemm_config(rows_per_expert: int, n: int, dtype: torch.dtype, n_a: int, n_b: int, device) -> GemmConfig:
    itemsize = torch.empty((), dtype=dtype).element_size()
    if _interpreting() and device.type != "cuda":
        return GemmConfig(16, 16, 16, 4, 1, n_a, n_b, itemsize)
    block_m = 128 if rows_per_expert >= _MANY_ROWS else 64
    # two [block_m, block_n] fp32 accumulators (n_b = 2) take the registers of one twice as wide
    block_n = max(16, min(128 // n_b if block_m == 128 else 128, triton.next_power_of_2(n)))
    block_k = 64 if itemsize < 4 else 32
    num_warps = 8 if block_m * block_n * n_b >= 128 * 128 else 4
    limit = smem_limit(device)
    for stages in range(_MAX_STAGES, 0, -1):
        config = GemmConfig(block_m, block_n, block_k, num_warps, stages, n_a, n_b, itemsize)
        if config.smem_bytes <= limit:
            return config
    raise AssertionError(f"no stage count fits {limit} bytes of shared memory: {config}")


# The combine is a streaming gather: tiles of 32 tokens x 128 columns (16 KiB fp32), 4 warps.
COMBINE_BLOCK_T = 32
COMBINE_BLOCK_D = 128


def _combine_blocks(n_tokens: int, d: int, device) -> tuple[int, int]:
    if _interpreting() and device.type != "cuda":
        return 8, 16  # several programs and masked edges at test sizes
    return COMBINE_BLOCK_T, min(COMBINE_BLOCK_D, max(16, triton.next_power_of_2(d)))


# --------------------------------------------------------------------------------------------
# Checks and buffers
# --------------------------------------------------------------------------------------------


def _require_runnable(t: torch.Tensor, fn: str) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise CouldNotRun(
            f"{fn}: the MoE kernels need CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
            f"imported), got a tensor on {t.device}"
        )


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


def _check(ok: bool, fn: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{fn}: {message}")


def _check_index(t: torch.Tensor, fn: str, name: str, device) -> None:
    _check(t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous(), fn,
           f"{name} must be a contiguous 1-D int32 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    _check(t.device == device, fn, f"{name} is on {t.device}, the data on {device}")


def _check_rows(t: torch.Tensor, fn: str, name: str, n_rows: int, width: int, dtype, device) -> None:
    _check(tuple(t.shape) == (n_rows, width) and t.is_contiguous(), fn,
           f"{name} must be a contiguous ({n_rows}, {width}) tensor, got shape {tuple(t.shape)}")
    _check(t.dtype == dtype and t.device == device, fn,
           f"{name} must be {dtype} on {device}, got {t.dtype} on {t.device}")


def _check_weight(w: torch.Tensor, fn: str, name: str, shape: tuple, dtype, device) -> None:
    _check(tuple(w.shape) == shape, fn, f"{name} must have shape {shape}, got {tuple(w.shape)}")
    _check(w.dtype == dtype and w.device == device, fn,
           f"{name} must be {dtype} on {device} (x's), got {w.dtype} on {w.device}")


def _check_dtype(x: torch.Tensor, fn: str) -> None:
    _check(x.dtype in _SUPPORTED_DTYPES, fn, f"tensors must be bfloat16, float16 or float32, not {x.dtype}")


def _upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.bfloat16 and _interpreting()


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def expert_up(x, w_gate, w_up, token_of_row, offsets, *, out=None, gate_out=None, up_out=None,
              save_preactivations: bool = True):
    """a[r] = silu(x[tok] @ w_gate[e]) * (x[tok] @ w_up[e]) for every sorted row r of expert e
    (tok = token_of_row[r]); x [T, d], w_gate and w_up [E, d, f]. -> (a, g, u), each [R_max, f]
    in x's dtype, g and u the pre-activations (None without save_preactivations). Rows past
    offsets[E] are left unwritten. out / gate_out / up_out: caller-owned buffers, reused."""
    fn = "expert_up"
    _check_dtype(x, fn)
    _require_runnable(x, fn)
    _check(x.dim() == 2 and x.stride(1) == 1, fn, f"x must be 2-D (T, d) with unit column stride, got {tuple(x.shape)}")
    n_experts, d, f = w_gate.shape if w_gate.dim() == 3 else (0, 0, 0)
    _check(w_gate.dim() == 3 and d == x.shape[1], fn, f"w_gate must be (E, d={x.shape[1]}, f), got {tuple(w_gate.shape)}")
    _check_weight(w_up, fn, "w_up", (n_experts, d, f), x.dtype, x.device)
    _check_weight(w_gate, fn, "w_gate", (n_experts, d, f), x.dtype, x.device)
    _check_index(token_of_row, fn, "token_of_row", x.device)
    _check_index(offsets, fn, "offsets", x.device)
    _check(offsets.shape[0] == n_experts + 1, fn, f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    n_rows = token_of_row.shape[0]
    a = _buffer(out, fn, "out", (n_rows, f), x.dtype, x.device)
    g = _buffer(gate_out, fn, "gate_out", (n_rows, f), x.dtype, x.device) if save_preactivations else None
    u = _buffer(up_out, fn, "up_out", (n_rows, f), x.dtype, x.device) if save_preactivations else None
    if n_rows and n_experts and f:
        cfg = _gemm_config(n_rows // n_experts, f, x.dtype, 1, 2, x.device)
        grid = (_cdiv(n_rows, cfg.block_m) + n_experts, _cdiv(f, cfg.block_n))
        launch(
            _up_kernel, grid,
            x, w_gate, w_up, token_of_row, offsets, a, a if g is None else g, a if u is None else u,
            n_experts, d, f, x.stride(0), *w_gate.stride(), *w_up.stride(),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_E=triton.next_power_of_2(n_experts), SAVE=save_preactivations, UPCAST=_upcast(x.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return a, g, u


def expert_down(a, w_down, offsets, *, out=None):
    """y_rows[r] = a[r] @ w_down[e] for every sorted row r of expert e; a [R_max, f], w_down
    [E, f, d]. -> y_rows [R_max, d] in a's dtype, rows past offsets[E] unwritten. out: a
    caller-owned buffer, reused."""
    fn = "expert_down"
    _check_dtype(a, fn)
    _require_runnable(a, fn)
    _check(w_down.dim() == 3, fn, f"w_down must be (E, f, d), got {tuple(w_down.shape)}")
    n_experts, f, d = w_down.shape
    _check_rows(a, fn, "a", a.shape[0], f, w_down.dtype, w_down.device)
    _check_index(offsets, fn, "offsets", a.device)
    _check(offsets.shape[0] == n_experts + 1, fn, f"offsets must have E + 1 = {n_experts + 1} entries, got {offsets.shape[0]}")
    n_rows = a.shape[0]
    y = _buffer(out, fn, "out", (n_rows, d), a.dtype, a.device)
    _grouped_rows(a, w_down, w_down.stride(), offsets, y)
    return y


def _grouped_rows(a, w, w_strides, offsets, c):
    """c[r] = a[r] @ W[e] over the ragged rows, W[e] read as [K, N] through w_strides (e, k, n)."""
    n_rows, n_k = a.shape
    n_n = c.shape[1]
    n_experts = offsets.shape[0] - 1
    if n_rows and n_experts and n_n:
        cfg = _gemm_config(n_rows // n_experts, n_n, a.dtype, 1, 1, a.device)
        grid = (_cdiv(n_rows, cfg.block_m) + n_experts, _cdiv(n_n, cfg.block_n))
        launch(
            _rows_gemm_kernel, grid,
            a, w, offsets, c, n_experts, n_k, n_n, *w_strides,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_E=triton.next_power_of_2(n_experts), UPCAST=_upcast(a.dtype),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )


def combine(rows, row_id_map, probs=None, *, top_k: int | None = None, out=None):
    """out[t] = sum over slots s = 0..k-1, in that order, of probs[t, s] * rows[row_id_map[t*k + s]]
    (dropped slots, -1, skipped), summed in fp32, out [T, d] in rows' dtype. Without probs, the
    plain sum (the gather of dx rows back to tokens); k is then `top_k`. out: a caller-owned
    buffer, reused."""
    fn = "combine"
    _check_dtype(rows, fn)
    _require_runnable(rows, fn)
    _check(rows.dim() == 2 and rows.is_contiguous(), fn, f"rows must be a contiguous (R_max, d) tensor, got {tuple(rows.shape)}")
    _check_index(row_id_map, fn, "row_id_map", rows.device)
    if probs is not None:
        _check(probs.dim() == 2 and probs.dtype == torch.float32 and probs.is_contiguous(), fn,
               f"probs must be a contiguous (T, k) float32 tensor, got {probs.dtype} of shape {tuple(probs.shape)}")
        _check(probs.device == rows.device, fn, f"probs is on {probs.device}, rows on {rows.device}")
        _check(top_k in (None, probs.shape[1]), fn, f"top_k={top_k} but probs has {probs.shape[1]} slots")
        top_k = probs.shape[1]
    _check(top_k is not None and top_k > 0, fn, "pass probs, or top_k for the unweighted sum")
    _check(row_id_map.shape[0] % top_k == 0, fn, f"row_id_map has {row_id_map.shape[0]} slots, no multiple of k={top_k}")
    n_tokens, d = row_id_map.shape[0] // top_k, rows.shape[1]
    _check(probs is None or probs.shape[0] == n_tokens, fn, f"probs must have T = {n_tokens} rows, got {probs.shape[0] if probs is not None else 0}")
    result = _buffer(out, fn, "out", (n_tokens, d), rows.dtype, rows.device)
    if n_tokens and d:
        block_t, block_d = _combine_blocks(n_tokens, d, rows.device)
        launch(
            _combine_kernel, (_cdiv(n_tokens, block_t), _cdiv(d, block_d)),
            rows, row_id_map, rows if probs is None else probs, result, n_tokens, d,
            TOP_K=top_k, WEIGHTED=probs is not None, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4,
        )
    return result
