"""Mixture-of-experts: top-k routing into an expert-sorted layout, then SwiGLU experts on
Triton kernels, forward and backward, beside their eager references. The modules read in the
order data flows through a layer:

    routing        Routing, route / route_reference, routing_from_topk (a model's own top-k) / its
                   reference in torch ops
    route_kernels  the routing's Triton kernels: top-k and the layout, and their backward
    weights        GateUpLayout: how a model stores its fused gate_up and down weights
    activation     SwiGLU: plain, or clamped at a limit as some models train it; GeGLU
    layer          experts / experts_reference over a Routing, gate_up_experts (a model's own
                   weights and layout), MoEExperts (router + routing + experts)
    launch         the experts' launchers: each GEMM, SwiGLU backward and combine, a layer's plan
    config         the launch choices (tiles, TMA or grouped_mm paths), once per call shape
    kernels        the experts' Triton bodies

    routing = route(logits, k)                        # or routing_from_topk(top_k_index, weights, E)
    out = experts(x, routing, w_gate, w_up, w_down)   # autograd: x, the weights, the probs (hence logits)
    out = gate_up_experts(x, routing, gate_up_proj, down_proj)   # a model's [E, 2f, d] and [E, d, f]
"""

from suite.arms.moe.activation import GeGLU, SwiGLU
from suite.arms.moe.layer import (
    EXPERTS_IMPLS,
    MoEExperts,
    expert_rows,
    experts,
    experts_reference,
    fused_layer,
    gate_up_experts,
)
from suite.arms.moe.routing import (
    Routing,
    expert_capacity,
    jittered,
    route,
    route_reference,
    router_z_loss,
    routing_from_topk,
    routing_from_topk_reference,
    trusted_routing,
)
from suite.arms.moe.weights import GateUpLayout

__all__ = ["EXPERTS_IMPLS", "GateUpLayout", "GeGLU", "MoEExperts", "Routing", "SwiGLU", "expert_capacity", "expert_rows",
           "experts", "experts_reference", "fused_layer", "gate_up_experts", "jittered", "route", "route_reference",
           "router_z_loss", "routing_from_topk", "routing_from_topk_reference", "trusted_routing"]
