"""Routing: router logits [T, E] into an expert-sorted layout, the `Routing` every expert
kernel reads.

`route` takes softmax in fp32, the top k experts of each token (chosen on the logits, ties to
the lower expert id), their probabilities renormalised over the k when asked. On the GPU that is
two launches of `route_kernels` and its backward one; `route_reference` is the same routing in
torch ops, what the gate judges the kernels against (and what `route` runs where the kernels
cannot). `routing_from_topk` lays out a top-k choice someone else made (a model's own router).
Each (token t, slot s) pair is one row, flat index t * k + s. The rows are laid out
expert-major; within an expert by flat index ascending, which is token order. With a capacity
factor an expert keeps only its first `capacity` rows in that order (the lowest tokens) and the
rest are dropped: they have no sorted row and contribute nothing. Everything is built on the
device without a host sync, so routing can sit inside a captured or overlapped step.

The kernels index memory with the routing's integers, so a `Routing` is valid by construction
(`route`, `routing_from_topk`) or checked when built by hand (`Routing(...)`,
`dataclasses.replace`): on the CPU a ValueError naming the field, on a GPU a device-side
assert with the same message, never a read out of bounds. Under torch.compile the kernels run
as custom ops (no graph break).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from fractions import Fraction
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from suite.arms.moe import route_kernels
from suite.triton_support import runs_on

# Row indices and flat (token, slot) indices are stored as int32.
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Where each (token, slot) row goes. Every tensor is on the logits' device; T tokens, E
    experts, R kept rows (R <= max_rows; a device value, read `num_rows` to get it there).

    probs          fp32  [T, k]  combine weights, differentiable back to the logits
    expert_ids     int32 [T, k]  slot s of token t goes to expert expert_ids[t, s]; slots
                                 in descending logit (so probability), ties to the lower id
    offsets        int32 [E + 1] expert e's kept rows are sorted rows offsets[e]:offsets[e + 1];
                                 offsets[E] = R
    row_id_map     int32 [T * k] the sorted row of (t, s) at t * k + s; -1 when dropped
    source_of_row  int32 [max_rows] the flat index t * k + s of each sorted row; -1 past R
    token_of_row   int32 [max_rows] the token t of each sorted row; -1 past R
    routed_counts  int32 [E]     rows routed to each expert before capacity dropping
    num_experts, k               E and k, host ints
    capacity                     rows an expert keeps (host int), None: no limit
    max_rows                     host bound on R: T * k, or min(T * k, E * capacity)
    z_loss         fp32 []       the router z-loss, mean over tokens of logsumexp(logits)^2,
                                 differentiable to the logits; None unless route() was asked
    """

    probs: torch.Tensor
    expert_ids: torch.Tensor
    offsets: torch.Tensor
    row_id_map: torch.Tensor
    source_of_row: torch.Tensor
    token_of_row: torch.Tensor
    routed_counts: torch.Tensor
    num_experts: int
    k: int
    capacity: int | None
    max_rows: int
    z_loss: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # route() and routing_from_topk() skip this (trusted_routing): they build valid layouts
        _check_routing_shapes(self)
        _check_routing_indices(self)

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_rows(self) -> torch.Tensor:
        """R, the kept rows: an int32 0-d device tensor (no sync)."""
        return self.offsets[-1]

    @property
    def num_dropped(self) -> torch.Tensor:
        """Rows dropped by the capacity limit: an int32 0-d device tensor (no sync)."""
        return self.row_id_map.numel() - self.offsets[-1]

    @property
    def kept(self) -> torch.Tensor:
        """bool [T, k]: whether slot s of token t kept its row."""
        return self.row_id_map.view(self.num_tokens, self.k) >= 0


def trusted_routing(**fields) -> Routing:
    """A Routing that route() or routing_from_topk() laid out: valid by construction, so it
    skips the checks (a few dozen launches) that one built by hand gets."""
    routing = object.__new__(Routing)
    for name, value in {"z_loss": None, **fields}.items():
        object.__setattr__(routing, name, value)
    return routing


def _require(ok: torch.Tensor, message: str) -> None:
    """An index check without a host sync: on a GPU a device-side assert (the process stops at
    its next launch, printing `message`), on the CPU a ValueError now."""
    if ok.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(ok):
            raise ValueError(message)
    else:  # also on the CPU under torch.compile, where reading the flag would break the graph
        torch._assert_async(ok, message)


def _check_routing_shapes(r: Routing) -> None:
    """A hand-built Routing's fields, types, shapes and devices: host metadata only."""
    for name in ("num_experts", "k", "max_rows"):
        if not _is_int(getattr(r, name)):
            raise TypeError(f"Routing: {name} must be an int, got {getattr(r, name)!r}")
    if r.capacity is not None and not (_is_int(r.capacity) and r.capacity >= 1):
        raise ValueError(f"Routing: capacity must be a positive int or None, got {r.capacity!r}")
    if not isinstance(r.expert_ids, torch.Tensor) or r.expert_ids.dim() != 2:
        raise ValueError("Routing: expert_ids must be a tensor [tokens, k]; build a Routing with route() or "
                         "routing_from_topk()")
    tokens, k, num_experts = r.expert_ids.shape[0], r.k, r.num_experts
    if num_experts < 1 or k < 1 or r.expert_ids.shape[1] != k:
        raise ValueError(f"Routing: k ({k}) must be expert_ids.shape[1] ({r.expert_ids.shape[1]}), and k and "
                         f"num_experts ({num_experts}) at least 1")
    if not 0 <= r.max_rows <= tokens * k:
        raise ValueError(f"Routing: max_rows must be in 0..{tokens * k} (tokens x k), got {r.max_rows}")
    expected = {
        "probs": ((tokens, k), None),
        "expert_ids": ((tokens, k), torch.int32),
        "offsets": ((num_experts + 1,), torch.int32),
        "row_id_map": ((tokens * k,), torch.int32),
        "source_of_row": ((r.max_rows,), torch.int32),
        "token_of_row": ((r.max_rows,), torch.int32),
        "routed_counts": ((num_experts,), torch.int32),
    }
    for name, (shape, dtype) in expected.items():
        t = getattr(r, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"Routing: {name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            raise ValueError(f"Routing: {name} must have shape {shape}, got {tuple(t.shape)}")
        if dtype is None and not t.is_floating_point():
            raise TypeError(f"Routing: {name} must be floating point, not {t.dtype}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"Routing: {name} must be {dtype}, not {t.dtype}")
        if t.device != r.expert_ids.device:
            raise ValueError(f"Routing: {name} is on {t.device}, expert_ids on {r.expert_ids.device}")
    if r.z_loss is not None and not (isinstance(r.z_loss, torch.Tensor) and r.z_loss.dim() == 0
                                     and r.z_loss.is_floating_point()):
        raise TypeError("Routing: z_loss must be None or a 0-d floating-point tensor")


def _check_routing_indices(r: Routing) -> None:
    """A hand-built Routing's integers describe a layout the kernels can index safely: every id
    in range, the rows of expert e at offsets[e]:offsets[e+1] below max_rows, and the maps from
    rows to (token, slot) and back inverse to each other. Checked on the device (`_require`)."""
    k, num_experts, slots = r.k, r.num_experts, r.row_id_map.numel()
    device = r.offsets.device
    if slots:
        lowest, highest = torch.aminmax(r.expert_ids)
        _require(lowest.ge(0) & highest.lt(num_experts), f"Routing: expert_ids hold an id outside 0..{num_experts - 1}")
    counts = r.offsets.diff()
    num_rows = r.offsets[-1]
    _require(r.offsets[0].eq(0) & counts.ge(0).all() & num_rows.le(r.max_rows),
             f"Routing: offsets must rise from 0 to at most max_rows ({r.max_rows})")
    kept_ok = counts.le(r.routed_counts).all()
    if r.capacity is not None:
        kept_ok &= counts.le(r.capacity).all()
    _require(kept_ok, "Routing: an expert keeps more rows (offsets) than were routed to it or than its capacity")
    rows = torch.arange(r.max_rows, device=device, dtype=torch.int32)
    live = rows < num_rows
    source, token = r.source_of_row.long(), r.token_of_row.long()
    _require(torch.where(live, source.ge(0) & source.lt(slots), source.eq(-1)).all(),
             "Routing: source_of_row must hold a flat index t * k + s below offsets[E] and -1 past it")
    _require(torch.where(live, token.eq(source.div(k, rounding_mode="floor")), token.eq(-1)).all(),
             "Routing: token_of_row must be source_of_row // k below offsets[E] and -1 past it")
    row_of = r.row_id_map.long()
    _require((row_of.ge(-1) & row_of.lt(num_rows)).all(), "Routing: row_id_map must hold -1 or a row below offsets[E]")
    if r.max_rows == 0:
        return
    # the two maps invert each other, and each row sits in the range of the expert it chose
    # (the gathers clamp: on a GPU the checks above have not stopped anything yet)
    flat = torch.arange(slots, device=device)
    _require(torch.where(row_of.ge(0), source[row_of.clamp(0, r.max_rows - 1)].eq(flat), True).all(),
             "Routing: source_of_row[row_id_map[j]] must be j for every kept slot j")
    from_row = source.clamp(0, slots - 1)
    expert_of_row = torch.searchsorted(r.offsets[1:].contiguous(), rows, right=True)
    _require(torch.where(live, row_of[from_row].eq(rows) & r.expert_ids.reshape(-1)[from_row].eq(expert_of_row),
                         True).all(),
             "Routing: each row below offsets[E] must map back to its slot and sit in its chosen expert's range")


def expert_capacity(capacity_factor: float, num_tokens: int, k: int, num_experts: int) -> int:
    """ceil(capacity_factor * T * k / E), exact: the factor is read as the decimal it prints as,
    so 1.1 * 10 rows is 11, not the 12 that binary 1.1 (slightly above 1.1) would round up to.
    Integer arithmetic only, so a symbolic T under torch.compile(dynamic=True) passes through."""
    check_capacity_factor("expert_capacity", capacity_factor)
    if capacity_factor is None:
        raise ValueError("expert_capacity: capacity_factor must be a positive number; None means no capacity")
    factor = capacity_factor if isinstance(capacity_factor, Fraction) else Fraction(repr(float(capacity_factor)))
    scale = factor.denominator * num_experts
    return (factor.numerator * num_tokens * k + scale - 1) // scale


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_capacity_factor(fn: str, capacity_factor) -> None:
    if capacity_factor is None:
        return
    if isinstance(capacity_factor, Fraction):  # MoEExperts' exact factor: ints (dynamo cannot compare a Fraction)
        if capacity_factor.numerator <= 0:
            raise ValueError(f"{fn}: capacity_factor must be a positive number or None, got {capacity_factor}")
        return
    # comparisons, not math.isfinite: under torch.compile(dynamic=True) the factor may be symbolic
    if not isinstance(capacity_factor, numbers.Real) or isinstance(capacity_factor, bool) or not (
            0 < capacity_factor < math.inf):
        raise ValueError(f"{fn}: capacity_factor must be a positive number or None, got {capacity_factor!r}")


def check_route_args(fn: str, logits, k, capacity_factor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{fn}: logits must be a tensor [tokens, experts], got {type(logits).__name__}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"{fn}: logits must be [tokens, experts] with experts >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{fn}: logits must be floating point, not {logits.dtype}")
    num_experts = logits.shape[1]
    if not _is_int(k):
        raise TypeError(f"{fn}: k must be an int (the experts each token picks), got {type(k).__name__} {k!r}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"{fn}: k must be in 1..{num_experts} (the experts), got {k}")
    if logits.shape[0] * k > _MAX_ROWS:
        raise ValueError(f"{fn}: T * k = {logits.shape[0] * k} rows do not fit the int32 row indices")
    check_capacity_factor(fn, capacity_factor)


def route(logits: torch.Tensor, k: int, renormalize: bool = True, capacity_factor: float | None = None,
          z_loss: bool = False, jitter_eps: float | None = None, generator: torch.Generator | None = None) -> Routing:
    """Top-k routing of router logits [T, E] into the expert-sorted layout (see `Routing`), on
    the GPU in two launches (route_kernels) and its backward in one; where the
    kernels cannot run (a CPU without Triton's interpreter), `route_reference`'s torch ops.

    z_loss: also the router z-loss (Routing.z_loss), which a training loop adds to its loss
    with a small weight (OLMo-core's router uses 1e-3) to keep the logits from growing.
    jitter_eps: multiply the logits by noise uniform in [1 - eps, 1 + eps] first (from
    `generator`, else torch's global generator; a generator object stops torch.compile's graph),
    as `MoEExperts` does to the router's input."""
    check_route_args("route", logits, k, capacity_factor)
    if jitter_eps is not None:
        logits = jittered(logits, jitter_eps, generator, "route")
    num_tokens, num_experts = logits.shape
    if num_tokens == 0 or not runs_on(logits):
        return _route_in_torch(logits, k, renormalize, capacity_factor, z_loss)
    capacity = None if capacity_factor is None else expert_capacity(capacity_factor, num_tokens, k, num_experts)
    max_rows = row_bound(num_tokens, k, num_experts, capacity)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    probs, expert_ids, offsets, row_id_map, source_of_row, token_of_row, routed_counts, _, z = _RouteFunction.apply(
        logits, k, renormalize, num_tokens * k if capacity is None else capacity, max_rows, z_loss)
    return trusted_routing(
        probs=probs, expert_ids=expert_ids, offsets=offsets, row_id_map=row_id_map, source_of_row=source_of_row,
        token_of_row=token_of_row, routed_counts=routed_counts, num_experts=num_experts, k=k, capacity=capacity,
        max_rows=max_rows, z_loss=z if z_loss else None,
    )


def route_reference(logits: torch.Tensor, k: int, renormalize: bool = True, capacity_factor: float | None = None,
                    z_loss: bool = False) -> Routing:
    """`route` in torch ops under autograd: what the gate judges the routing kernels against.
    The same choice (the top k logits, ties to the lower id) and the same layout, exactly."""
    check_route_args("route_reference", logits, k, capacity_factor)
    return _route_in_torch(logits, k, renormalize, capacity_factor, z_loss)


def _route_in_torch(logits, k, renormalize, capacity_factor, z_loss) -> Routing:
    wide = logits.float()
    full = torch.softmax(wide, dim=-1)
    # Chosen on the logits (softmax is monotone), as the kernel chooses: the choice then does
    # not hang on exp's rounding. A stable sort keeps equal logits in expert-id order.
    chosen = torch.sort(wide.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    picked = full.gather(1, chosen)
    probs = picked / picked.sum(dim=-1, keepdim=True) if renormalize else picked
    routing = _layout(chosen.to(torch.int32), probs, logits.shape[1], capacity_factor, fused=False)
    if z_loss:
        object.__setattr__(routing, "z_loss", router_z_loss(logits))
    return routing


def row_bound(num_tokens: int, k: int, num_experts: int, capacity: int | None) -> int:
    return num_tokens * k if capacity is None else min(num_tokens * k, num_experts * capacity)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """mean over tokens of logsumexp(logits)^2, in fp32 (0 for no tokens)."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    return lse.square().sum() / max(lse.numel(), 1)


def jittered(t: torch.Tensor, eps: float, generator: torch.Generator | None = None, fn: str = "jitter") -> torch.Tensor:
    """t times noise uniform in [1 - eps, 1 + eps], drawn in t's dtype on its device."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < 1:
        raise ValueError(f"{fn}: jitter_eps must be a number in [0, 1), got {eps!r}")
    return t * torch.empty_like(t).uniform_(1.0 - eps, 1.0 + eps, generator=generator)


# ---- the routing kernels behind autograd: one node, eager and under torch.compile ----


def route_grads(grad_probs, grad_z, backward, logits, lse, expert_ids, probs, renormalize) -> torch.Tensor | None:
    """dlogits by `backward` (the kernel's launcher, or its custom op under torch.compile) from
    what the routing saved; grad_z None where no z-loss was asked for or none came back."""
    if grad_probs is None and grad_z is None:
        return None
    if grad_probs is None:
        grad_probs = torch.zeros_like(probs)
    return backward(grad_probs, grad_z, logits, lse, expert_ids, probs, renormalize)


class _RouteFunction(torch.autograd.Function):
    """The routing's autograd node: its two launches forward, one backward; under torch.compile
    the same kernels as the custom ops below, which carry no autograd of their own."""

    @staticmethod
    def forward(ctx, logits, k, renormalize, capacity, max_rows, z_loss):
        ctx.compiled = torch.compiler.is_compiling()
        forward = torch.ops.suite.moe_route if ctx.compiled else route_kernels.route_forward
        output = forward(logits, k, renormalize, capacity, max_rows, z_loss)
        probs, expert_ids, *indices, lse, z = output
        ctx.save_for_backward(logits, lse, expert_ids, probs)
        ctx.renormalize, ctx.z_loss = renormalize, z_loss
        ctx.mark_non_differentiable(expert_ids, *indices, lse, *([] if z_loss or z is None else [z]))
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_probs, *grads):
        backward = torch.ops.suite.moe_route_backward if ctx.compiled else route_kernels.route_backward
        dlogits = route_grads(grad_probs, grads[-1] if ctx.z_loss else None, backward, *ctx.saved_tensors,
                              ctx.renormalize)
        return dlogits, None, None, None, None, None


def routing_from_topk(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                      capacity_factor: float | None = None) -> Routing:
    """The expert-sorted layout (see `Routing`) of a top-k choice made elsewhere, a model's own
    router: top_k_index [T, k] (any integer dtype), top_k_weights [T, k] the combine weights,
    kept as `probs` in fp32 with their autograd link (router gradients flow back through them).

    The expert ids come from user code, so they are checked on the device: an id outside
    0..num_experts-1 is a ValueError on the CPU and a device-side assert on a GPU, no sync."""
    expert_ids, probs = _checked_topk("routing_from_topk", top_k_index, top_k_weights, num_experts, capacity_factor)
    return _layout(expert_ids, probs, num_experts, capacity_factor, fused=runs_on(top_k_index))


def routing_from_topk_reference(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                                capacity_factor: float | None = None) -> Routing:
    """`routing_from_topk` in torch ops alone, the routing kernels' reference: the same layout."""
    expert_ids, probs = _checked_topk("routing_from_topk_reference", top_k_index, top_k_weights, num_experts,
                                      capacity_factor)
    return _layout(expert_ids, probs, num_experts, capacity_factor, fused=False)


def _checked_topk(fn: str, top_k_index, top_k_weights, num_experts, capacity_factor):
    """-> (expert ids int32, combine weights fp32 with their autograd link), each argument checked."""
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a tensor [tokens, k], got {shape}")
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[1] == 0:
        raise ValueError(f"{fn}: top_k_index {tuple(top_k_index.shape)} and top_k_weights "
                         f"{tuple(top_k_weights.shape)} must share one shape [tokens, k >= 1]")
    if top_k_index.is_floating_point() or top_k_index.is_complex() or top_k_index.dtype == torch.bool:
        raise TypeError(f"{fn}: top_k_index must hold integer expert ids, not {top_k_index.dtype}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"{fn}: top_k_weights must be floating point, not {top_k_weights.dtype}")
    if top_k_index.device != top_k_weights.device:
        raise ValueError(f"{fn}: top_k_index is on {top_k_index.device}, top_k_weights on {top_k_weights.device}")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{fn}: num_experts must be a positive int, got {num_experts!r}")
    check_capacity_factor(fn, capacity_factor)
    if top_k_index.numel():
        lowest, highest = torch.aminmax(top_k_index)
        _require(lowest.ge(0) & highest.lt(num_experts),
                 f"{fn}: top_k_index holds an expert id outside 0..{num_experts - 1}")
    return top_k_index.to(torch.int32).contiguous(), top_k_weights.float()


def _layout(expert_ids: torch.Tensor, probs: torch.Tensor, num_experts: int, capacity_factor: float | None,
            fused: bool) -> Routing:
    """The Routing of valid expert ids [T, k] int32 and their weights [T, k] fp32; fused: by
    the routing kernels (two launches), else in torch ops."""
    num_tokens, k = expert_ids.shape
    num_slots = num_tokens * k
    if num_slots > _MAX_ROWS:
        raise ValueError(f"routing: T * k = {num_slots} rows do not fit the int32 row indices")
    capacity = None if capacity_factor is None else expert_capacity(capacity_factor, num_tokens, k, num_experts)
    max_rows = row_bound(num_tokens, k, num_experts, capacity)
    if fused and num_tokens:
        index = _layout_op if torch.compiler.is_compiling() else route_kernels.layout
        indices = index(expert_ids, num_experts, num_slots if capacity is None else capacity, max_rows)
    else:
        indices = _layout_indices(expert_ids, num_experts, capacity)
    offsets, row_id_map, source_of_row, token_of_row, routed_counts = indices
    return trusted_routing(
        probs=probs, expert_ids=expert_ids, offsets=offsets, row_id_map=row_id_map, source_of_row=source_of_row,
        token_of_row=token_of_row, routed_counts=routed_counts, num_experts=num_experts, k=k, capacity=capacity,
        max_rows=max_rows,
    )


def _layout_indices(expert_ids: torch.Tensor, num_experts: int, capacity: int | None):
    """-> (offsets, row_id_map, source_of_row, token_of_row, routed_counts), int32 (see Routing),
    in torch ops: the reference of the layout kernel."""
    num_tokens, k = expert_ids.shape
    num_slots = num_tokens * k
    max_rows = row_bound(num_tokens, k, num_experts, capacity)
    device = expert_ids.device
    # Flat rows t * k + s are already in (token, slot) order, so a stable sort by expert alone
    # gives the layout: expert-major, then (token, slot) ascending.
    flat_ids = expert_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    expert_range = torch.arange(num_experts + 1, device=device, dtype=torch.int32)
    # first position of each expert in the sorted order (bincount would sync to size its output)
    routed_start = torch.searchsorted(sorted_ids, expert_range)
    routed_counts = routed_start.diff()
    position = torch.arange(num_slots, device=device, dtype=torch.int64)
    rank = position - routed_start.index_select(0, sorted_ids)  # place within its expert, lowest token first
    if capacity is None:
        kept_counts, kept = routed_counts, torch.ones_like(rank, dtype=torch.bool)
    else:
        kept_counts, kept = routed_counts.clamp(max=capacity), rank < capacity
    offsets = torch.zeros(num_experts + 1, device=device, dtype=torch.int64)
    offsets[1:] = kept_counts.cumsum(0)
    # kept rows keep their relative order: the row is the expert's kept start plus the rank
    row = torch.where(kept, offsets.index_select(0, sorted_ids) + rank, -1)
    row_id_map = torch.empty(num_slots, device=device, dtype=torch.int64).scatter_(0, order, row)
    # Dropped rows are all written to one extra slot past the end, cut off after; writing
    # through a mask instead would need its count on the host.
    target = torch.where(kept, row, max_rows)
    source = torch.full((max_rows + 1,), -1, device=device, dtype=torch.int64).scatter_(0, target, order)
    source_of_row = source[:max_rows]
    token_of_row = torch.where(source_of_row >= 0, source_of_row.div(k, rounding_mode="floor"), -1)
    return tuple(t.to(torch.int32) for t in (offsets, row_id_map, source_of_row, token_of_row, routed_counts))


# ---- the custom ops torch.compile sees: opaque to dynamo, shapes from their fake versions; the
# ---- routing's autograd node above calls the first two


@torch.library.custom_op("suite::moe_route", mutates_args=())
def _route_op(logits: torch.Tensor, k: int, renormalize: bool, capacity: int, max_rows: int, z_loss: bool) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
        torch.Tensor]:
    *routing, z = route_kernels.route_forward(logits, k, renormalize, capacity, max_rows, z_loss)
    return *routing, logits.new_zeros((), dtype=torch.float32) if z is None else z


@_route_op.register_fake
def _(logits, k, renormalize, capacity, max_rows, z_loss):
    tokens, num_experts = logits.shape

    def empty(*shape, dtype=torch.int32):
        return logits.new_empty(shape, dtype=dtype)

    return (empty(tokens, k, dtype=torch.float32), empty(tokens, k), empty(num_experts + 1), empty(tokens * k),
            empty(max_rows), empty(max_rows), empty(num_experts), empty(tokens, dtype=torch.float32),
            empty(dtype=torch.float32))


@torch.library.custom_op("suite::moe_route_backward", mutates_args=())
def _route_backward_op(grad_probs: torch.Tensor, grad_z: Optional[torch.Tensor], logits: torch.Tensor,
                       lse: torch.Tensor, expert_ids: torch.Tensor, probs: torch.Tensor,
                       renormalize: bool) -> torch.Tensor:
    return route_kernels.route_backward(grad_probs, grad_z, logits, lse, expert_ids, probs, renormalize)


@_route_backward_op.register_fake
def _(grad_probs, grad_z, logits, lse, expert_ids, probs, renormalize):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("suite::moe_layout", mutates_args=())
def _layout_op(expert_ids: torch.Tensor, num_experts: int, capacity: int, max_rows: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return route_kernels.layout(expert_ids, num_experts, capacity, max_rows)


@_layout_op.register_fake
def _(expert_ids, num_experts, capacity, max_rows):
    return tuple(expert_ids.new_empty(n, dtype=torch.int32)
                 for n in (num_experts + 1, expert_ids.numel(), max_rows, max_rows, num_experts))
