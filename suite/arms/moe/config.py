"""The experts' launch choices, each made once per call shape: the tile of every GEMM kind
(`gemm_config`), the combines' tile (`combine_config`), and which path a layer's GEMMs take
on this card (`tma_gemms`: TMA descriptors; `vendor_gemms`: torch._grouped_mm for the weight
gradients and d_a). Every threshold is a measured rule (docs/tuning.md has the figures and the
commands that re-measure them). `forced(...)` overrides them for the calls inside, which is
how scripts/moe_tune.py sweeps tiles and paths.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from suite.device_profile import active_profile, smem_limit
from suite.triton_support import interpreted, next_pow2


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
    group_m: int = 0  # tile order: 0 the 2-D grid, > 0 groups of that many row tiles (kernels._tile_ids)

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
# tiles in groups so a group's A rows stay in L2 across the column tiles (kernels._tile_ids).
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
# The widest B tile of a kind with two of them under the rtx profile (see choose_gemm_config).
_RTX_TWO_TILE_N = 64
# Average rows per expert below which a 128-row tile is mostly masked (decode-like batches):
# 64-row tiles at 4 warps there (not measured: no bench preset has under 512 rows an expert).
_MANY_ROWS = 128
# Shared memory the compiler takes beyond a config's operand buffers, kept twice over the most
# a kernel of ours took on the H200 (docs/gpu-notes.md).
_SMEM_SCRATCH = 8192


# Chosen tiles, kept per call shape: choosing one costs about half an entry point's host time
# (launches stubbed: `python scripts/moe_host_probe.py --calls 1000` on a CPU).
MAX_KEPT_CONFIGS = 256
_gemm_configs: dict[tuple, GemmConfig] = {}
# what holds a choice per call shape: emptied when `forced` starts and ends (launch adds its plans)
kept_choices: list[dict] = [_gemm_configs]
_forced: dict[str, object] = {}


@contextlib.contextmanager
def forced(*, gemm: Callable[..., GemmConfig] | None = None, combine: Callable[..., "CombineConfig"] | None = None,
           tma: bool | None = None) -> Iterator[None]:
    """The choices of the calls inside: gemm(kind, rows, n, dtype, device, weight_elems) gives
    each GEMM's tile, combine(n_tokens, d, device) the combines', tma whether the row GEMMs take
    TMA descriptors; what is not given is chosen as always. Choices kept per call shape are
    dropped on the way in and out, so none made inside outlives the block."""
    given = {name: value for name, value in (("gemm", gemm), ("combine", combine), ("tma", tma)) if value is not None}
    saved = dict(_forced)
    forget()
    _forced.update(given)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)
        forget()


def forget() -> None:
    """Drop every choice kept per call shape: the next call of each shape chooses again."""
    for kept in kept_choices:
        kept.clear()


def gemm_config(kind: str, rows: int, n: int, dtype: torch.dtype, device, weight_elems: int = 0) -> GemmConfig:
    """The tile of GEMM `kind` (GEMM_KINDS) for `rows` average rows per expert (for a weight
    gradient, the weight's rows) and n output columns, held to the device profile's shared
    memory; weight_elems: a weight gradient's elements per expert."""
    if "gemm" in _forced:
        return _forced["gemm"](kind, rows, n, dtype, device, weight_elems)
    # the key holds everything the choice reads, SUITE_PROFILE (smem_limit's) too
    key = (kind, rows, n, dtype, device, weight_elems, os.environ.get("SUITE_PROFILE"), interpreted())
    config = _gemm_configs.get(key)
    if config is None:
        if len(_gemm_configs) >= MAX_KEPT_CONFIGS:
            _gemm_configs.clear()
        config = _gemm_configs[key] = choose_gemm_config(kind, rows, n, dtype, device, weight_elems)
    return config


def choose_gemm_config(kind: str, rows: int, n: int, dtype: torch.dtype, device, weight_elems: int = 0) -> GemmConfig:
    """`gemm_config`'s choice itself, made anew (nothing kept, nothing forced)."""
    (n_a, n_b), (block_m, block_n, block_k, stages, num_warps, group_m) = GEMM_KINDS[kind]
    itemsize = dtype.itemsize
    if interpreted() and device.type != "cuda":
        # test shapes still take several tiles, steps, groups and masked edges; a whole tiny
        # model's take two tiles a side, not four, as the interpreter runs programs one by one
        def two_tiles(size: int) -> int:
            return max(16, min(64, next_pow2(size) // 2))

        return GemmConfig(two_tiles(rows), two_tiles(n), 16, 4, 1, n_a, n_b, itemsize, 2 if group_m else 0)
    if rows < _MANY_ROWS:
        block_m, block_n, num_warps = 64, min(block_n, 128), 4
    if kind == "weight_grad_two" and weight_elems >= _BIG_WEIGHT:
        block_m, block_n, group_m = 256, 64, 16
    if n_b == 2 and active_profile(device) == "rtx":
        # sm_120 keeps the accumulators and the pointer tiles in registers: two 128x128
        # accumulators spill there, two 128x64 do not (ptxas; docs/tuning.md)
        block_n = min(block_n, _RTX_TWO_TILE_N)
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


def vendor_gemms(n_rows: int, n_experts: int, d: int, f: int, dtype: torch.dtype, device) -> bool:
    """Whether a layer of this shape takes torch._grouped_mm for its weight gradients and d_a:
    only on sm90 (`_measured_on_sm90`), where torch runs its CUTLASS grouped GEMMs (on sm120
    and older cards it copies the offsets to the host, a sync, and loops over the experts; on
    sm100 an expert with no rows has been reported to get a nonzero weight gradient,
    pytorch/pytorch#172439)."""
    return _measured_on_sm90(n_rows, n_experts, d, f, dtype, device)


def tma_gemms(n_rows: int, n_experts: int, d: int, f: int, dtype: torch.dtype, device) -> bool:
    """Whether a layer of this shape feeds its row GEMMs (up, down, d_a, dx) through TMA
    descriptors (`up_tma_kernel`, `rows_tma_kernel`): with the same bits, the layer's GEMMs
    took less time together than on the pointer kernels at every layer measured on the H200,
    though a few lost alone (down at mixtral on one of two machines and on a model's [E, out,
    in] weights, dx there too; d_a at mixtral and top2-small, where it runs on grouped_mm,
    `vendor_gemms`); scripts/moe_tune.py, docs/tuning.md. Not measured on sm100 or the RTX
    card (sm120, whose tiles the rtx profile holds), nor at smaller layers, where a descriptor
    launch's host time weighs more: those keep the pointer kernels (`_measured_on_sm90`)."""
    if "tma" in _forced:
        return _forced["tma"]
    return _measured_on_sm90(n_rows, n_experts, d, f, dtype, device)


def grouped_mm_ready(*operands: torch.Tensor) -> bool:
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


# The SwiGLU backward's elementwise pass: elements a program (bf16: 16 a thread at 4 warps), in
# tiles of at most SWIGLU_COLUMNS columns (a row's run of f, or of gate's or up's half).
SWIGLU_BLOCK = 2048
SWIGLU_COLUMNS = 256


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


def combine_config(n_tokens: int, d: int, device) -> CombineConfig:
    if "combine" in _forced:
        return _forced["combine"](n_tokens, d, device)
    if interpreted() and device.type != "cuda":
        return CombineConfig(8, 16, 4)  # several programs and masked edges at test sizes
    return CombineConfig(COMBINE.block_t, min(COMBINE.block_d, max(16, next_pow2(d))), COMBINE.num_warps)


