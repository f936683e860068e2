"""The experts: SwiGLU FFNs over a `Routing`, weights w_gate [E, d, f], w_up [E, d, f],
w_down [E, f, d]:

    out[t] = sum over kept slots s of probs[t, s] * FFN_e(x[t]),  e = expert_ids[t, s]
    FFN_e(v) = (silu(v @ w_gate[e]) * (v @ w_up[e])) @ w_down[e]

or with a clamped SwiGLU (`activation.SwiGLU`: a limit on gate and up) or GeGLU
(`activation.GeGLU`, gelu's tanh form) in its place,

with the weighted sum in fp32 and out in x's dtype. `experts_reference` is the eager autograd
reference (gradients for x, the weights and probs, hence the logits); `experts` is the same
layer on the Triton kernels of `launch` (forward and backward, no host sync) behind one autograd
node, eager and under torch.compile (where the kernels run as custom ops); `gate_up_experts`
takes a model's fused gate_up and down as it stores them, and gives their gradients back in
that layout (`weights.GateUpLayout`); `MoEExperts` is the module: router, top-k routing and
experts, either impl. The float64 truth the gate judges against is the gate's
(gates/moe_truth.py).
"""

from __future__ import annotations

from fractions import Fraction

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from suite.arms.moe import launch, route_kernels
from suite.arms.moe.activation import GELU_TANH, PLAIN, GatedActivation, SwiGLU, activation_of, as_activation
from suite.arms.moe.routing import (
    Routing,
    check_capacity_factor,
    check_route_args,
    expert_capacity,
    jittered,
    row_bound,
    route,
    route_grads,
)
from suite.arms.moe.weights import GateUpLayout
from suite.triton_support import FLOAT_DTYPES, runs_on


def _check_experts_args(x, routing, w_gate, w_up, w_down) -> None:
    if not isinstance(routing, Routing):
        raise TypeError(f"experts: routing must be a Routing from route() or routing_from_topk(), got "
                        f"{type(routing).__name__}")
    _check_expert_tensors("experts", x, routing.num_tokens, routing.num_experts, w_gate, w_up, w_down)


def _check_like_x(fn, x, **weights) -> None:
    """The kernels take x and the weights in one dtype on one device (the eager reference
    takes mixed ones, as autocast gives them)."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: x must be bfloat16, float16 or float32 (the kernels' dtypes), not {x.dtype}")
    for name, w in weights.items():
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{fn}: {name} is {w.dtype} on {w.device} but x is {x.dtype} on {x.device}: the "
                             f"kernels take x and the weights in one dtype on one device")


def _check_expert_tensors(fn, x, num_tokens, num_experts, w_gate, w_up, w_down) -> None:
    """x [num_tokens, d] and the weights w_gate/w_up [E, d, f], w_down [E, f, d] of the routing's E."""
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):  # x: _check_tokens
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
    if w_gate.dim() != 3:
        raise ValueError(f"{fn}: w_gate must be [experts, hidden, ffn], got shape {tuple(w_gate.shape)}")
    weight_experts, d, f = w_gate.shape
    _check_tokens(fn, x, d, num_tokens, num_experts, weight_experts)
    if w_up.shape != (weight_experts, d, f) or w_down.shape != (weight_experts, f, d):
        raise ValueError(
            f"{fn}: weights must be w_gate/w_up [E, d, f] and w_down [E, f, d], got "
            f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}"
        )


def _check_tokens(fn, x, d, num_tokens, num_experts, weight_experts) -> None:
    """x [num_tokens, d], and the routing's experts the weights'."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: x must be a tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"{fn}: x must be [tokens, {d}], got shape {tuple(x.shape)}")
    if x.shape[0] != num_tokens:
        raise ValueError(f"{fn}: x has {x.shape[0]} tokens but the routing has {num_tokens}")
    if num_experts != weight_experts:
        raise ValueError(f"{fn}: the routing has {num_experts} experts but the weights {weight_experts}")


def expert_rows(routing: Routing) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each expert's kept (tokens, slots), tokens ascending. Finding them reads the layout on the
    host (a sync): for setting up a reference or a benchmark once, not for a training step."""
    chosen = routing.expert_ids.long()
    kept = routing.kept
    return [torch.nonzero((chosen == e) & kept, as_tuple=True) for e in range(routing.num_experts)]


def experts_reference(x, routing: Routing, w_gate, w_up, w_down, rows=None, activation: GatedActivation | None = None
                      ) -> torch.Tensor:
    """Eager experts, one expert at a time. The matmuls run in x's dtype, the activation and the
    weighted sum in fp32 (float64 when x is float64); autograd gives every gradient.

    rows: `expert_rows(routing)`, found once by the caller; then the call itself never syncs
    (a benchmark can capture it in a CUDA graph). activation: a clamped SwiGLU or GeGLU, None for plain
    SwiGLU."""
    _check_experts_args(x, routing, w_gate, w_up, w_down)
    activation = as_activation(activation, "experts_reference")
    wide = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape[0], w_down.shape[-1], device=x.device, dtype=wide)
    for e, (tokens, slots) in enumerate(expert_rows(routing) if rows is None else rows):
        # route() picks an expert at most once a token, so `tokens` has no repeats and index_add_
        # below adds each row once: the sum's order is the expert order, run to run (a top-k
        # from routing_from_topk that names an expert twice for one token adds in any order)
        v = x[tokens]
        hidden = activation((v @ w_gate[e]).to(wide), (v @ w_up[e]).to(wide))
        y = hidden.to(x.dtype) @ w_down[e]
        weight = routing.probs[tokens, slots].to(wide)
        out = out.index_add(0, tokens, weight[:, None] * y.to(wide))
    return out.to(x.dtype)


def _plan(x, probs, weights, layout, token_of_row, activation) -> launch.LayerPlan | None:
    return launch.layer_plan(x, weights, layout, token_of_row.shape[0], probs.shape[1], activation)


def _experts_forward(plan, x, probs, weights, layout, activation, token_of_row, offsets, row_id_map, eager=False):
    """-> (out, and what the backward reads: a, gu, y_rows). Every buffer is sized by the
    routing's max_rows (a host bound), so neither pass reads R on the host; rows past R are
    never read. Through the call shape's kept LayerPlan (`launch.layer_plan`) where there is one
    (eager, not a custom op: a and gu share one allocation), else through the entry points,
    which name what they refuse; gu is laid out as the plan lays it (see LayerPlan)."""
    if plan is not None:
        return plan.forward(x, probs, weights, token_of_row, offsets, row_id_map, one_buffer=eager)
    w_gate, w_up, w_down = weights if layout is None else layout.views(*weights)
    a, g, u = launch.expert_up(x, w_gate, w_up, token_of_row, offsets, activation=activation)
    y_rows = launch.expert_down(a, w_down, offsets)
    if layout is None:
        gu = torch.stack((g, u))
    else:
        gu = g.new_empty(g.shape[0], 2 * g.shape[1])
        for half, value in zip(layout.halves(gu), (g, u)):
            half.copy_(value)
    return launch.combine(y_rows, row_id_map, probs), a, gu, y_rows


def _experts_backward(plan, grad_out, x, probs, weights, layout, activation, a, gu, y_rows, token_of_row, offsets,
                      row_id_map, reuse_saved=False, wanted=(True, True, True)):
    """-> (dx, dprobs, the weights' gradients in their shapes and layout). reuse_saved: a, gu
    and y_rows are dead after this call, and the plan may write into them. wanted: dx, gate and
    up's gradient, down's (`LayerPlan.backward`); the entry points compute each, for the
    calls no plan takes (they name what they refuse), and the unwanted are dropped."""
    grad_out = grad_out.contiguous()
    if plan is not None:
        return plan.backward(grad_out, x, probs, weights, a, gu, y_rows, token_of_row, offsets, row_id_map,
                             reuse_saved, wanted)
    w_gate, w_up, w_down = weights if layout is None else layout.views(*weights)
    g, u = (t.contiguous() for t in (gu.unbind(0) if layout is None else layout.halves(gu)))
    grad_rows, grad_probs = launch.combine_backward(grad_out, y_rows, probs, row_id_map)
    dg, du, dw_down = launch.expert_down_backward(grad_rows, a, g, u, w_down, offsets, activation=activation)
    dx_rows, dw_gate, dw_up = launch.expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets)
    # each token's k slots summed in slot order, so dx repeats its bits run to run
    dx = launch.combine(dx_rows, row_id_map, top_k=probs.shape[1])
    if layout is None:
        grads = (dw_gate, dw_up, dw_down)
    else:
        grads = tuple(w.new_empty(w.shape) for w in weights)
        for view, value in zip(layout.views(*grads), (dw_gate, dw_up, dw_down)):
            view.copy_(value)
    dx, grads = _drop_unwanted(dx, grads, wanted)
    return dx, grad_probs, grads


# whether the running backward keeps its graph; where torch lacks the query, assume it does
_graph_kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)


class _ExpertsFunction(torch.autograd.Function):
    """The experts' one autograd node, eager and under torch.compile. Its weights are w1, w2,
    w3 = (w_gate, w_up, w_down), or with a GateUpLayout, (gate_up, down, None): a model's own
    tensors, whose gradients it returns in their layout; its activation a SwiGLU or GeGLU. `experts` gives it a routing's probs
    and layout; `fused_layer` gives it the logits and `route`, the routing's arguments (k,
    renormalize, capacity, max_rows, z_loss), and the routing's launches run in the same node
    (one node's dispatch instead of two; the same bits as route() then experts()). Eager calls
    run the kernels through the call shape's LayerPlan; under torch.compile the same kernels
    run as the custom ops below, which dynamo cannot see into."""

    @staticmethod
    def forward(ctx, x, w1, w2, w3, layout, activation, probs, token_of_row, offsets, row_id_map, logits, route):
        weights = (w1, w2) if layout is not None else (w1, w2, w3)
        ctx.compiled, ctx.layout, ctx.activation = torch.compiler.is_compiling(), layout, activation
        ctx.route, lse, expert_ids, z = route, None, None, None
        if route is not None:
            k, renormalize, capacity, max_rows, z_loss = route
            forward = torch.ops.suite.moe_route if ctx.compiled else route_kernels.route_forward
            probs, expert_ids, offsets, row_id_map, _, token_of_row, _, lse, z = forward(
                logits, k, renormalize, capacity, max_rows, z_loss)
            z = z if z_loss else None
        if ctx.compiled:
            ctx.plan = None
            out, *saved = _experts_op(x, probs, list(weights), token_of_row, offsets, row_id_map, *_flags(layout),
                                      activation.mode, activation.kernel_limit, torch.empty(0, device=x.device))
        else:
            ctx.plan = _plan(x, probs, weights, layout, token_of_row, activation)  # the backward's too: one lookup
            out, *saved = _experts_forward(ctx.plan, x, probs, weights, layout, activation, token_of_row, offsets,
                                           row_id_map, eager=True)
        ctx.save_for_backward(x, probs, *saved, token_of_row, offsets, row_id_map, logits, lse, expert_ids, *weights)
        # the z-loss's gradient may never come (set_materialize_grads: no zeros made for it)
        ctx.set_materialize_grads(False)
        return out, z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_z):
        x, probs, a, gu, y_rows, token_of_row, offsets, row_id_map, logits, lse, expert_ids, *weights = ctx.saved_tensors
        dx = grad_probs = None
        grads = (None,) * len(weights)
        # frozen weights (or x) get no gradient, and their GEMMs are not run
        need = ctx.needs_input_grad
        wanted = (need[0], need[1] or need[2], need[3]) if ctx.layout is None else (need[0], need[1], need[2])
        if grad_out is not None:
            if ctx.compiled:
                dx, grad_probs, *grads = _experts_backward_op(grad_out.contiguous(), x, probs, weights, a, gu, y_rows,
                                                              token_of_row, offsets, row_id_map, *_flags(ctx.layout),
                                                              ctx.activation.mode, ctx.activation.kernel_limit, *wanted)
                dx, grads = _drop_unwanted(dx, grads, wanted)
            else:
                # the saved activations die with this backward unless the graph is kept
                # (retain_graph, create_graph): only then may it write its temporaries into them
                dx, grad_probs, grads = _experts_backward(ctx.plan, grad_out, x, probs, weights, ctx.layout,
                                                          ctx.activation, a, gu, y_rows, token_of_row, offsets,
                                                          row_id_map, reuse_saved=not _graph_kept(), wanted=wanted)
        w1, w2, w3 = (*grads, None) if ctx.layout is not None else grads
        if ctx.route is None:
            return dx, w1, w2, w3, None, None, grad_probs, None, None, None, None, None
        renormalize, z_loss = ctx.route[1], ctx.route[4]
        backward = torch.ops.suite.moe_route_backward if ctx.compiled else route_kernels.route_backward
        dlogits = route_grads(grad_probs, grad_z if z_loss else None, backward, logits, lse, expert_ids, probs,
                              renormalize)
        return dx, w1, w2, w3, None, None, None, None, None, None, dlogits, None


def experts(x, routing: Routing, w_gate, w_up, w_down, activation: GatedActivation | None = None) -> torch.Tensor:
    """`experts_reference`'s maths on the Triton kernels: out [T, d] in x's dtype, and under
    autograd the gradients for x, the three weights and routing.probs (hence the logits).
    x and the weights share one dtype (bf16, fp16 or fp32); fp32 math throughout. Under
    torch.compile the same kernels run as custom ops (no graph break, the same bits).
    activation: a clamped SwiGLU (`SwiGLU(limit, clamp)`) or `GeGLU()`, None for plain SwiGLU."""
    _check_experts_args(x, routing, w_gate, w_up, w_down)
    _check_like_x("experts", x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    activation = as_activation(activation, "experts")
    probs = routing.probs if routing.probs.is_contiguous() else routing.probs.contiguous()
    out, _ = _ExpertsFunction.apply(x.contiguous(), w_gate, w_up, w_down, None, activation, probs,
                                    routing.token_of_row, routing.offsets, routing.row_id_map, None, None)
    return out


def gate_up_experts(x, routing: Routing, gate_up_proj, down_proj, *, transposed: bool = False,
                    concatenated: bool = True, activation: GatedActivation | None = None) -> torch.Tensor:
    """`experts` on a model's own fused weights as it stores them (transformers' flags:
    `GateUpLayout`): gate_up_proj [E, 2f, d] and down_proj [E, d, f], or [E, d, 2f] and
    [E, f, d] when transposed; gate's f then up's along 2f when concatenated, else alternating.
    Their gradients come back in that same layout, written there by the kernels, so autograd
    adds no copy of weight-sized memory on the way to the parameters. The same maths as
    `experts` on `GateUpLayout(...).views(gate_up_proj, down_proj)`; activation as there."""
    layout = GateUpLayout(bool(transposed), bool(concatenated))
    activation = as_activation(activation, "gate_up_experts")
    if not isinstance(routing, Routing):
        raise TypeError(f"gate_up_experts: routing must be a Routing from route() or routing_from_topk(), got "
                        f"{type(routing).__name__}")
    num_experts, d, _ = layout.sizes(gate_up_proj, down_proj, "gate_up_experts")
    _check_tokens("gate_up_experts", x, d, routing.num_tokens, routing.num_experts, num_experts)
    _check_like_x("gate_up_experts", x, gate_up_proj=gate_up_proj, down_proj=down_proj)
    probs = routing.probs if routing.probs.is_contiguous() else routing.probs.contiguous()
    out, _ = _ExpertsFunction.apply(x.contiguous(), gate_up_proj, down_proj, None, layout, activation, probs,
                                    routing.token_of_row, routing.offsets, routing.row_id_map, None, None)
    return out


def fused_layer(logits, x, w_gate, w_up, w_down, k, renormalize, capacity_factor, z_loss,
                activation: GatedActivation = PLAIN):
    """-> (out, z-loss or None): route(logits) then experts(x) in one autograd node, for
    MoEExperts where the routing kernels run (its own weights fix the shapes)."""
    check_route_args("MoEExperts", logits, k, capacity_factor)
    num_tokens, num_experts = logits.shape
    _check_expert_tensors("MoEExperts", x, num_tokens, num_experts, w_gate, w_up, w_down)
    capacity = None if capacity_factor is None else expert_capacity(capacity_factor, num_tokens, k, num_experts)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    route = (k, renormalize, num_tokens * k if capacity is None else capacity,
             row_bound(num_tokens, k, num_experts, capacity), z_loss)
    return _ExpertsFunction.apply(x.contiguous(), w_gate, w_up, w_down, None, as_activation(activation, "fused_layer"),
                                  None, None, None, None, logits, route)


# ---- the custom ops torch.compile sees: opaque to dynamo, shapes from their fake versions;
# ---- the autograd node above calls them, so they carry no autograd of their own. Their
# ---- weights: three (w_gate, w_up, w_down), or two (gate_up, down) in the layout the flags name


def _flags(layout: GateUpLayout | None) -> tuple[bool, bool]:
    return (False, True) if layout is None else (layout.transposed, layout.concatenated)



def _layout_of(weights, transposed: bool, concatenated: bool) -> GateUpLayout | None:
    return GateUpLayout(transposed, concatenated) if len(weights) == 2 else None


@torch.library.custom_op("suite::moe_experts", mutates_args=())
def _experts_op(x: torch.Tensor, probs: torch.Tensor, weights: list[torch.Tensor], token_of_row: torch.Tensor,
                offsets: torch.Tensor, row_id_map: torch.Tensor, transposed: bool, concatenated: bool, act: int,
                limit: float, call_token: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """call_token: an empty tensor of the call's own, never read. AOTAutograd's CSE merges pure
    calls on the same inputs (a layer called twice on one x); the token keeps them two (CSE
    leaves aten.empty alone), so each backward writes into its own call's saved buffers."""
    layout, activation = _layout_of(weights, transposed, concatenated), activation_of(act, limit)
    return _experts_forward(_plan(x, probs, weights, layout, token_of_row, activation), x, probs, weights, layout,
                            activation, token_of_row, offsets, row_id_map)


@_experts_op.register_fake
def _(x, probs, weights, token_of_row, offsets, row_id_map, transposed, concatenated, act, limit, call_token):
    layout = _layout_of(weights, transposed, concatenated)
    rows = token_of_row.shape[0]
    _, d, f = (weights[0] if layout is None else layout.gate_up_views(weights[0])[0]).shape
    gu_shape = (2, rows, f) if layout is None else (rows, 2 * f)
    return x.new_empty(x.shape[0], d), x.new_empty(rows, f), x.new_empty(gu_shape), x.new_empty(rows, d)


@torch.library.custom_op("suite::moe_experts_backward", mutates_args=())
def _experts_backward_op(grad_out: torch.Tensor, x: torch.Tensor, probs: torch.Tensor, weights: list[torch.Tensor],
                         a: torch.Tensor, gu: torch.Tensor, y_rows: torch.Tensor, token_of_row: torch.Tensor,
                         offsets: torch.Tensor, row_id_map: torch.Tensor, transposed: bool, concatenated: bool,
                         act: int, limit: float, want_dx: bool, want_gate_up: bool,
                         want_down: bool) -> list[torch.Tensor]:
    """-> [dx, dprobs, the weights' gradients, in their shapes]; an empty tensor for each one
    not wanted (an op's list holds no None).

    a, gu and y_rows are the forward's saved activations, its call's own (`_experts_op`'s
    call_token); where the running backward keeps no graph (read here, at run time: a compiled
    backward cannot trace the query) nothing reads them after this op, and its temporaries go
    into them as the eager backward's do. Not while a CUDA graph captures it: a replay repeats
    the choice made at capture, whatever graph it then runs in. Called outside a backward
    (opcheck), the query says kept, and no input is written."""
    layout, activation = _layout_of(weights, transposed, concatenated), activation_of(act, limit)
    wanted = (want_dx, want_gate_up, want_down)
    dx, grad_probs, grads = _experts_backward(_plan(x, probs, weights, layout, token_of_row, activation), grad_out, x,
                                              probs, weights, layout, activation, a, gu, y_rows, token_of_row, offsets,
                                              row_id_map, reuse_saved=_dies_here(x), wanted=wanted)
    return [t if t is not None else x.new_empty(0) for t in (dx, grad_probs, *grads)]


def _dies_here(x: torch.Tensor) -> bool:
    """Whether the compiled backward running now is the last reader of its saved activations."""
    return not _graph_kept() and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


@_experts_backward_op.register_fake
def _(grad_out, x, probs, weights, a, gu, y_rows, token_of_row, offsets, row_id_map, transposed, concatenated,
      act, limit, want_dx, want_gate_up, want_down):
    wanted_weights = (want_gate_up,) * (len(weights) - 1) + (want_down,)
    return [x.new_empty(x.shape if want_dx else 0), probs.new_empty(probs.shape),
            *(w.new_empty(w.shape if wanted else 0) for w, wanted in zip(weights, wanted_weights))]


def _drop_unwanted(dx, grads, wanted):
    """dx and the weights' gradients with None for each one not wanted (the backward op's empty
    placeholders, or what the entry points computed anyway)."""
    want_dx, want_gate_up, want_down = wanted
    *gate_up, down = grads
    return dx if want_dx else None, (*(g if want_gate_up else None for g in gate_up), down if want_down else None)


EXPERTS_IMPLS = ("fused", "eager")
GLUS = ("swiglu", "geglu")


class MoEExperts(nn.Module):
    """A SwiGLU mixture-of-experts layer: a router (linear d -> E, no bias), top-k routing with
    an optional capacity factor, and the experts. impl="fused": `experts` (the Triton kernels);
    "eager": `experts_reference`. swiglu_limit, swiglu_clamp: a clamped SwiGLU (`SwiGLU`);
    glu="geglu": GeGLU experts (`GeGLU`), never clamped.
    forward(x [..., d]) -> out of x's shape and dtype."""

    def __init__(self, hidden_size: int, ffn_size: int, num_experts: int, top_k: int,
                 capacity_factor: float | None = None, renormalize: bool = True, impl: str = "fused",
                 z_loss: bool = False, jitter_eps: float | None = None, generator: torch.Generator | None = None,
                 swiglu_limit: float | None = None, swiglu_clamp: str = "gate", glu: str = "swiglu", device=None,
                 dtype=None):
        super().__init__()
        sizes = dict(hidden_size=hidden_size, ffn_size=ffn_size, num_experts=num_experts, top_k=top_k)
        for name, size in sizes.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"MoEExperts: {name} must be an int >= 1, got {type(size).__name__} {size!r}")
        if top_k > num_experts:
            raise ValueError(f"MoEExperts: top_k must be at most num_experts ({num_experts}), got {top_k}")
        if impl not in EXPERTS_IMPLS:
            raise ValueError(f'MoEExperts: impl must be "fused" or "eager", not {impl!r}')
        if jitter_eps is not None:
            jittered(torch.empty(0), jitter_eps, fn="MoEExperts")  # checks eps now, not at the first step
        # z_loss: each forward leaves the router z-loss in last_z_loss, for the loop to add to its
        # loss; jitter_eps: the router's input times noise in [1 - eps, 1 + eps] while training
        self.z_loss, self.jitter_eps, self.generator = z_loss, jitter_eps, generator
        self.last_z_loss: torch.Tensor | None = None
        self.hidden_size, self.ffn_size, self.num_experts, self.top_k = hidden_size, ffn_size, num_experts, top_k
        check_capacity_factor("MoEExperts", capacity_factor)
        if glu not in GLUS:
            raise ValueError(f"MoEExperts: glu must be one of {GLUS}, not {glu!r}")
        if glu == "geglu" and swiglu_limit is not None:
            raise ValueError("MoEExperts: swiglu_limit clamps a SwiGLU; GeGLU experts take none (pass glu='swiglu')")
        self.activation = GELU_TANH if glu == "geglu" else SwiGLU(swiglu_limit, swiglu_clamp)
        self.capacity_factor, self.renormalize, self.impl = capacity_factor, renormalize, impl
        # exact, and a constant to torch.compile (a float attribute turns symbolic under dynamic=True)
        self._capacity = None if capacity_factor is None else Fraction(repr(float(capacity_factor)))
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
        self._check_input(x)
        tokens = x.reshape(-1, self.hidden_size)
        router_input = tokens
        if self.training and self.jitter_eps is not None:
            router_input = jittered(tokens, self.jitter_eps, self.generator)
        logits = self.router(router_input)
        if self.impl == "fused" and tokens.shape[0] and runs_on(logits):
            # with z_loss, last_z_loss holds this layer's graph (its saved activations) until a
            # backward through it or the next forward, as the output does
            out, self.last_z_loss = fused_layer(logits, tokens, self.w_gate, self.w_up, self.w_down, self.top_k,
                                                 self.renormalize, self._capacity, self.z_loss, self.activation)
            return out.view(x.shape)
        routing = route(logits, self.top_k, self.renormalize, self._capacity, z_loss=self.z_loss)
        self.last_z_loss = routing.z_loss
        run = experts if self.impl == "fused" else experts_reference
        return run(tokens, routing, self.w_gate, self.w_up, self.w_down, activation=self.activation).view(x.shape)

    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"MoEExperts: x must be a tensor [..., {self.hidden_size}], got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"MoEExperts: x must be [..., {self.hidden_size}] (the layer's hidden_size), "
                             f"got shape {tuple(x.shape)}")
        weights = self.w_gate.dtype
        # under autocast the eager reference's matmuls take mixed dtypes; the fused path checks its own
        if x.dtype != weights and not torch.is_autocast_enabled(x.device.type):
            fix = f"x.to({weights}) or layer.to({x.dtype})" if x.is_floating_point() else f"x.to({weights})"
            raise TypeError(f"MoEExperts: x is {x.dtype} but the layer's weights are {weights}: pass {fix}")

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, {self.ffn_size}, experts={self.num_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, impl={self.impl!r}"
                + (", glu='geglu'" if self.activation is GELU_TANH else "")
                + ("" if self.activation.limit is None else f", swiglu_limit={self.activation.limit}, "
                                                            f"swiglu_clamp={self.activation.clamp!r}"))
