"""MoE routing in two launches: router logits [T, E] to the expert-sorted layout of `Routing`.

    _route_kernel    softmax in fp32, the top k experts of each token (chosen on the logits, so
                     the choice does not hang on exp's rounding; ties to the lower id), their
                     probabilities (renormalised over the k when asked), logsumexp per token
                     for the z-loss, and each program's count of rows per expert
    _layout_kernel   each program's first row per expert from the counts of the programs before
                     it, then per slot in flat (token, slot) order its rank within its expert:
                     offsets, row_id_map, source_of_row, token_of_row, routed_counts, z-loss

A program covers a contiguous run of tokens, so ranks follow token order as `Routing` promises,
and every sum runs in a fixed order: the layout and its bits repeat run to run. No host sync;
the launch grids depend on T and E alone. `_route_backward_kernel` is the backward in one
launch: dlogits through the renormalised probabilities and the z-loss, the softmax recomputed
from the logits and the saved logsumexp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from suite.triton_support import interprets, launch_kept, next_pow2

# Programs of a routing launch, at most: each layout program reads every program's counts
# (programs x E each), so their number is held down and a program loops over its tokens.
MAX_PROGRAMS = 128
# Elements of a [tokens, experts] tile a program holds at once (fp32 logits, int32 one-hots).
TILE_ELEMENTS = 4096
INTERPRETED_TILE = 64


@triton.jit
def _route_kernel(
    LOGITS, IDS, PROBS, LSE, COUNTS, ZPART,
    n_tokens, n_experts, stride_l, tokens_per_program,
    K: tl.constexpr, CHOOSE: tl.constexpr, RENORMALIZE: tl.constexpr, Z_LOSS: tl.constexpr,
    TIES_HIGH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """CHOOSE: pick the top K of each token's logits into IDS [T, K] and PROBS [T, K], LSE [T];
    else read the choice from IDS. Either way COUNTS[pid, e] = this program's rows of expert e,
    and with Z_LOSS ZPART[pid] = its sum of lse^2. TIES_HIGH: ties to the higher id (the gate's
    saboteur, never the arm)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < n_experts
    slots = tl.arange(0, BLOCK_K)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    z_part = tl.zeros([BLOCK_T], dtype=tl.float32)
    first = pid * tokens_per_program
    last = tl.minimum(first + tokens_per_program, n_tokens)
    for t0 in range(first, last, BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        token_mask = tokens < last
        if CHOOSE:
            mask = token_mask[:, None] & expert_mask[None, :]
            wide_tokens = tokens.to(tl.int64)
            logits = tl.load(LOGITS + wide_tokens[:, None] * stride_l + experts[None, :], mask=mask,
                             other=float("-inf")).to(tl.float32)
            peak = tl.where(token_mask, tl.max(logits, axis=1), 0.0)
            exps = tl.exp(logits - peak[:, None])
            total = tl.where(token_mask, tl.sum(exps, axis=1), 1.0)
            full = exps / total[:, None]
            # NaN ranks as +inf, so every pick is a real expert id (the output is NaN anyway)
            key = tl.where(logits != logits, float("inf"), logits)
            taken = ~expert_mask[None, :] | ~token_mask[:, None]
            chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
            picked = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
            for s in tl.static_range(K):
                best = tl.max(tl.where(taken, float("-inf"), key), axis=1)
                candidate = ~taken & (key == best[:, None])
                if TIES_HIGH:
                    pick = tl.max(tl.where(candidate, experts[None, :], -1), axis=1)
                else:
                    pick = tl.min(tl.where(candidate, experts[None, :], BLOCK_E), axis=1)
                hit = experts[None, :] == pick[:, None]
                taken = taken | hit
                chosen = tl.where(slots[None, :] == s, pick[:, None], chosen)
                picked = tl.where(slots[None, :] == s, tl.sum(tl.where(hit, full, 0.0), axis=1)[:, None], picked)
                counts += tl.sum((hit & token_mask[:, None]).to(tl.int32), axis=0)
            if RENORMALIZE:
                picked = picked / tl.where(token_mask, tl.sum(picked, axis=1), 1.0)[:, None]
            out_mask = token_mask[:, None] & (slots[None, :] < K)
            flat = tokens[:, None] * K + slots[None, :]
            tl.store(IDS + flat, chosen, mask=out_mask)
            tl.store(PROBS + flat, picked, mask=out_mask)
            lse = peak + tl.log(total)
            tl.store(LSE + tokens, lse, mask=token_mask)
            if Z_LOSS:
                z_part += tl.where(token_mask, lse * lse, 0.0)
        else:
            for s in tl.static_range(K):
                ids = tl.load(IDS + tokens * K + s, mask=token_mask, other=-1)
                counts += tl.sum((experts[None, :] == ids[:, None]).to(tl.int32), axis=0)
    tl.store(COUNTS + pid * n_experts + experts, counts, mask=expert_mask)
    if Z_LOSS:
        tl.store(ZPART + pid, tl.sum(z_part, axis=0))


@triton.jit
def _layout_kernel(
    IDS, COUNTS, ZPART, OFFSETS, ROW_ID_MAP, SOURCE_OF_ROW, TOKEN_OF_ROW, ROUTED_COUNTS, Z,
    n_tokens, n_experts, n_programs, tokens_per_program, capacity, max_rows, z_scale,
    K: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    """The layout of IDS [T, K] from _route_kernel's COUNTS [programs, E] (one program per
    routing program, the same tokens): rows of expert e are offsets[e] + rank, rank counted in
    flat (token, slot) order; a rank at or past `capacity` drops its slot (row -1)."""
    pid = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < n_experts
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    routed = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, n_programs, BLOCK_P):
        programs = p0 + tl.arange(0, BLOCK_P)
        counts = tl.load(COUNTS + programs[:, None] * n_experts + experts[None, :],
                         mask=(programs < n_programs)[:, None] & expert_mask[None, :], other=0)
        routed += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((programs < pid)[:, None], counts, 0), axis=0)
    kept = tl.minimum(routed, capacity)
    starts = tl.cumsum(kept, axis=0) - kept
    n_kept = tl.sum(kept, axis=0)
    if pid == 0:
        tl.store(OFFSETS + experts, starts, mask=expert_mask)
        tl.store(OFFSETS + n_experts, n_kept)
        tl.store(ROUTED_COUNTS + experts, routed, mask=expert_mask)
        if Z_LOSS:
            z = tl.zeros([BLOCK_P], dtype=tl.float32)
            for p0 in range(0, n_programs, BLOCK_P):
                programs = p0 + tl.arange(0, BLOCK_P)
                z += tl.load(ZPART + programs, mask=programs < n_programs, other=0.0)
            tl.store(Z, tl.sum(z, axis=0) * z_scale)
    seen = before
    first = pid * tokens_per_program * K
    last = tl.minimum(first + tokens_per_program * K, n_tokens * K)
    for j0 in range(first, last, CHUNK):
        flat = j0 + tl.arange(0, CHUNK)
        live = flat < last
        ids = tl.load(IDS + flat, mask=live, other=-1)
        hit = ids[:, None] == experts[None, :]  # a masked slot (-1) hits no expert
        upto = tl.cumsum(hit.to(tl.int32), axis=0)
        rank = tl.sum(tl.where(hit, seen[None, :] + upto - 1, 0), axis=1)
        keep = live & (rank < capacity)
        row = tl.where(keep, tl.sum(tl.where(hit, starts[None, :], 0), axis=1) + rank, -1)
        tl.store(ROW_ID_MAP + flat, row, mask=live)
        tl.store(SOURCE_OF_ROW + row, flat, mask=keep)
        tl.store(TOKEN_OF_ROW + row, flat // K, mask=keep)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    # rows past the kept ones (capacity drops only), split between the programs
    for r0 in range(n_kept + pid * FILL, max_rows, n_programs * FILL):
        rows = r0 + tl.arange(0, FILL)
        unused = rows < max_rows
        tl.store(SOURCE_OF_ROW + rows, -1, mask=unused)
        tl.store(TOKEN_OF_ROW + rows, -1, mask=unused)


@triton.jit
def _route_backward_kernel(
    GRAD_PROBS, GRAD_Z, LOGITS, LSE, IDS, PROBS, DLOGITS,
    n_tokens, n_experts, stride_l, stride_d, z_scale,
    K: tl.constexpr, RENORMALIZE: tl.constexpr, Z_LOSS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """dlogits [T, E] (LOGITS' dtype) of the chosen probabilities' gradient GRAD_PROBS [T, K]
    and, with Z_LOSS, of z = z_scale * sum(lse^2) with gradient GRAD_Z (a 0-d fp32 tensor).
    The choice is held fixed; the softmax is recomputed as exp(logits - lse)."""
    pid = tl.program_id(0)
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < n_tokens
    experts = tl.arange(0, BLOCK_E)
    mask = token_mask[:, None] & (experts < n_experts)[None, :]
    wide_tokens = tokens.to(tl.int64)
    logits = tl.load(LOGITS + wide_tokens[:, None] * stride_l + experts[None, :], mask=mask,
                     other=float("-inf")).to(tl.float32)
    lse = tl.load(LSE + tokens, mask=token_mask, other=0.0)
    full = tl.exp(logits - lse[:, None])
    # renormalised q = p / sum(p) over the k: dp = (dq - sum(dq * q)) / sum(p)
    picked_sum = tl.zeros([BLOCK_T], dtype=tl.float32)
    dot = tl.zeros([BLOCK_T], dtype=tl.float32)
    if RENORMALIZE:
        for s in tl.static_range(K):
            ids = tl.load(IDS + tokens * K + s, mask=token_mask, other=-1)
            picked_sum += tl.sum(tl.where(experts[None, :] == ids[:, None], full, 0.0), axis=1)
            dot += (tl.load(GRAD_PROBS + tokens * K + s, mask=token_mask, other=0.0)
                    * tl.load(PROBS + tokens * K + s, mask=token_mask, other=0.0))
        picked_sum = tl.where(token_mask, picked_sum, 1.0)
    # softmax: dz = p * (dp_full - sum(dp * p)), dp_full zero off the chosen experts
    grad_full = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    inner = tl.zeros([BLOCK_T], dtype=tl.float32)
    for s in tl.static_range(K):
        ids = tl.load(IDS + tokens * K + s, mask=token_mask, other=-1)
        hit = experts[None, :] == ids[:, None]
        grad = tl.load(GRAD_PROBS + tokens * K + s, mask=token_mask, other=0.0)
        if RENORMALIZE:
            grad = (grad - dot) / picked_sum
        grad_full = tl.where(hit, grad[:, None], grad_full)
        inner += grad * tl.sum(tl.where(hit, full, 0.0), axis=1)
    dlogits = full * (grad_full - inner[:, None])
    if Z_LOSS:
        # d/dl z_scale * lse^2 = 2 z_scale lse softmax
        dlogits += (2.0 * z_scale * tl.load(GRAD_Z)) * lse[:, None] * full
    tl.store(DLOGITS + wide_tokens[:, None] * stride_d + experts[None, :], dlogits.to(DLOGITS.dtype.element_ty),
             mask=mask)


def _plan(num_tokens: int, num_experts: int, device_tensor: torch.Tensor) -> tuple[int, int, int, int]:
    """-> (block_e, block_t, tokens a program, programs) of a routing launch."""
    block_e = next_pow2(num_experts)
    # small tiles and few programs under the interpreter (it runs programs one by one), so test
    # shapes still take several programs, loop steps and masked edges
    interpreted = interprets(device_tensor)
    block_t = max(1, min(128, (INTERPRETED_TILE if interpreted else TILE_ELEMENTS) // block_e))
    per_program = max(block_t, -(-num_tokens // (3 if interpreted else MAX_PROGRAMS)))
    per_program = -(-per_program // block_t) * block_t
    return block_e, block_t, per_program, -(-num_tokens // per_program)


def route_forward(logits: torch.Tensor, k: int, renormalize: bool, capacity: int, max_rows: int, z_loss: bool,
                  ties_to_higher_id: bool = False):
    """-> (probs fp32 [T, k], expert_ids int32 [T, k], offsets, row_id_map, source_of_row,
    token_of_row, routed_counts (int32, see Routing), lse fp32 [T], z fp32 [] or None).
    T >= 1; capacity: rows an expert keeps (T * k for no limit); max_rows: the layout's bound."""
    num_tokens, num_experts = logits.shape
    device = logits.device
    block_e, block_t, per_program, programs = _plan(num_tokens, num_experts, logits)
    expert_ids = torch.empty((num_tokens, k), dtype=torch.int32, device=device)
    probs = torch.empty((num_tokens, k), dtype=torch.float32, device=device)
    lse = torch.empty(num_tokens, dtype=torch.float32, device=device)
    counts = torch.empty((programs, num_experts), dtype=torch.int32, device=device)
    z_parts = torch.empty(programs, dtype=torch.float32, device=device) if z_loss else lse
    launch_kept(_route_kernel, (programs,), logits, expert_ids, probs, lse, counts, z_parts,
           num_tokens, num_experts, logits.stride(0), per_program,
           K=k, CHOOSE=True, RENORMALIZE=renormalize, Z_LOSS=z_loss, TIES_HIGH=ties_to_higher_id,
           BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(k), num_warps=4)
    layout, z = _layout(expert_ids, counts, z_parts if z_loss else None, num_experts, capacity, max_rows,
                        per_program)
    return (probs, expert_ids, *layout, lse, z)


def layout(expert_ids: torch.Tensor, num_experts: int, capacity: int, max_rows: int):
    """-> (offsets, row_id_map, source_of_row, token_of_row, routed_counts) of valid int32 ids
    [T, k], T >= 1, in two launches."""
    num_tokens, k = expert_ids.shape
    block_e, block_t, per_program, programs = _plan(num_tokens, num_experts, expert_ids)
    counts = torch.empty((programs, num_experts), dtype=torch.int32, device=expert_ids.device)
    launch_kept(_route_kernel, (programs,), expert_ids, expert_ids, counts, counts, counts, counts,
           num_tokens, num_experts, 0, per_program,
           K=k, CHOOSE=False, RENORMALIZE=False, Z_LOSS=False, TIES_HIGH=False,
           BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_pow2(k), num_warps=4)
    return _layout(expert_ids, counts, None, num_experts, capacity, max_rows, per_program)[0]


def _layout(expert_ids, counts, z_parts, num_experts, capacity, max_rows, per_program):
    num_tokens, k = expert_ids.shape
    programs = counts.shape[0]
    device = expert_ids.device
    block_e = next_pow2(num_experts)
    tile = INTERPRETED_TILE if interprets(expert_ids) else TILE_ELEMENTS
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    row_id_map = torch.empty(num_tokens * k, dtype=torch.int32, device=device)
    source_of_row = torch.empty(max_rows, dtype=torch.int32, device=device)
    token_of_row = torch.empty(max_rows, dtype=torch.int32, device=device)
    routed_counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    z = torch.empty((), dtype=torch.float32, device=device) if z_parts is not None else None
    launch_kept(_layout_kernel, (programs,), expert_ids, counts, offsets if z_parts is None else z_parts, offsets,
           row_id_map, source_of_row, token_of_row, routed_counts, offsets if z is None else z,
           num_tokens, num_experts, programs, per_program, capacity, max_rows, 1.0 / num_tokens,
           K=k, Z_LOSS=z_parts is not None, BLOCK_E=block_e, BLOCK_P=max(1, min(next_pow2(programs), tile // block_e)),
           CHUNK=max(1, tile // block_e), FILL=min(1024, next_pow2(max(max_rows, 1))), num_warps=4)
    return (offsets, row_id_map, source_of_row, token_of_row, routed_counts), z


def route_backward(grad_probs: torch.Tensor, grad_z: torch.Tensor | None, logits: torch.Tensor, lse: torch.Tensor,
                   expert_ids: torch.Tensor, probs: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """dlogits in logits' dtype (see _route_backward_kernel); grad_z None: no z-loss term."""
    num_tokens, num_experts = logits.shape
    dlogits = torch.empty_like(logits, memory_format=torch.contiguous_format)
    if num_tokens:
        block_e = next_pow2(num_experts)
        block_t = max(1, min(128, (INTERPRETED_TILE if interprets(logits) else TILE_ELEMENTS) // block_e))
        grad_probs = grad_probs.contiguous()
        launch_kept(_route_backward_kernel, (-(-num_tokens // block_t),), grad_probs, lse if grad_z is None else grad_z,
               logits, lse, expert_ids, probs, dlogits, num_tokens, num_experts, logits.stride(0),
               dlogits.stride(0), 1.0 / num_tokens,
               K=expert_ids.shape[1], RENORMALIZE=renormalize, Z_LOSS=grad_z is not None, BLOCK_T=block_t,
               BLOCK_E=block_e, num_warps=4)
    return dlogits
