"""moe-bwd's block cases: the MoE block of a transformers model as a user runs it, with the model's
router, its top-k and its experts module. Experts implementation "suite" (what
`use_suite_experts` switches a model to) is timed against "grouped_mm" (transformers' stock), as
eager calls of the block (`block`) and with the block under torch.compile (`block-compiled`);
beside them as a peer, Liger's experts (experts implementation "liger", gates/liger.py).

The experts' weights come from the gate's buffers, put in the block's own layout (transformers 5's
gate_up_proj [E, 2f, d] and down_proj [E, d, f]). The router's weight is drawn from a fixed
seed. Every block of one build shares these Parameters: the timed calls take gradients with
autograd.grad, so sharing adds nothing up, and mixtral's 2.8 GB of weights is held once, not once
per contender. A model preset's block (and its -4k one's) is its family's (olmoe, qwen3-30b-a3b,
mixtral); the tiny presets take OLMoE's.

Parity judges the same block beside the experts (BLOCK_OUTPUTS: its output and the gradients of
its input, the router's weight, gate_up_proj and down_proj): suite's block against stock's, both
against a float64 truth of the block on the experts stock chose.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from gates import liger
from gates.moe_peers import compiled, gate_up_layout, transformers5_missing
from gates.moe_truth import experts_truth
from suite.arms.moe import GateUpLayout, routing_from_topk
from suite.harness.gate import BenchCase, Buffers, Outputs, Preset

# preset -> (transformers' module, class prefix, the config's names for f and E)
_FAMILIES = {
    "olmoe": ("olmoe", "Olmoe", "intermediate_size", "num_experts"),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3Moe", "moe_intermediate_size", "num_experts"),
    "mixtral": ("mixtral", "Mixtral", "intermediate_size", "num_local_experts"),
}
BLOCK_CASES = ("block", "block-compiled")
# what parity judges of the block: its output, then the gradients of x, the router's weight, gate_up_proj, down_proj
BLOCK_OUTPUTS = ("block_out", "block_dx", "block_drouter", "block_dgate_up", "block_ddown")
# the builds' Parameters, by the buffers' x: they go when the runner lets the buffers go
_shared: WeakIdKeyDictionary = WeakIdKeyDictionary()


def block_missing(device: torch.device) -> str | None:
    """Both implementations go through transformers' experts interface; grouped_mm runs on any
    device (on cards without its CUTLASS kernels torch's fallback is what their users run)."""
    return transformers5_missing()


def block_liger_missing(device: torch.device) -> str | None:
    """The block with Liger's experts (experts implementation "liger"): transformers 5 and Liger's
    fused MoE where it runs."""
    return transformers5_missing() or liger.fused_moe_missing(device)


def _parameters(buffers: Buffers, preset: Preset) -> list[nn.Parameter]:
    """[router weight, gate_up_proj, down_proj] of this build, made once for its buffers."""
    x = buffers["x"]
    if x not in _shared:
        weights = [buffers[n] for n in ("w_gate", "w_up", "w_down")]
        gen = torch.Generator().manual_seed(0)
        router = torch.randn(weights[0].shape[0], x.shape[1], generator=gen) * x.shape[1] ** -0.5
        _shared[x] = [nn.Parameter(router.to(x.device, x.dtype)), *gate_up_layout(weights)]
    return _shared[x]


def block_bytes(p: dict[str, Any]) -> int:
    """The block's part of a moe-bwd preset's memory: the shared Parameters; its outputs (the
    weights' gradients beside x-sized ones) from stock and from suite twice (judged and
    determinism runs) in the working dtype and from the truth in float64 (its temporaries are
    one expert's, counted with the experts' truth); a bench call's gradients."""
    tokens, d, f, num_experts = p["tokens"], p["hidden"], p["ffn"], p["experts"]
    item = torch.empty((), dtype=getattr(torch, p["dtype"])).element_size()
    weights = num_experts * (3 * d * f + d)
    outputs = 2 * tokens * d + weights
    return (weights + 3 * outputs + weights) * item + outputs * 8


def block_judged(preset: Preset) -> bool:
    """Parity judges the block at every preset where transformers 5 is installed and stock's
    grouped_mm takes the widths (torch's grouped GEMM wants rows of a multiple of 16 bytes). The
    block routes x with its own router, so the preset's logits, skew and capacity do not reach
    it (a block drops no slot); its widths, token count and dtype do."""
    p = preset.params
    item = torch.empty((), dtype=getattr(torch, p["dtype"])).element_size()
    return transformers5_missing() is None and p["hidden"] * item % 16 == 0 and p["ffn"] * item % 16 == 0


def make_block(preset: Preset, buffers: Buffers, implementation: str,
               parameters: list[nn.Parameter] | None = None) -> nn.Module:
    """The preset's family's MoE block with experts implementation `implementation`, holding the
    build's shared Parameters (or `parameters`: router weight, gate_up_proj, down_proj), in
    training mode."""
    if implementation == "suite":
        from suite.integrations.transformers import register

        register()
    elif implementation == liger.EXPERTS_IMPLEMENTATION:
        liger.register()
    import transformers

    module, prefix, ffn_name, experts_name = _FAMILIES.get(preset.name.removesuffix("-4k"), _FAMILIES["olmoe"])
    p = preset.params
    # Qwen3-30B-A3B renormalises its top-k probabilities (OLMoE does not, Mixtral always does)
    renormalised = {"norm_topk_prob": True} if module == "qwen3_moe" else {}
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=p["hidden"], num_experts_per_tok=p["top_k"], **{ffn_name: p["ffn"], experts_name: p["experts"]},
        **renormalised)
    config._experts_implementation = implementation
    classes = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with torch.device("meta"):  # the Parameters below replace every weight it would make
        block = getattr(classes, f"{prefix}SparseMoeBlock")(config)
    block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj = parameters or _parameters(buffers, preset)
    return block.train()


def _forward_backward(block: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> Outputs:
    x = x.detach().unsqueeze(0).requires_grad_()
    out = block(x)
    leaves = (x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    # materialised: a router cut off from the experts (a saboteur) gets zeros, for parity to judge
    dx, *dweights = torch.autograd.grad(out, leaves, grad_out.unsqueeze(0), materialize_grads=True)
    return dict(zip(BLOCK_OUTPUTS, (out.detach()[0], dx[0], *dweights)))


def block_outputs(buffers: Buffers, preset: Preset, implementation: str, scores_detached: bool = False) -> Outputs:
    """BLOCK_OUTPUTS of the block on experts implementation `implementation`. scores_detached:
    a saboteur, the experts taking the router's top-k probabilities without their gradient path
    (the router then learns nothing through the experts)."""
    block = make_block(preset, buffers, implementation)
    if scores_detached:
        block.experts.register_forward_pre_hook(lambda _, args: (*args[:2], args[2].detach()))
    return _forward_backward(block, buffers["x"], buffers["grad_out"])


def block_truth(buffers: Buffers, preset: Preset) -> Outputs:
    """BLOCK_OUTPUTS in float64 on the experts stock's block chose in the working dtype (a near-tie
    broken the other way would swap a token's experts against the runs judged): the block's own
    router in float64 with those choices, then the experts in closed form (`experts_truth`, one
    expert at a time: no float64 copy of the weights, apart from any autograd), and the
    router's gradients from the experts' dprobs."""
    block = make_block(preset, buffers, "grouped_mm")
    with torch.no_grad():
        _, _, chosen = block.gate(buffers["x"])
    router = copy.deepcopy(block.gate).double()
    router.register_forward_hook(partial(_choosing, chosen))
    x = buffers["x"].detach().double().requires_grad_()
    _, probs, _ = router(x)
    routing = routing_from_topk(chosen, probs.detach(), router.weight.shape[0])
    routing = dataclasses.replace(routing, probs=probs.detach())
    w_gate, w_up, w_down = GateUpLayout().views(block.experts.gate_up_proj, block.experts.down_proj)
    got = experts_truth(x.detach(), routing, w_gate, w_up, w_down, buffers["grad_out"])
    drouter, dx_routing = torch.autograd.grad(probs, (router.weight, x), got["dprobs"])
    return dict(zip(BLOCK_OUTPUTS, (got["out"], got["dx"] + dx_routing, drouter,
                                    torch.cat([got["dw_gate"], got["dw_up"]], dim=2).transpose(1, 2),
                                    got["dw_down"].transpose(1, 2))))


def _choosing(chosen: torch.Tensor, gate: nn.Module, args, output):
    """The router's output with `chosen` experts, their probabilities in float64 (softmax over
    every expert, then the chosen top-k, renormalised where the family does)."""
    logits, scores, indices = output
    top = torch.softmax(logits, dim=-1).gather(1, chosen)
    if getattr(gate, "norm_topk_prob", True):  # Mixtral's router has no switch: it always renormalises
        top = top / top.sum(dim=-1, keepdim=True)
    # the router must still be softmax then top-k: where it chose as stock did, its scores are these
    same = (indices == chosen).all(dim=-1)
    if not torch.allclose(scores[same].double(), top[same].detach(), rtol=1e-5, atol=1e-7):
        raise RuntimeError(f"{type(gate).__name__} no longer scores its top-k as softmax probabilities: the float64 "
                           "block truth (gates/moe_block.py) must follow it")
    return logits, top, chosen


def build_block(implementation: str, compile_it: bool = False) -> Callable[[BenchCase, Buffers, Preset],
                                                                          Callable[[], Any]]:
    """A contender's build: one call is the block's forward and the backward for its input, the
    router's weight and the experts' weights, as a training step takes them."""

    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        if preset.params["capacity_factor"] is not None:
            raise ValueError("a transformers block drops no slot: no capacity factor")
        block = make_block(preset, buffers, implementation)
        run = compiled(block, preset) if compile_it else block
        x = buffers["x"].detach().unsqueeze(0).requires_grad_()
        grad_out = buffers["grad_out"].unsqueeze(0)
        leaves = [x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
        return lambda: torch.autograd.grad(run(x), leaves, grad_out)

    return build

