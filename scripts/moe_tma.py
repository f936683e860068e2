"""TMA-fed variants of the MoE arm's grouped GEMMs, for scripts/moe_tune.py's experiments.

The arm's kernels load every operand tile through pointers (cp.async on sm90). Here the
tiles that need no gather come through tensor descriptors instead (Triton 3.6's
TensorDescriptor: the copy engine fills shared memory, out-of-bounds elements read as zero):
both operands of the rows GEMMs (down, dx), and the weights of the up GEMM, whose x rows
stay gathered by token through pointers. The tiling, tile order and sums are the arm's
(`_expert_tile`, `_tile_ids`, `_dot`, fp32 accumulators, one K pass per operand pair): only
the loads differ, so the outputs should be its kernels' bits, which moe_tune checks. A row tile's A load may run past its expert's rows
into the next expert's (their products are computed and never stored) or past the tensor
(zeros). Timed against the arm's kernels by `moe_tune.py --kernel expert_down_tma ...`;
checked there against their outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from suite.arms.moe_kernels import (GemmConfig, _cdiv, _dot, _expert_tile, _row_tile_grid, _tile_ids, _tile_tokens,
                                    _upcast)
from suite.arms.triton_support import next_pow2


@triton.jit
def _weight_tile(W, expert, k0, col0, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, W_NK: tl.constexpr):
    """W[expert][k0:k0+BLOCK_K, col0:col0+BLOCK_N] as a [BLOCK_K, BLOCK_N] tile; W_NK: the weight
    is stored [E, N, K] (a transposed operand) and its tile is loaded [BLOCK_N, BLOCK_K]."""
    if W_NK:
        tile = tl.trans(tl.reshape(W.load([expert, col0, k0]), [BLOCK_N, BLOCK_K]))
    else:
        tile = tl.reshape(W.load([expert, k0, col0]), [BLOCK_K, BLOCK_N])
    return tile


@triton.jit
def _rows_tma_kernel(
    A, A2, W, W2, OFFSETS, C, n_experts, n_k, n_n, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, W_NK: tl.constexpr, TWO: tl.constexpr, UPCAST: tl.constexpr,
):
    """C[r] = A[r] @ W[e] (+ A2[r] @ W2[e]), as `_rows_gemm_kernel`, A and W through descriptors."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        col0 = tile_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            acc = _dot(A.load([row_start, k0]), _weight_tile(W, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK), acc, UPCAST)
        if TWO:
            for k0 in range(0, n_k, BLOCK_K):
                acc = _dot(A2.load([row_start, k0]), _weight_tile(W2, expert, k0, col0, BLOCK_K, BLOCK_N, W_NK),
                           acc, UPCAST)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        mask = (rows < row_end)[:, None] & (cols < n_n)[None, :]
        tl.store(C + rows.to(tl.int64)[:, None] * n_n + cols[None, :], acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _up_tma_kernel(
    X, W_GATE, W_UP, TOKEN_OF_ROW, OFFSETS, A, G, U, n_experts, d, f, stride_x, n_tiles_m, n_tiles_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
):
    """a, g, u as `_up_kernel` (SAVE), x's rows gathered through pointers, the weights' tiles
    through descriptors."""
    tile_m, tile_n = _tile_ids(n_tiles_m, n_tiles_n, GROUP_M)
    expert, row_start, row_end = _expert_tile(OFFSETS, n_experts, tile_m, BLOCK_M, BLOCK_E)
    if expert < n_experts:
        rows, row_mask, tokens = _tile_tokens(TOKEN_OF_ROW, row_start, row_end, BLOCK_M)
        col0 = tile_n * BLOCK_N
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = X + tokens[:, None] * stride_x + ks[None, :]
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, d, BLOCK_K):
            x = tl.load(x_ptrs, mask=row_mask[:, None] & (ks < d - k0)[None, :], other=0.0)
            acc_g = _dot(x, _weight_tile(W_GATE, expert, k0, col0, BLOCK_K, BLOCK_N, False), acc_g, UPCAST)
            acc_u = _dot(x, _weight_tile(W_UP, expert, k0, col0, BLOCK_K, BLOCK_N, False), acc_u, UPCAST)
            x_ptrs += BLOCK_K
        a = acc_g * tl.sigmoid(acc_g) * acc_u
        cols = col0 + tl.arange(0, BLOCK_N)
        out = rows.to(tl.int64)[:, None] * f + cols[None, :]
        mask = row_mask[:, None] & (cols < f)[None, :]
        tl.store(A + out, a.to(A.dtype.element_ty), mask=mask)
        tl.store(G + out, acc_g.to(G.dtype.element_ty), mask=mask)
        tl.store(U + out, acc_u.to(U.dtype.element_ty), mask=mask)


def _weights(w: torch.Tensor, block_k: int, block_n: int, transposed: bool) -> TensorDescriptor:
    """A descriptor of the [E, K, N] weight, or of its [E, N, K] storage when transposed."""
    if transposed:
        return TensorDescriptor.from_tensor(w, [1, block_n, block_k])
    return TensorDescriptor.from_tensor(w, [1, block_k, block_n])


def rows_tma(cfg: GemmConfig, a, w, offsets, c, a2=None, w2=None, transposed: bool = False) -> None:
    """c[r] = a[r] @ W[e] (+ a2[r] @ W2[e]) over the ragged rows at tile cfg; W[e] is w[e] ([E, K,
    N], contiguous), or w[e]^T when transposed (w then [E, N, K], as dx reads w_gate and w_up)."""
    n_rows, n_k = a.shape
    n_experts, n_n = w.shape[0], c.shape[1]
    tiles = (_cdiv(n_rows, cfg.block_m) + n_experts, _cdiv(n_n, cfg.block_n))
    a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
    w_desc = _weights(w, cfg.block_k, cfg.block_n, transposed)
    two = a2 is not None
    a2_desc = TensorDescriptor.from_tensor(a2, [cfg.block_m, cfg.block_k]) if two else a_desc
    w2_desc = _weights(w2, cfg.block_k, cfg.block_n, transposed) if two else w_desc
    _rows_tma_kernel[_row_tile_grid(tiles, cfg)](
        a_desc, a2_desc, w_desc, w2_desc, offsets, c, n_experts, n_k, n_n, *tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
        GROUP_M=cfg.group_m, W_NK=transposed, TWO=two, UPCAST=_upcast(a.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def up_tma(cfg: GemmConfig, x, w_gate, w_up, token_of_row, offsets, a, g, u) -> None:
    """expert_up's a, g and u at tile cfg, the weights' tiles through descriptors."""
    n_rows = token_of_row.shape[0]
    n_experts, d, f = w_gate.shape
    tiles = (_cdiv(n_rows, cfg.block_m) + n_experts, _cdiv(f, cfg.block_n))
    _up_tma_kernel[_row_tile_grid(tiles, cfg)](
        x, _weights(w_gate, cfg.block_k, cfg.block_n, False), _weights(w_up, cfg.block_k, cfg.block_n, False),
        token_of_row, offsets, a, g, u, n_experts, d, f, x.stride(0), *tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_pow2(n_experts),
        GROUP_M=cfg.group_m, UPCAST=_upcast(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
