"""RMSNorm: a fused Triton forward and backward, with the eager reference it must match.

y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps), all math in fp32. offset = 1 is
the zero-centred-weight variant (Gemma). The backward, with g = dy * (offset + w):

    dx = rstd * (g - x * rstd^2 * mean(g * x))
    dw = sum over rows of dy * x * rstd

dw is reduced in two deterministic stages, never with atomics: each backward program sums its
own rows into one fp32 row of a [G, N] partials buffer, then a small kernel sums the G rows in
a fixed order. The launch configuration is a pure function of the shape and the device, so a
run reproduces its bits exactly.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import nn

from suite.arms.triton_support import interpreting, launch
from suite.device_profile import smem_limit
from suite.errors import CouldNotRun

# Longest row one tile holds; longer rows loop over column chunks (tests lower it to reach
# the looped path at tiny sizes).
MAX_FUSED_N = 16384
# Column chunk of the looped path: small enough to keep registers free, wide enough to stream.
LOOPED_BLOCK_N = 4096
# fp32 values per tile operand. The backward holds x, dy and its dW sum for a whole tile in
# registers; an H200 sweep found it fastest at 4096 (16 per thread at 8 warps).
TARGET_TILE = 4096
MAX_BLOCK_M = 64
# Under the interpreter a few backward programs suffice to make several dW partials.
INTERPRETER_MAX_PROGRAMS = 4
# Stage 2 of dW: partial rows summed per step x columns per program.
REDUCE_BLOCK_G = 32
REDUCE_BLOCK_N = 128

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0):
    """Eager RMSNorm with fp32 math (float64 when given float64); autograd gives its backward."""
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    wf = weight.float() if weight.dtype != torch.float64 else weight
    return (xf * rstd * (offset + wf)).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    x_row_stride, n_rows, n_cols, eps, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
):
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
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _rms_norm_bwd_row_dot_kernel(
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
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, GX_SUM, DX, DW_PARTIALS,
    dy_row_stride, x_row_stride, n_rows, n_cols, offset,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_FITS: tl.constexpr,
):
    """Grid (column stripes, G): program (s, p) handles stripe s of row blocks p, p + G, ...

    dx is written as it goes; dy * x * rstd is accumulated in registers and written once, as
    row p of the [G, N] partials. ROW_FITS: one stripe holds a whole row, so sum(g * x) is
    computed here; otherwise the row-dot kernel has put it in GX_SUM.
    """
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
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
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        g = dy * scale[None, :]
        if ROW_FITS:
            gx_sum = tl.sum(g * x, axis=1)
        else:
            gx_sum = tl.load(GX_SUM + rows, mask=row_mask, other=0.0)
        dx = rstd[:, None] * (g - x * (rstd * rstd * (gx_sum / n_cols))[:, None])
        tl.store(DX + wide_rows[:, None] * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * (x * rstd[:, None])
    tl.store(DW_PARTIALS + part.to(tl.int64) * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit
def _reduce_dw_partials_kernel(
    PARTIALS, DW, n_partials, n_cols,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    for start in range(0, n_partials, BLOCK_G):
        parts = start + tl.arange(0, BLOCK_G)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIALS + parts.to(tl.int64)[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=col_mask)


# --------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per tile
    block_n: int  # columns per tile: the whole row, or one chunk when looped
    num_warps: int
    looped: bool  # the row is longer than one tile
    max_programs: int  # cap on backward programs, hence on dW partial rows


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _interpreting() -> bool:
    return interpreting(_rms_norm_fwd_kernel)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch_config(n_rows: int, n_cols: int, device: torch.device) -> LaunchConfig:
    # Cached, as host time per call counts at training sizes. The key holds everything the
    # heuristic reads, SUITE_PROFILE (read by smem_limit) included.
    return _cached_launch_config(
        n_rows, n_cols, device, MAX_FUSED_N, os.environ.get("SUITE_PROFILE"), _interpreting()
    )


@functools.lru_cache(maxsize=4096)
def _cached_launch_config(n_rows, n_cols, device, max_fused_n, suite_profile, interpreted) -> LaunchConfig:
    # A whole fp32 tile must fit in shared memory, so that any layout conversion Triton stages
    # through it fits too: 16384 values on the RTX profile (99 KiB).
    max_tile = _prev_pow2(smem_limit(device) // 4)
    fused_limit = min(max_fused_n, max_tile)
    looped = n_cols > fused_limit
    block_n = min(LOOPED_BLOCK_N, _prev_pow2(fused_limit)) if looped else triton.next_power_of_2(n_cols)
    if device.type == "cuda" and not interpreted:
        # Two backward programs fit an SM's registers up to TARGET_TILE-value tiles, one beyond.
        per_sm = 1 if not looped and block_n > TARGET_TILE else 2
        max_programs = per_sm * _sm_count(device.index)
    else:
        max_programs = INTERPRETER_MAX_PROGRAMS
    block_m = min(MAX_BLOCK_M, TARGET_TILE // block_n, max_tile // block_n)
    # Tall tiles only where rows are plentiful: few rows still fill every program slot (and
    # make several dW partials).
    block_m = max(1, min(block_m, _prev_pow2(max(1, n_rows // max_programs))))
    if looped:
        # Pass 1 over a long row is a chain of chunk loads: many warps keep enough in flight.
        num_warps = max(4, min(32, block_n // 128))
    else:
        num_warps = max(4, min(16, block_m * block_n // 512))
    return LaunchConfig(block_m, block_n, num_warps, looped, max_programs)


# --------------------------------------------------------------------------------------------
# Building blocks (a gate builds its saboteurs from these)
# --------------------------------------------------------------------------------------------


def _require_runnable(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise CouldNotRun(
            f"rms_norm: the fused path needs a CUDA tensor (or TRITON_INTERPRET=1 set before triton "
            f"is imported), got a tensor on {t.device}; use rms_norm_reference or "
            f'RMSNorm(impl="eager") on the CPU'
        )


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    """Kernels take a row stride but assume adjacent columns; copy only when they are not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """(M, N) x -> (y contiguous (M, N) in x's dtype, rstd fp32 (M,))."""
    _require_runnable(x2d)
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    if n_rows == 0:
        return y, rstd
    x2d, weight = _unit_col_stride(x2d), _unit_col_stride(weight)
    cfg = _launch_config(n_rows, n_cols, x2d.device)
    launch(
        _rms_norm_fwd_kernel, (triton.cdiv(n_rows, cfg.block_m),),
        x2d, weight, y, rstd, x2d.stride(0), n_rows, n_cols, float(eps), float(offset),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOOPED=cfg.looped, num_warps=cfg.num_warps,
    )
    return y, rstd


def rms_norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float):
    """-> (dx contiguous (M, N) in x's dtype, dW partials fp32 [G, N]); G is 0 when M is."""
    _require_runnable(x2d)
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    if n_rows == 0:
        return dx, torch.empty((0, n_cols), dtype=torch.float32, device=x2d.device)
    dy2d, x2d, weight = _unit_col_stride(dy2d), _unit_col_stride(x2d), _unit_col_stride(weight)
    cfg = _launch_config(n_rows, n_cols, x2d.device)
    row_blocks = triton.cdiv(n_rows, cfg.block_m)
    n_stripes = triton.cdiv(n_cols, cfg.block_n)
    # Fewer row groups for more stripes keeps the program count, and the partials, bounded.
    n_parts = min(row_blocks, max(1, cfg.max_programs // n_stripes))
    partials = torch.empty((n_parts, n_cols), dtype=torch.float32, device=x2d.device)
    offset = float(offset)
    if cfg.looped:
        gx_sum = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
        launch(
            _rms_norm_bwd_row_dot_kernel, (row_blocks,),
            dy2d, x2d, weight, gx_sum, dy2d.stride(0), x2d.stride(0), n_rows, n_cols, offset,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )
    else:
        gx_sum = rstd  # unread when a stripe holds the whole row
    launch(
        _rms_norm_bwd_kernel, (n_stripes, n_parts),
        dy2d, x2d, weight, rstd, gx_sum, dx, partials,
        dy2d.stride(0), x2d.stride(0), n_rows, n_cols, offset,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROW_FITS=not cfg.looped, num_warps=cfg.num_warps,
    )
    return dx, partials


def reduce_dw_partials(dw_partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum the [G, N] fp32 partials over G, in a fixed order, into dW of `dtype`."""
    n_parts, n_cols = dw_partials.shape
    if n_parts == 0:
        return torch.zeros(n_cols, dtype=dtype, device=dw_partials.device)
    _require_runnable(dw_partials)
    dw = torch.empty(n_cols, dtype=dtype, device=dw_partials.device)
    launch(
        _reduce_dw_partials_kernel, (triton.cdiv(n_cols, REDUCE_BLOCK_N),),
        dw_partials.contiguous(), dw, n_parts, n_cols,
        BLOCK_G=REDUCE_BLOCK_G, BLOCK_N=REDUCE_BLOCK_N, num_warps=4,
    )
    return dw


# --------------------------------------------------------------------------------------------
# Autograd and public API
# --------------------------------------------------------------------------------------------


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return _unit_col_stride(t).reshape(-1, t.shape[-1])


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2d = _as_rows(x)
        y2d, rstd = rms_norm_forward(x2d, weight, eps, offset)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset = offset
        return y2d.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx2d, partials = rms_norm_backward(_as_rows(dy), x2d, weight, rstd, ctx.offset)
        return dx2d.view(dy.shape), reduce_dw_partials(partials, weight.dtype), None, None


def _validate(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: x must be bfloat16, float16 or float32, not {x.dtype}")
    if weight.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rms_norm: weight must be bfloat16, float16 or float32, not {weight.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must have a non-empty last (hidden) dim, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of size {x.shape[-1]} (x's last dim), got shape {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """Fused RMSNorm over x's last dim; y in x's dtype, dx in x's dtype, dw in weight's dtype."""
    _validate(x, weight)
    return _RMSNormFunction.apply(x, weight, float(eps), float(offset))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, impl: str = "fused",
                 device=None, dtype=None):
        super().__init__()
        if impl not in ("fused", "eager"):
            raise ValueError(f'RMSNorm: impl must be "fused" or "eager", not {impl!r}')
        self.hidden_size = hidden_size
        self.eps = eps
        self.offset = offset
        self.impl = impl
        # Initial scale offset + w is 1.
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - offset, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = rms_norm if self.impl == "fused" else rms_norm_reference
        return norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, impl={self.impl!r}"
