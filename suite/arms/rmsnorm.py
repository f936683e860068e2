"""RMSNorm: a fused Triton forward and backward, with the eager reference it must match.

y = x * rstd * (offset + w), rstd = 1 / sqrt(mean(x^2) + eps), all math in fp32. offset = 1 is
the zero-centred-weight variant (Gemma). The backward, with g = dy * (offset + w):

    dx = rstd * (g - x * rstd^2 * mean(g * x))
    dw = sum over rows of dy * x * rstd

dw is reduced deterministically, never with atomic sums: each backward program sums its own
rows into one fp32 row of a [G, N] partials buffer, and the G rows are then summed in a fixed
order (in groups of `group_size`, then the group sums; see `rmsnorm_kernels._sum_rows`). The backward of
`rms_norm` does that final sum in the same launch (`rms_norm_backward_reduced`); the two-stage
blocks (`rms_norm_backward`, then `reduce_dw_partials`) give the same bits in two launches. The
launch configuration is a pure function of the shape and the device, so a run reproduces its
bits exactly.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from dataclasses import dataclass, field

import torch
import triton
from torch import nn

from suite.arms import rmsnorm_kernels as kernels
from suite.triton_support import (
    FLOAT_DTYPES,
    KeptLaunches,
    Launcher,
    cdiv,
    interpreted,
    launch,
    launcher,
    on_device_of,
    require_runnable,
)
from suite.device_profile import smem_limit

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
# Summing dW partials (see rmsnorm_kernels._sum_rows), rows are loaded UNROLL at a time before they are added,
# to keep loads in flight; the order of the adds does not depend on it. The folded reduction
# reads 4 fp32 per thread per row (one 16-byte load), so its 8 rows in flight take 32
# registers, fewer than the main loop's tiles: occupancy is unchanged. The two-stage kernel
# has 1 fp32 per thread per row (128 columns on 4 warps) and room for 32 rows.
FOLD_UNROLL = 8
FOLD_COLS_PER_WARP = 128
REDUCE_UNROLL = 32
REDUCE_BLOCK_N = 128
# Configs cached per shape; a training run sees few shapes, variable lengths many.
MAX_CACHED_CONFIGS = 4096



# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0):
    """Eager RMSNorm with fp32 math (float64 when given float64); autograd gives its backward."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_reference: weight must be 1-D of size {x.shape[-1] if x.dim() else 0} (x's last "
                         f"dim), got shape {tuple(weight.shape)}")
    xf = x.float() if x.dtype != torch.float64 else x
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    wf = weight.float() if weight.dtype != torch.float64 else weight
    return (xf * rstd * (offset + wf)).to(x.dtype)


# --------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # rows per tile
    block_n: int  # columns per tile: the whole row, or one chunk when looped
    num_warps: int
    looped: bool  # the row is longer than one tile
    row_grid: tuple[int]  # forward (and row-dot) grid: one program per row block
    n_parts: int  # dW partial rows G (the backward grid is (column stripes, G))
    max_parts: int  # the most G any row count gets at this N on this device
    bwd_grid: tuple[int, int]
    group_size: int  # partial rows summed per group (see rmsnorm_kernels._sum_rows)
    counters_used: int  # arrival counters the folded backward needs
    n_counters: int  # counter slots after rstd that the forward zeroes (a function of N only)
    fold_block_n: int  # columns per step of the folded reduction
    # Each kernel's launch with this config's meta bound (see triton_support.Launcher): the
    # eager path pays only the specialization key and the C launcher per call.
    forward: Launcher = field(compare=False, repr=False)  # stores rstd and zeroes the counters
    forward_no_stats: Launcher = field(compare=False, repr=False)
    backward: Launcher = field(compare=False, repr=False)  # dW reduced in the same launch
    backward_partials: Launcher = field(compare=False, repr=False)
    row_dot: Launcher = field(compare=False, repr=False)
    # The forward's and the backward's specializations as DirectLaunches (no key, no lookup)
    direct: KeptLaunches = field(default_factory=KeptLaunches, compare=False, repr=False)


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _ceil_sqrt(n: int) -> int:
    return math.isqrt(n - 1) + 1 if n > 1 else 1


def dw_group_size(n_partials: int) -> int:
    """Partial rows per group: sqrt(G) keeps the last program's two serial sums short."""
    return _ceil_sqrt(n_partials)


_KERNELS_COMPILED = not interpreted()  # compiled for a GPU: what auto's routing to torch's kernel is about


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_configs: dict[tuple, LaunchConfig] = {}


def _launch_config(n_rows: int, n_cols: int, device: torch.device) -> LaunchConfig:
    # Cached, as host time per call counts at training sizes. The key holds everything the
    # heuristic reads: SUITE_PROFILE (read by smem_limit) and MAX_FUSED_N too.
    key = (n_rows, n_cols, device, os.environ.get("SUITE_PROFILE"), MAX_FUSED_N)
    config = _configs.get(key)
    if config is None:
        if len(_configs) >= MAX_CACHED_CONFIGS:
            _configs.clear()
        config = _configs[key] = _compute_launch_config(n_rows, n_cols, device)
    return config


def _compute_launch_config(n_rows: int, n_cols: int, device: torch.device) -> LaunchConfig:
    # A whole fp32 tile must fit in shared memory, so that any layout conversion Triton stages
    # through it fits too: 16384 values on the RTX profile (99 KiB).
    max_tile = _prev_pow2(smem_limit(device) // 4)
    fused_limit = min(MAX_FUSED_N, max_tile)
    looped = n_cols > fused_limit
    block_n = min(LOOPED_BLOCK_N, _prev_pow2(fused_limit)) if looped else triton.next_power_of_2(n_cols)
    if device.type == "cuda" and _KERNELS_COMPILED:
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
    row_blocks = cdiv(n_rows, block_m)
    n_stripes = cdiv(n_cols, block_n)
    # Fewer row groups for more stripes keeps the program count, and the partials, bounded.
    max_parts = max(1, max_programs // n_stripes)
    n_parts = max(1, min(row_blocks, max_parts))
    group_size = dw_group_size(n_parts)
    # Per stripe, one counter per group and one over the groups; there are at most
    # ceil(sqrt(max_parts)) groups, so the forward can zero enough slots knowing N alone.
    n_counters = n_stripes * (_ceil_sqrt(max_parts) + 1)
    counters_used = n_stripes * (cdiv(n_parts, group_size) + 1)
    fold_block_n = min(block_n, FOLD_COLS_PER_WARP * num_warps)
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n)

    def forward(store_stats: bool) -> Launcher:
        return launcher(kernels.rms_norm_fwd_kernel, **tile, LOOPED=looped, STORE_STATS=store_stats, num_warps=num_warps)

    def backward(reduce_dw: bool) -> Launcher:
        return launcher(kernels.rms_norm_bwd_kernel, **tile, ROW_FITS=not looped, REDUCE_DW=reduce_dw,
                        FOLD_BLOCK_N=fold_block_n, UNROLL=FOLD_UNROLL, num_warps=num_warps)

    return LaunchConfig(
        block_m, block_n, num_warps, looped, (row_blocks,), n_parts, max_parts, (n_stripes, n_parts), group_size,
        counters_used, n_counters, fold_block_n,
        forward=forward(True), forward_no_stats=forward(False), backward=backward(True),
        backward_partials=backward(False), row_dot=launcher(kernels.rms_norm_bwd_row_dot_kernel, **tile, num_warps=num_warps),
    )


def forget() -> None:
    """Drop what is kept per device (launch configs, SM counts, dW workspaces): the next call
    chooses again (the cross-compiler swaps the card under them)."""
    _configs.clear()
    _workspaces.clear()
    _sm_count.cache_clear()


def _counter_slots(n_cols: int, device: torch.device) -> int:
    """Counter slots the forward puts after the rstd: a function of N and the device only (any
    row count gives the same), so a fake tensor with a symbolic row count has its size."""
    return _launch_config(1, n_cols, device).n_counters


# --------------------------------------------------------------------------------------------
# Launches. The private functions take (M, N) tensors with unit column stride and the config,
# and check nothing: the autograd path calls them, having checked once. Outputs come from
# empty_like (cheaper than empty(shape, dtype, device)): an (M, N) tensor with unit column
# stride is contiguous unless it has gaps between rows, and then empty_like is contiguous too.
# --------------------------------------------------------------------------------------------


def _forward(x2d, weight, eps: float, offset: float, cfg: LaunchConfig, with_stats: bool):
    """-> (y, stats or None); without stats (no backward to come) the rstd is not stored."""
    n_rows, n_cols = x2d.shape
    device = x2d.device
    y = torch.empty_like(x2d)
    if not with_stats:
        if n_rows:
            cfg.forward_no_stats(cfg.row_grid, x2d, weight, y, y, x2d.stride(0), n_rows, n_cols, cfg.n_counters, eps, offset)
        return y, None
    stats = torch.empty(n_rows + cfg.n_counters, dtype=torch.float32, device=device)
    if n_rows:
        # y follows x's dtype, stats is fp32
        cfg.direct(cfg.forward, cfg.row_grid, (x2d.dtype, weight.dtype), (x2d, weight, y, stats),
                   (x2d.stride(0), n_rows, n_cols, cfg.n_counters, eps, offset))
    return y, stats


def _backward(dy2d, x2d, weight, stats, offset: float, cfg: LaunchConfig, reduce_dw: bool, dw=None, partials=None):
    """-> (dx, dw) with reduce_dw, else (dx, dW partials); nothing launched when M is 0. With
    reduce_dw, `dw` is where the reduced dW goes; `partials` the rows the launch writes the dW
    partials to (the eager path passes both, see _RMSNormFunction); new tensors when None."""
    n_rows, n_cols = x2d.shape
    device = x2d.device
    dx = torch.empty_like(x2d)
    if n_rows == 0:
        if reduce_dw:
            return dx, (torch.zeros(n_cols, dtype=weight.dtype, device=device) if dw is None else dw.zero_())
        return dx, torch.empty((0, n_cols), dtype=torch.float32, device=device)
    if reduce_dw:
        if partials is None:
            partials = torch.empty((cfg.n_parts, n_cols), dtype=torch.float32, device=device)
        if dw is None:
            dw = torch.empty(n_cols, dtype=weight.dtype, device=device)
    else:
        if partials is None:
            partials = torch.empty((cfg.n_parts, n_cols), dtype=torch.float32, device=device)
        partials = dw = partials[:cfg.n_parts]
    if cfg.looped:
        gx_sum = torch.empty(n_rows, dtype=torch.float32, device=device)
        cfg.row_dot(cfg.row_grid, dy2d, x2d, weight, gx_sum, dy2d.stride(0), x2d.stride(0), n_rows, n_cols, offset)
    else:
        gx_sum = stats  # unread when a stripe holds the whole row
    # dx follows x's dtype, dw weight's (or fp32 partials), stats and gx_sum are fp32
    cfg.direct(cfg.backward if reduce_dw else cfg.backward_partials, cfg.bwd_grid,
               (dy2d.dtype, x2d.dtype, weight.dtype), (dy2d, x2d, weight, stats, gx_sum, dx, partials, dw),
               (dy2d.stride(0), x2d.stride(0), n_rows, n_cols, offset, cfg.group_size))
    return dx, dw


# The folded backward's dW partials are read back within its own launch, so on CUDA one buffer
# per (device, stream, N) serves every eager backward on that stream, which runs them one after
# another: an allocation less per call on autograd's device thread (see _RMSNormFunction). It
# has the most partial rows any row count gets at that N (the kernel uses the first G), so a
# model keeps one per hidden size and stream: 4.3 MB at N = 4096 on the H200. A CUDA-graph
# capture allocates its own (its replays may run beside eager calls on another stream), and so
# does torch.compile's custom op, whose warm-ups can allocate from a graph's private pool.
MAX_WORKSPACES = 16
_workspaces: dict[tuple, torch.Tensor] = {}


def _partials_workspace(cfg: LaunchConfig, n_cols: int, device: torch.device) -> torch.Tensor | None:
    """The stream's dW-partials buffer for cfg, or None where the backward allocates its own."""
    if device.type != "cuda" or _capturing():
        return None
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index), n_cols, cfg.max_parts)
    workspace = _workspaces.get(key)
    if workspace is None:
        if len(_workspaces) >= MAX_WORKSPACES:
            _workspaces.clear()
        workspace = _workspaces[key] = torch.empty((cfg.max_parts, n_cols), dtype=torch.float32, device=device)
    return workspace


# --------------------------------------------------------------------------------------------
# Building blocks (a gate builds its saboteurs from these)
# --------------------------------------------------------------------------------------------


def _require_operands(t: torch.Tensor, **others: torch.Tensor) -> None:
    """t where the kernels run, every other operand beside it, stats the forward's fp32 ones."""
    require_runnable(t, "rms_norm", '; use rms_norm_reference or RMSNorm(impl="eager") on the CPU', **others)
    stats = others.get("stats")
    if stats is not None and stats.dtype != torch.float32:
        raise TypeError(f"rms_norm: stats must be the forward's fp32 stats, got {stats.dtype}")


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride (kernels take a row stride but assume adjacent
    columns); copies only when the columns are not adjacent or the rows cannot be one stride."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _unit_col_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm_forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """(M, N) x -> (y contiguous (M, N) in x's dtype, stats fp32).

    stats[:M] is rstd; the words after it are the folded backward's arrival counters (zeroed
    here, so each forward gives its backward a slot set of its own).
    """
    _require_operands(x2d, weight=weight)
    cfg = _launch_config(x2d.shape[0], x2d.shape[1], x2d.device)
    with on_device_of(x2d):
        return _forward(_unit_col_stride(x2d), _unit_col_stride(weight), float(eps), float(offset), cfg, True)


def rms_norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor, offset: float):
    """Stage one of two: -> (dx contiguous (M, N) in x's dtype, dW partials fp32 [G, N]); G is 0
    when M is. `stats` is the forward's (only its rstd is read)."""
    _require_operands(x2d, dy=dy2d, weight=weight, stats=stats)
    cfg = _launch_config(x2d.shape[0], x2d.shape[1], x2d.device)
    dy2d, x2d, weight = _unit_col_stride(dy2d), _unit_col_stride(x2d), _unit_col_stride(weight)
    with on_device_of(x2d):
        return _backward(dy2d, x2d, weight, stats, float(offset), cfg, reduce_dw=False)


def reduce_dw_partials(dw_partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stage two: sum the [G, N] fp32 partials over G in the folded backward's fixed order,
    into dW of `dtype`."""
    n_parts, n_cols = dw_partials.shape
    if n_parts == 0:
        return torch.zeros(n_cols, dtype=dtype, device=dw_partials.device)
    _require_operands(dw_partials)
    dw = torch.empty(n_cols, dtype=dtype, device=dw_partials.device)
    with on_device_of(dw_partials):
        launch(
            kernels.reduce_dw_partials_kernel, (cdiv(n_cols, REDUCE_BLOCK_N),),
            dw_partials.contiguous(), dw, n_parts, n_cols, dw_group_size(n_parts),
            BLOCK_N=REDUCE_BLOCK_N, UNROLL=REDUCE_UNROLL, num_warps=4,
        )
    return dw


def rms_norm_backward_reduced(
    dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor, offset: float
):
    """-> (dx contiguous (M, N) in x's dtype, dW in weight's dtype), dW reduced in the same
    launch; the same bits as `rms_norm_backward` then `reduce_dw_partials`. `stats` must come
    from `rms_norm_forward` of the same shape (its counters are used, and left at zero)."""
    _require_operands(x2d, dy=dy2d, weight=weight, stats=stats)
    cfg = _launch_config(x2d.shape[0], x2d.shape[1], x2d.device)
    if stats.shape[0] < x2d.shape[0] + cfg.counters_used:
        # stats from a forward under another config (SUITE_PROFILE changed in between): the
        # two-stage path needs no counters.
        dx, partials = rms_norm_backward(dy2d, x2d, weight, stats, offset)
        return dx, reduce_dw_partials(partials, weight.dtype)
    dy2d, x2d, weight = _unit_col_stride(dy2d), _unit_col_stride(x2d), _unit_col_stride(weight)
    with on_device_of(x2d):
        return _backward(dy2d, x2d, weight, stats, float(offset), cfg, reduce_dw=True)


# --------------------------------------------------------------------------------------------
# Autograd, torch.compile and public API
# --------------------------------------------------------------------------------------------


def _prepare(x: torch.Tensor, weight: torch.Tensor):
    """-> (x as (M, N) rows, weight with unit stride, config)."""
    x2d = _as_rows(x)
    device = x2d.device
    if device.type != "cuda":
        _require_operands(x2d)
    return x2d, _unit_col_stride(weight), _launch_config(x2d.shape[0], x2d.shape[1], device)


def _y_like(y2d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return y2d if like.dim() == 2 else y2d.view(like.shape)


class _RMSNormFunction(torch.autograd.Function):
    """The eager path: an autograd.Function, a fraction of a custom op's host time a call.

    An eager forward+backward hands the backward to autograd's device thread and back, and every
    piece of Python costs two to three times what it costs alone (docs/arms/rmsnorm.md),
    so the work is kept small: dW's buffer (N values) is allocated in the forward, the dW
    partials come from the stream's workspace (`_partials_workspace`), and the backward
    allocates dx and launches once (rows that loop: one allocation and one launch more). A
    weight that needs no gradient (frozen, or an unweighted norm's ones) gets no dW: the launch
    leaves its partials unsummed."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        x2d, weight, cfg = _prepare(x, weight)
        y, stats = _forward(x2d, weight, eps, offset, cfg, with_stats=True)
        ctx.save_for_backward(x2d, weight, stats)
        ctx.offset, ctx.cfg = offset, cfg
        ctx.dw = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device) if weight.requires_grad else None
        return _y_like(y, x)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, stats = ctx.saved_tensors
        # a second backward of the same graph (retain_graph) must not write into the dW the
        # first one returned
        dw, ctx.dw = ctx.dw, None
        partials = _partials_workspace(ctx.cfg, x2d.shape[1], x2d.device) if x2d.shape[0] else None
        want_dw = ctx.needs_input_grad[1]
        dx, dw = _backward(_as_rows(dy), x2d, weight, stats, ctx.offset, ctx.cfg, reduce_dw=want_dw, dw=dw,
                           partials=partials)
        return _y_like(dx, dy), dw if want_dw else None, None, None


# Under torch.compile the same kernels run as custom ops: opaque to dynamo (no graph break),
# shapes from the fake implementations. stats is not declared mutated by the backward op: its
# counters are back at zero when the op's launch ends.
@torch.library.custom_op("suite::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2d, weight, cfg = _prepare(x, weight)
    with on_device_of(x2d):  # as the eager path: an op called outside Inductor's device guard
        y, stats = _forward(x2d, weight, eps, offset, cfg, with_stats=True)
    return y.view(x.shape), stats


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, offset):
    n_cols = x.shape[-1]
    # the hidden size picks the config, so it is specialised on (int() guards on it)
    stats = x.new_empty(x.numel() // n_cols + _counter_slots(int(n_cols), x.device), dtype=torch.float32)
    return x.new_empty(x.shape), stats


@torch.library.custom_op("suite::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stats: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    dx, dw = rms_norm_backward_reduced(_as_rows(dy), _as_rows(x), weight, stats, offset)
    return dx.view(x.shape), dw


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, stats, offset):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup_context(ctx, inputs, output):
    x, weight, _, offset = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.offset = offset


def _op_backward(ctx, dy, _dstats):
    x, weight, stats = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(dy, x, weight, stats, ctx.offset)
    return dx, dw, None, None


_rms_norm_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _validate(x: torch.Tensor, weight: torch.Tensor) -> None:
    for name, value in (("x", x), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"rms_norm: {name} must be a tensor, got {type(value).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rms_norm: x must be bfloat16, float16 or float32, not {x.dtype}")
    if weight.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rms_norm: weight must be bfloat16, float16 or float32, not {weight.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"rms_norm: x must have a non-empty last (hidden) dim, got shape {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of size {x.shape[-1]} (x's last dim), got shape {tuple(weight.shape)}"
        )
    if weight.device != x.device:
        raise ValueError(f"rms_norm: x is on {x.device} but weight is on {weight.device}")


# Below these sizes `rms_norm` (impl="auto") calls torch's native kernel in eager CUDA calls: there
# a loop is bound by the host, and ours costs more host time per call though less device time
# (a backward raises the bar: more device time to win back). Measurements: docs/tuning.md.
NATIVE_BELOW = 1 << 25  # 33.6 M elements, a forward alone
NATIVE_BELOW_WITH_GRAD = 1 << 27  # 134 M elements, a forward that a backward follows
IMPLS = ("auto", "fused")


# Bound once: on the routed path every attribute lookup is host time the native op does not pay.
_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False)
# The native fused op itself, which torch.rms_norm reaches through one more dispatch (its
# composite's checks): the same kernels and autograd node, so the same bits, for less host time.
_native_rms_norm = torch._fused_rms_norm
_FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)


def _checked_scalars(eps, offset, fn: str = "rms_norm") -> tuple[float, float]:
    """eps and offset as floats, or a ValueError: a string, a negative or a NaN eps (or a
    non-finite offset) would give NaN rows without a word."""
    for name, value, lowest in (("eps", eps, 0.0), ("offset", offset, -math.inf)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not lowest <= float(value) < math.inf:
            bound = "a finite number >= 0" if name == "eps" else "a finite number"
            raise ValueError(f"{fn}: {name} must be {bound}, got {value!r}")
    return float(eps), float(offset)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
             impl: str = "auto") -> torch.Tensor:
    """RMSNorm over x's last dim; y in x's dtype, dx in x's dtype, dw in weight's dtype.

    impl="fused": our Triton kernels. impl="auto" (the default): the same, except where an eager
    loop runs faster on torch's native kernel (small CUDA tensors, outside
    torch.compile and CUDA-graph capture), which then computes it."""
    if not (type(eps) is float and 0.0 <= eps < math.inf and type(offset) is float and math.isfinite(offset)):
        eps, offset = _checked_scalars(eps, offset)  # the plain floats above are the hot path
    if impl == "auto":
        # Inside a CUDA-graph capture (and torch.compile) the host's cost is paid once: ours, the
        # faster kernels, everywhere.
        try:
            # A compiled CUDA launch (not the interpreter), x and weight of one dtype (the native
            # op's own rule), of the size class where ours loses on the host: larger when a
            # backward follows. Written inline, as each call here is host time F.rms_norm does
            # not pay; grad state is read only in the class where it decides.
            dtype = x.dtype
            native = (x.is_cuda and dtype is weight.dtype and _KERNELS_COMPILED
                      and ((numel := x.numel()) < NATIVE_BELOW
                           or numel < NATIVE_BELOW_WITH_GRAD and _grad_enabled()
                           and (x.requires_grad or weight.requires_grad))
                      and dtype in _FLOAT_DTYPE_SET and weight.dim() == 1 and not _compiling() and not _capturing())
        except AttributeError:
            native = False  # not tensors: _validate below names which
        if native:
            try:
                return _native_rms_norm(x, weight.shape, weight if offset == 0.0 else weight + offset, eps)[0]
            except RuntimeError:
                pass  # what the native op refuses gets _validate's clearer error below
    elif impl != "fused":
        raise ValueError(f"rms_norm: impl must be one of {IMPLS}, not {impl!r}")
    _validate(x, weight)
    eps, offset = float(eps), float(offset)
    if torch.compiler.is_compiling():
        return _rms_norm_fwd_op(x, weight, eps, offset)[0]
    if x.is_cuda and x.get_device() != torch._C._cuda_getDevice():
        with torch.cuda.device(x.device):  # Triton launches on the current device
            return rms_norm(x, weight, eps, offset, impl="fused")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps, offset)
    x2d, weight, cfg = _prepare(x, weight)
    return _y_like(_forward(x2d, weight, eps, offset, cfg, with_stats=False)[0], x)


class RMSNorm(nn.Module):
    """impl: "auto" (our kernels, torch's native one where it is faster eagerly, see rms_norm),
    "fused" (always our kernels) or "eager" (the reference)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, impl: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        if impl not in (*IMPLS, "eager"):
            raise ValueError(f'RMSNorm: impl must be "auto", "fused" or "eager", not {impl!r}')
        if not isinstance(hidden_size, int) or isinstance(hidden_size, bool) or hidden_size < 1:
            raise ValueError(f"RMSNorm: hidden_size must be an int >= 1, got {type(hidden_size).__name__} {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps, self.offset = _checked_scalars(eps, offset, "RMSNorm")
        self.impl = impl
        # Initial scale offset + w is 1.
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - self.offset, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "eager":
            return rms_norm_reference(x, self.weight, self.eps, self.offset)
        return rms_norm(x, self.weight, self.eps, self.offset, impl=self.impl)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}, impl={self.impl!r}"
