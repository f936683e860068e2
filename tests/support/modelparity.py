"""A whole plugged model's loss and gradients judged as the gates judge a kernel (DESIGN.md,
"Parity"): against a float64 run of the stock model, each tensor's error within k x stock's own
fp32 error plus a floor. A fixed bound holds on one CPU's kernels and fails on another's."""

from __future__ import annotations

import copy

import torch

from suite.harness.gate import Tolerance
from suite.harness.parity import tolerance_check
from suite.harness.results import TensorCheck

# The gates' k and floor; rows judged against the typical row's norm, as gate moe-bwd judges a
# router's gradient: one expert's row can cancel to a fortieth of the others (Gemma 4's router at
# init), and its relative error is then rounding noise over a tiny number (the fused norms' 8x
# stock's where GEMMs sum in another order).
GRADIENTS = Tolerance(k=2.0, floor=1e-6, row_floor=1.0)
# A gradient that cancelled to below this fraction of the model's largest is judged against that
# instead of its own norm: its bits are the rounding of larger terms (DeepSeek-V4's ffn_hc.scale,
# 1e-6 of the largest: an ulp's nudge of the experts' output moves its error over 6e-6..6e-5).
CANCELLED = 1e-3


def float64_truth(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The stock model's loss and gradients in float64. Call it before the suite's arms go in:
    it runs a copy of the model as it is, and their kernels do not run in float64."""
    twin = copy.deepcopy(model).double()
    twin.set_experts_implementation("eager")  # transformers' grouped_mm takes no float64; eager computes the same
    logits = twin(input_ids=ids, use_cache=False).logits
    # the causal LM loss taken here: transformers' casts the logits to fp32, which would round the truth
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in twin.named_parameters() if p.grad is not None}


def off_stocks_error(stock, plugged, truth, parity: Tolerance = GRADIENTS) -> list[str]:
    """The problems of the plugged model's (loss, {name: gradient}) against the float64 truth,
    each tensor allowed k x stock's own error plus the floor; [] when every one is within."""
    (stock_loss, stock_grads), (loss, grads), (true_loss, true_grads) = stock, plugged, truth
    if grads.keys() != stock_grads.keys():
        return [f"gradients of {sorted(grads.keys() ^ stock_grads.keys())} are in one run and not the other"]
    cancelled = CANCELLED * max(float(g.norm()) for g in true_grads.values())

    def gradient_check(name: str) -> TensorCheck:
        norm = float(true_grads[name].norm())
        judged_against = max(norm, cancelled)
        # errors relative to judged_against pass k x stock's + floor exactly where, relative to the
        # gradient's own norm, they pass k x stock's + the floor scaled up by the ratio of the two
        floor = parity.floor * judged_against / norm if norm else parity.floor
        # a row whose truth lies below the floor's share of the gradient can be lost within the floor
        # (DeepSeek-V4's attn_hc.fn has rows cancelled to 2e-7 of the others, beyond fp32's reach)
        noise = parity.floor * judged_against
        return tolerance_check(name, grads[name], stock_grads[name], true_grads[name], parity.k, floor,
                               parity.row_floor, noise)

    checks = [tolerance_check("loss", loss, stock_loss, true_loss, parity.k, parity.floor)]
    checks += [gradient_check(name) for name in stock_grads]
    return [problem.message for check in checks for problem in check.problems]
