"""The MoE layer's float64 truth, in closed form apart from any autograd: what gate `moe-bwd`
and the arm's tests judge errors against."""

from __future__ import annotations

import torch

from suite.arms.moe import GeGLU, Routing, SwiGLU


def experts_truth(x, routing: Routing, w_gate, w_up, w_down, grad_out=None,
                  activation: SwiGLU | GeGLU = SwiGLU()) -> dict[str, torch.Tensor]:
    """The layer in closed form in float64, apart from any autograd, one expert at a time (its
    temporaries are one expert's rows): {"out"} and, given grad_out, "dx", "dw_gate", "dw_up",
    "dw_down" and "dprobs". activation: plain or clamped SwiGLU, or GeGLU, its derivative in
    closed form (`backward`)."""
    x, probs = x.double(), routing.probs.detach().double()
    chosen, kept = routing.expert_ids.long(), routing.kept
    out = torch.zeros_like(x)
    grads = grad_out is not None
    if grads:
        grad_out = grad_out.double()
        dx, dprobs = torch.zeros_like(x), torch.zeros_like(probs)
        dws = [torch.zeros(w.shape, dtype=torch.float64, device=x.device) for w in (w_gate, w_up, w_down)]
    for e in range(routing.num_experts):
        tokens, slots = torch.nonzero((chosen == e) & kept, as_tuple=True)
        wg, wu, wd = w_gate[e].double(), w_up[e].double(), w_down[e].double()
        v = x[tokens]
        g, u = v @ wg, v @ wu
        h = activation(g, u)
        y = h @ wd
        p = probs[tokens, slots][:, None]
        out.index_add_(0, tokens, p * y)
        if grads:
            dprobs[tokens, slots] = (grad_out[tokens] * y).sum(-1)
            dy = grad_out[tokens] * p
            dh = dy @ wd.T
            dg, du = activation.backward(dh, g, u)
            dws[0][e], dws[1][e], dws[2][e] = v.T @ dg, v.T @ du, h.T @ dy
            dx.index_add_(0, tokens, dg @ wg.T + du @ wu.T)
    if not grads:
        return {"out": out}
    return {"out": out, "dx": dx, "dw_gate": dws[0], "dw_up": dws[1], "dw_down": dws[2], "dprobs": dprobs}


def routing_truth(logits: torch.Tensor, routing: Routing, renormalize: bool = True):
    """(probs, wide_logits) in float64: the routing's chosen probabilities recomputed from the
    logits (the choice held fixed), differentiable to wide_logits, a float64 leaf:
    `torch.autograd.grad(probs, wide_logits, dprobs)` is the logits' gradient."""
    wide = logits.detach().double().requires_grad_()
    probs = torch.softmax(wide, dim=-1).gather(1, routing.expert_ids.long())
    if renormalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, wide
