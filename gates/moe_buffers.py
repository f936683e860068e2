"""Gate `moe-bwd`'s buffers: drawn for a preset at the scales of a trained layer, or checked
when loaded from a recording (suite.record.capture), which may carry the model's own routing."""

from __future__ import annotations

from typing import Any

import torch

from suite.arms.moe import GeGLU, SwiGLU
from suite.errors import BadBuffers
from suite.files.buffers import expect_buffer
from suite.harness.gate import Buffers, Preset

# How the router logits are skewed: the edge cases are made by the routing itself.
#   none            plain random logits
#   empty-expert    expert 1 is never chosen
#   one-expert      every token's first choice is expert 0
#   skewed          logits in halves plus a linear bias over the experts: the first experts
#                   overflow a capacity, and equal probabilities (ties to the lower id) occur
SKEWS = ("none", "empty-expert", "one-expert", "skewed")
# A recording of a model holds its own top-k choice and combine weights in place of router
# logits: the gate routes with those (`routing_from_topk`, the path use_suite_experts runs),
# whatever the model's router computes (softmax or sigmoid, groups, biases, a scaling factor).
MODEL_ROUTING = ("top_k_index", "top_k_weights")


# A recording of an experts module with a clamped SwiGLU holds its limit (float64, 0-d) and
# whether the limit clamps silu's output rather than the gate (bool, 0-d); one with GeGLU
# experts holds "geglu" (bool, 0-d, true): `activation_of`.
SWIGLU_BUFFERS = ("swiglu_limit", "swiglu_clamps_silu")
GEGLU_BUFFER = "geglu"


def activation_of(preset: Preset) -> SwiGLU | GeGLU:
    """The experts' activation the preset names: GeGLU where it says glu "geglu", else plain
    SwiGLU unless it sets swiglu_limit."""
    if preset.params.get("glu") == "geglu":
        return GeGLU()
    return SwiGLU(preset.params.get("swiglu_limit"), preset.params.get("swiglu_clamp", "gate"))


def routed_by_model(preset: Preset) -> bool:
    """Whether the preset's buffers carry the model's own routing (buffer_params says so)."""
    return preset.params.get("routing") == "model"


def _router_logits(p: dict[str, Any], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    tokens, num_experts = p["tokens"], p["experts"]
    logits = 2.0 * torch.randn(tokens, num_experts, generator=gen, device=device)
    if p["skew"] == "empty-expert":
        logits[:, 1] = -30.0
    elif p["skew"] == "one-expert":
        logits[:, 0] = 30.0
    elif p["skew"] == "skewed":
        logits = logits.mul(2).round().div(2) + torch.linspace(2.0, -1.0, num_experts, device=device)
    return logits


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    p = preset.params
    tokens, d, f, num_experts = p["tokens"], p["hidden"], p["ffn"], p["experts"]
    dtype = getattr(torch, p["dtype"])
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, std):
        return (std * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    return {
        "x": normal(tokens, d, std=1.0),
        "logits": _router_logits(p, gen, device),
        "w_gate": normal(num_experts, d, f, std=d**-0.5),
        "w_up": normal(num_experts, d, f, std=d**-0.5),
        "w_down": normal(num_experts, f, d, std=f**-0.5),
        "grad_out": normal(tokens, d, std=1e-3),
    }


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    floats = (torch.float32, torch.bfloat16, torch.float16)
    x = expect_buffer("moe-bwd", buffers, "x", dtypes=floats)
    w_gate = expect_buffer("moe-bwd", buffers, "w_gate", dtypes=(x.dtype,))
    if x.dim() != 2 or w_gate.dim() != 3 or w_gate.shape[1] != x.shape[1]:
        raise BadBuffers(f"moe-bwd buffers 'x' [tokens, hidden] and 'w_gate' [experts, hidden, ffn] must agree on "
                         f"hidden, got {list(x.shape)} and {list(w_gate.shape)}; record them again with "
                         "`suite record moe-bwd --out DIR`")
    num_experts, d, f = w_gate.shape
    expect_buffer("moe-bwd", buffers, "w_up", shape=(num_experts, d, f), dtypes=(x.dtype,))
    expect_buffer("moe-bwd", buffers, "w_down", shape=(num_experts, f, d), dtypes=(x.dtype,))
    expect_buffer("moe-bwd", buffers, "grad_out", shape=tuple(x.shape), dtypes=(x.dtype,))
    params = dict(tokens=x.shape[0], hidden=d, ffn=f, experts=num_experts, dtype=str(x.dtype).removeprefix("torch."))
    routed = {**_model_routing_params(buffers, x.shape[0], num_experts), **_glu_params(buffers)}
    if not routed:
        if "logits" not in buffers:
            raise BadBuffers("moe-bwd buffers hold neither the router's 'logits' nor a model's 'top_k_index' and "
                             "'top_k_weights': the gate has nothing to route; record them again with "
                             "`suite record moe-bwd --out DIR` or suite.record.capture")
        expect_buffer("moe-bwd", buffers, "logits", shape=(x.shape[0], num_experts), dtypes=floats)
    return {**params, **routed}


def _held_both(buffers: Buffers, pair: tuple[str, str], what: str) -> bool:
    """Whether the recording holds both buffers of the pair; neither: False; one: BadBuffers."""
    held = [name for name in pair if name in buffers]
    if len(held) == 1:
        raise BadBuffers(f"moe-bwd buffers hold {held[0]!r} without {sorted(set(pair) - set(held))[0]!r}: "
                         f"{what} is both; record them again with suite.record.capture")
    return bool(held)


def _glu_params(buffers: Buffers) -> dict[str, Any]:
    """glu "geglu" where the recording holds GeGLU experts; swiglu_limit and swiglu_clamp where
    it holds a clamped SwiGLU; else none."""
    clamped = _held_both(buffers, SWIGLU_BUFFERS, "a clamped SwiGLU")
    if GEGLU_BUFFER in buffers:
        if expect_buffer("moe-bwd", buffers, GEGLU_BUFFER, shape=(), dtypes=(torch.bool,)).item():
            if clamped:
                raise BadBuffers("moe-bwd buffers hold 'geglu' and a SwiGLU's limit: a clamped GeGLU is none the "
                                 "experts compute; record them again with suite.record.capture")
            return dict(glu="geglu")
    if not clamped:
        return {}
    limit = expect_buffer("moe-bwd", buffers, "swiglu_limit", shape=(), dtypes=(torch.float64, torch.float32))
    clamps_silu = expect_buffer("moe-bwd", buffers, "swiglu_clamps_silu", shape=(), dtypes=(torch.bool,))
    try:
        swiglu = SwiGLU(limit.item(), "silu" if clamps_silu.item() else "gate")
    except ValueError as error:
        raise BadBuffers(f"moe-bwd buffer 'swiglu_limit': {error}; record them again with suite.record.capture") \
            from None
    return dict(swiglu_limit=swiglu.limit, swiglu_clamp=swiglu.clamp)


def _model_routing_params(buffers: Buffers, tokens: int, num_experts: int) -> dict[str, Any]:
    """routing "model" and its top_k where the recording holds the model's routing; else none."""
    if not _held_both(buffers, MODEL_ROUTING, "a model's routing"):
        return {}
    index = expect_buffer("moe-bwd", buffers, "top_k_index", dtypes=(torch.int64, torch.int32))
    if index.dim() != 2 or index.shape[0] != tokens or index.shape[1] < 1:
        raise BadBuffers(f"moe-bwd buffer 'top_k_index' must be [tokens={tokens}, k], got {list(index.shape)}; "
                         "record them again with suite.record.capture")
    expect_buffer("moe-bwd", buffers, "top_k_weights", shape=tuple(index.shape),
                  dtypes=(torch.float32, torch.bfloat16, torch.float16))
    if index.numel() and not bool(((index >= 0) & (index < num_experts)).all()):
        raise BadBuffers(f"moe-bwd buffer 'top_k_index' holds an expert id outside 0..{num_experts - 1} (the "
                         "weights' experts); record them again with suite.record.capture")
    return dict(routing="model", top_k=index.shape[1], capacity_factor=None)
