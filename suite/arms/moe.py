"""Mixture-of-experts: top-k routing into an expert-sorted layout, and the experts' eager reference.

Routing (`route`) turns router logits [T, E] into a `Routing`: softmax in fp32, the top k
experts of each token (ties to the lower expert id), their probabilities renormalised over
the k when asked. Each (token t, slot s) pair is one row, flat index t * k + s. The rows are
laid out expert-major; within an expert by flat index ascending, which is token order since
a token picks an expert at most once. With a capacity factor an expert keeps only its first
`capacity` rows in that order (the lowest tokens) and the rest are dropped: they have no
sorted row and contribute nothing. Everything is built on the device without a host sync, so
routing can sit inside a captured or overlapped step.

The experts are SwiGLU FFNs, weights w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d]:

    out[t] = sum over kept slots s of probs[t, s] * FFN_e(x[t]),  e = expert_ids[t, s]
    FFN_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]

with the weighted sum in fp32 and out in x's dtype. `experts_reference` is the eager
autograd reference (gradients for x, the weights and probs, hence the logits);
`experts_truth` is the same maths in float64, what the gate judges errors against. `experts`
is the same layer on the Triton kernels of `suite.arms.moe_kernels` (forward and backward, no
host sync), and `MoEExperts` the module: router, top-k routing and experts, either impl.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from suite.arms import moe_kernels

# Row indices and flat (token, slot) indices are stored as int32.
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Where each (token, slot) row goes. Every tensor is on the logits' device; T tokens, E
    experts, R kept rows (R <= max_rows; a device value, read `num_rows` to get it there).

    probs          fp32  [T, k]  combine weights, differentiable back to the logits
    expert_ids     int32 [T, k]  slot s of token t goes to expert expert_ids[t, s]; slots
                                 in descending probability, ties to the lower id
    offsets        int32 [E + 1] expert e's kept rows are sorted rows offsets[e]:offsets[e + 1];
                                 offsets[E] = R
    row_id_map     int32 [T * k] the sorted row of (t, s) at t * k + s; -1 when dropped
    source_of_row  int32 [max_rows] the flat index t * k + s of each sorted row; -1 past R
    token_of_row   int32 [max_rows] the token t of each sorted row; -1 past R
    routed_counts  int32 [E]     rows routed to each expert before capacity dropping
    num_experts, k               E and k, host ints
    capacity                     rows an expert keeps (host int), None: no limit
    max_rows                     host bound on R: T * k, or min(T * k, E * capacity)
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


def expert_capacity(capacity_factor: float, num_tokens: int, k: int, num_experts: int) -> int:
    """ceil(capacity_factor * T * k / E), exact: the factor is read as the decimal it prints as,
    so 1.1 * 10 rows is 11, not the 12 that binary 1.1 (slightly above 1.1) would round up to."""
    return math.ceil(Fraction(repr(float(capacity_factor))) * num_tokens * k / num_experts)


def route(logits: torch.Tensor, k: int, renormalize: bool = True, capacity_factor: float | None = None) -> Routing:
    """Top-k routing of router logits [T, E] into the expert-sorted layout (see `Routing`)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"route: logits must be [tokens, experts] with experts >= 1, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"route: logits must be floating point, not {logits.dtype}")
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"route: k must be in 1..{num_experts} (the experts), got {k}")
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(f"route: capacity_factor must be a positive number or None, got {capacity_factor}")
    num_slots = num_tokens * k
    if num_slots > _MAX_ROWS:
        raise ValueError(f"route: T * k = {num_slots} rows do not fit the int32 row indices")
    device = logits.device

    full = torch.softmax(logits.float(), dim=-1)
    # A stable descending sort keeps equal probabilities in expert-id order, so ties go to the
    # lower id (torch.topk does not promise that). Only the indices are taken from the sort;
    # the values are gathered so that probs stays differentiable.
    chosen = torch.sort(full.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    probs = full.gather(1, chosen)
    if renormalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    expert_ids = chosen.to(torch.int32)

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

    if capacity_factor is None:
        capacity, max_rows = None, num_slots
        kept_counts = routed_counts
        kept = torch.ones_like(rank, dtype=torch.bool)
    else:
        capacity = expert_capacity(capacity_factor, num_tokens, k, num_experts)
        max_rows = min(num_slots, num_experts * capacity)
        kept_counts = routed_counts.clamp(max=capacity)
        kept = rank < capacity
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

    return Routing(
        probs=probs,
        expert_ids=expert_ids,
        offsets=offsets.to(torch.int32),
        row_id_map=row_id_map.to(torch.int32),
        source_of_row=source_of_row.to(torch.int32),
        token_of_row=token_of_row.to(torch.int32),
        routed_counts=routed_counts.to(torch.int32),
        num_experts=num_experts,
        k=k,
        capacity=capacity,
        max_rows=max_rows,
    )


def _check_experts_args(x, routing, w_gate, w_up, w_down) -> None:
    num_experts, d, f = w_gate.shape
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"experts: x must be [tokens, {d}], got shape {tuple(x.shape)}")
    if x.shape[0] != routing.num_tokens:
        raise ValueError(f"experts: x has {x.shape[0]} tokens but the routing has {routing.num_tokens}")
    if routing.num_experts != num_experts:
        raise ValueError(f"experts: the routing has {routing.num_experts} experts but the weights {num_experts}")
    if w_up.shape != (num_experts, d, f) or w_down.shape != (num_experts, f, d):
        raise ValueError(
            f"experts: weights must be w_gate/w_up [E, d, f] and w_down [E, f, d], got "
            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )


def expert_rows(routing: Routing) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's kept (tokens, slots), tokens ascending. Finding them reads the layout on the
    host (a sync): for setting up a reference or a benchmark once, not for a training step."""
    chosen = routing.expert_ids.long()
    kept = routing.kept
    return [torch.nonzero((chosen == e) & kept, as_tuple=True) for e in range(routing.num_experts)]


def experts_reference(x, routing: Routing, w_gate, w_up, w_down, rows=None) -> torch.Tensor:
    """Eager experts, one expert at a time. The matmuls run in x's dtype, the activation and the
    weighted sum in fp32 (float64 when x is float64); autograd gives every gradient.

    rows: `expert_rows(routing)`, found once by the caller; then the call itself never syncs
    (a benchmark can capture it in a CUDA graph)."""
    _check_experts_args(x, routing, w_gate, w_up, w_down)
    wide = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape[0], w_down.shape[-1], device=x.device, dtype=wide)
    for e, (tokens, slots) in enumerate(expert_rows(routing) if rows is None else rows):
        # a token picks an expert at most once, so `tokens` has no repeats and index_add_
        # below adds each row once: the sum's order is the expert order, run to run
        v = x[tokens]
        hidden = F.silu((v @ w_gate[e]).to(wide)) * (v @ w_up[e]).to(wide)
        y = hidden.to(x.dtype) @ w_down[e]
        weight = routing.probs[tokens, slots].to(wide)
        out = out.index_add(0, tokens, weight[:, None] * y.to(wide))
    return out.to(x.dtype)


def experts_truth(x, routing: Routing, w_gate, w_up, w_down) -> torch.Tensor:
    """The reference's maths in float64. Pass float64 leaves (x, weights, and routing.probs
    through `dataclasses.replace`) to get float64 gradients."""
    wide = dataclasses.replace(routing, probs=routing.probs.double())
    return experts_reference(x.double(), wide, w_gate.double(), w_up.double(), w_down.double())


class _ExpertsFunction(torch.autograd.Function):
    """The experts on the kernels. Every buffer is sized by routing.max_rows (a host bound), so
    neither pass reads R on the host; rows past R are never read."""

    @staticmethod
    def forward(ctx, x, probs, w_gate, w_up, w_down, routing):
        a, g, u = moe_kernels.expert_up(x, w_gate, w_up, routing.token_of_row, routing.offsets)
        y_rows = moe_kernels.expert_down(a, w_down, routing.offsets)
        out = moe_kernels.combine(y_rows, routing.row_id_map, probs)
        ctx.save_for_backward(x, probs, w_gate, w_up, w_down, a, g, u, y_rows)
        ctx.routing = routing
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, probs, w_gate, w_up, w_down, a, g, u, y_rows = ctx.saved_tensors
        routing = ctx.routing
        grad_rows, grad_probs = moe_kernels.combine_backward(grad_out.contiguous(), y_rows, probs, routing.row_id_map)
        dg, du, dw_down = moe_kernels.expert_down_backward(grad_rows, a, g, u, w_down, routing.offsets)
        dx_rows, dw_gate, dw_up = moe_kernels.expert_up_backward(
            dg, du, x, w_gate, w_up, routing.token_of_row, routing.offsets
        )
        # each token's k slots summed in slot order, so dx repeats its bits run to run
        dx = moe_kernels.combine(dx_rows, routing.row_id_map, top_k=routing.k)
        return dx, grad_probs, dw_gate, dw_up, dw_down, None


def experts(x, routing: Routing, w_gate, w_up, w_down) -> torch.Tensor:
    """`experts_reference`'s maths on the Triton kernels: out [T, d] in x's dtype, and under
    autograd the gradients for x, the three weights and routing.probs (hence the logits).
    x and the weights share one dtype (bf16, fp16 or fp32); fp32 math throughout."""
    _check_experts_args(x, routing, w_gate, w_up, w_down)
    probs = routing.probs if routing.probs.is_contiguous() else routing.probs.contiguous()
    return _ExpertsFunction.apply(x.contiguous(), probs, w_gate, w_up, w_down, routing)


EXPERTS_IMPLS = ("fused", "eager")


class MoEExperts(nn.Module):
    """A SwiGLU mixture-of-experts layer: a router (linear d -> E, no bias), top-k routing with
    an optional capacity factor, and the experts. impl="fused": `experts` (the Triton kernels);
    "eager": `experts_reference`. forward(x [..., d]) -> out of x's shape and dtype."""

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None, renormalize: bool = True, impl: str = "fused",
                 device=None, dtype=None):
        super().__init__()
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f'MoEExperts: impl must be "fused" or "eager", not {impl!r}')
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = hidden_size, ffn_size, num_experts, top_k
        self.capacity_factor, self.renormalize, self.impl = capacity_factor, renormalize, impl
        factory = dict(device=device, dtype=dtype)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size, **factory))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_size, **factory))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_size, hidden_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fan-in scaling, so each matmul keeps its input's scale
        for weight, fan_in in ((self.w_gate, self.hidden_size), (self.w_up, self.hidden_size), (self.w_down, self.ffn_size)):
            nn.init.normal_(weight, std=fan_in**-0.5)
        self.router.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.hidden_size)
        routing = route(self.router(tokens), self.top_k, self.renormalize, self.capacity_factor)
        run = experts if self.impl == "fused" else experts_reference
        return run(tokens, routing, self.w_gate, self.w_up, self.w_down).view(x.shape)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, {self.ffn_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, impl={self.impl!r}")
