"""The MoE experts a user would run instead of the arm, as gate moe-bwd times them beside it:
torch._grouped_mm over the same expert-sorted rows (separate weights, or transformers 5's fused
gate_up layout, eager or compiled), transformers' own grouped_mm experts, SonicMoE, Liger's fused
MoE, and a padded batched matmul; each takes a routing made once at build time."""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from suite.device_profile import active_profile
from suite.harness.gate import Preset


def _swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (F.silu(g.float()) * u.float()).to(g.dtype)


def _combine_in_torch(y_rows: torch.Tensor, routing) -> torch.Tensor:
    """out[t] = sum over kept slots of probs * y_rows[row], fp32, dropped slots weighted 0."""
    rows = routing.row_id_map.long()
    weight = torch.where(rows >= 0, routing.probs.reshape(-1), 0.0)
    slots = y_rows[rows.clamp(min=0)].float() * weight[:, None]
    return slots.view(routing.num_tokens, routing.k, -1).sum(1).to(y_rows.dtype)


def grouped_mm_experts(x, routing, w_gate, w_up, w_down) -> torch.Tensor:
    """The experts' three GEMMs on torch._grouped_mm over the same expert-sorted rows, the
    gathers and the combine in torch. Rows past R (capacity drops only) hold whatever the GEMMs
    leave there and reach nothing but a zero weight."""
    ends = routing.offsets[1:]
    x_rows = x[routing.token_of_row.long().clamp(min=0)]
    g = torch._grouped_mm(x_rows, w_gate, offs=ends)
    u = torch._grouped_mm(x_rows, w_up, offs=ends)
    y_rows = torch._grouped_mm(_swiglu(g, u), w_down, offs=ends)
    return _combine_in_torch(y_rows, routing)


def gate_up_layout(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weights as transformers 5 stores a model's experts: gate_up_proj [E, 2f, d] (gate then
    up, each row an output feature) and down_proj [E, d, f]; fresh leaves, made at build time."""
    w_gate, w_up, w_down = (w.detach() for w in weights)
    gate_up = torch.cat([w_gate, w_up], dim=2).transpose(1, 2).contiguous()
    return [nn.Parameter(gate_up), nn.Parameter(w_down.transpose(1, 2).contiguous())]


def grouped_mm_gate_up(x, routing, gate_up, down) -> torch.Tensor:
    """transformers 5's grouped_mm experts on the same expert-sorted rows: gate and up in one
    torch._grouped_mm over the concatenated weight, torch's own silu * up in x's dtype, the
    down projection, the combine in torch."""
    ends = routing.offsets[1:]
    x_rows = x[routing.token_of_row.long().clamp(min=0)]
    gate, up = torch._grouped_mm(x_rows, gate_up.transpose(-2, -1), offs=ends).chunk(2, dim=-1)
    y_rows = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=ends)
    return _combine_in_torch(y_rows, routing)


# Compiled peers are timed at the model presets alone: compiling a forward and backward costs
# seconds of the host's time per contender and shape (each report's cold_ms), which `suite run`
# (top2-small) keeps for timing within its budget.
COMPILED_AT = ("olmoe", "qwen3-30b-a3b", "mixtral", "olmoe-4k", "qwen3-30b-a3b-4k", "mixtral-4k")
_compiled: dict[tuple, Callable] = {}


def compiled(fn: Callable, preset: Preset) -> Callable:
    """fn under torch.compile(fullgraph=True, dynamic=False), once per preset: its cases, modes
    and rotated inputs share the compiled code. A new preset starts dynamo afresh: past its
    recompile limit (8 shapes of one function) it would run the eager code without a word."""
    if preset.name not in COMPILED_AT:
        raise ValueError(f"compiled peers are timed at {', '.join(COMPILED_AT)} only (compile time)")
    key = (fn, preset.name, tuple(sorted(preset.params.items())))
    if key not in _compiled:
        if not any(k[1:] == key[1:] for k in _compiled):
            torch._dynamo.reset()
            _compiled.clear()
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _compiled[key]


def transformers_experts(routing) -> Callable:
    """transformers' own experts (an OLMoE experts module of this shape, its experts
    implementation "grouped_mm"), called as a model calls it: with the top-k ids and weights,
    its own sort and gathers included. Weights in its layout (gate_up_layout)."""
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeExperts

    if routing.capacity is not None:
        raise ValueError("transformers' experts take no capacity factor: every routed slot is computed")
    top_k_index = routing.expert_ids.long()
    modules = {}  # one module per weight set (a rotation's inputs each have their own)

    def run(x, routing, gate_up, down):
        module = modules.get(id(gate_up))
        if module is None:
            num_experts, two_f, d = gate_up.shape
            config = OlmoeConfig(hidden_size=d, intermediate_size=two_f // 2, num_experts=num_experts,
                                 num_experts_per_tok=routing.k, hidden_act="silu")
            config._experts_implementation = "grouped_mm"
            module = modules[id(gate_up)] = OlmoeExperts(config)
            module.gate_up_proj, module.down_proj = gate_up, down  # its parameters are the timed leaves
        return module(x, top_k_index, routing.probs)

    return run


def transformers5_missing() -> str | None:
    """Why transformers' experts interface (transformers >= 5) is not here, or None."""
    try:
        import transformers
        from transformers.models.olmoe.modeling_olmoe import OlmoeExperts  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'suite[hf]')"
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"transformers {transformers.__version__} has no experts interface (needs >= 5)"
    return None


def transformers_missing(device: torch.device) -> str | None:
    return transformers5_missing() or grouped_mm_missing(device)


def sonicmoe_layout(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weights as SonicMoE's MoE module keeps them: c_fc [E, 2f, d] with gate and up rows
    interleaved (gate i at row 2i, up i at 2i + 1) and c_proj [E, d, f]; fresh leaves."""
    w_gate, w_up, w_down = (w.detach() for w in weights)
    c_fc = torch.stack([w_gate.transpose(1, 2), w_up.transpose(1, 2)], dim=2).flatten(1, 2).contiguous()
    return [nn.Parameter(c_fc), nn.Parameter(w_down.transpose(1, 2).contiguous())]


def sonicmoe_experts(routing) -> Callable:
    """SonicMoE's experts (CuTe DSL grouped GEMMs on QuACK) on the same routing, given as the
    (token, expert, score) triples of its moe_general_routing_inputs; its own layout metadata
    kernel included, as a model calling it pays. Weights in its layout (sonicmoe_layout)."""
    from sonicmoe import moe_general_routing_inputs
    from sonicmoe.enums import ActivationType

    if routing.capacity is not None:
        raise ValueError("SonicMoE takes no capacity factor: every routed slot is computed")
    tokens, k = routing.expert_ids.shape
    device = routing.expert_ids.device
    token_indices = torch.arange(tokens, dtype=torch.int32, device=device).repeat_interleave(k)
    expert_indices = routing.expert_ids.reshape(-1).to(torch.int32)
    stream = torch.cuda.current_stream(device).cuda_stream

    def run(x, routing, c_fc, c_proj):
        out, _ = moe_general_routing_inputs(x, routing.probs.reshape(-1), token_indices, expert_indices,
                                            c_fc.permute(1, 2, 0), None, c_proj.permute(1, 2, 0), None,
                                            c_fc.shape[0], stream, ActivationType.SWIGLU)
        return out

    return run


def sonicmoe_missing(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "SonicMoE runs on CUDA devices only"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"SonicMoE's kernels are for sm90 and sm100 cards; this one is sm{major}{minor}"
    if importlib.util.find_spec("sonicmoe") is None:
        return ("sonic-moe is not installed (its metadata pins torch <= 2.9.1, so: pip install --no-deps "
                "sonic-moe quack-kernels nvidia-cutlass-dsl nvidia-cutlass-dsl-libs-cu13 apache-tvm-ffi "
                "torch-c-dlpack-ext einops)")
    return None


def liger_experts(routing) -> Callable:
    """Liger-Kernel's fused MoE (LigerFusedMoEFunction: Triton grouped GEMMs after its own routing
    metadata kernels, which read the tile count on the host each call) on the same routing,
    given as LigerExperts gives it: the top-k ids in int32, their weights in x's dtype (a
    transformers router's). Weights in transformers' layout (gate_up_layout), which is Liger's."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    if routing.capacity is not None:
        raise ValueError("Liger's fused MoE takes no capacity factor: every routed slot is computed")
    top_k_index = routing.expert_ids.to(torch.int32)

    def run(x, routing, gate_up, down):
        return LigerFusedMoEFunction.apply(x, gate_up, down, top_k_index, routing.probs.to(x.dtype))

    return run


def padded_bmm(routing) -> Callable:
    """The experts as batched GEMMs over [E, C, ...], every expert padded to the largest one's
    C rows (read on the host here, once, as padded implementations do per step)."""
    counts = routing.offsets.diff().long()
    capacity = max(int(counts.max()), 1)
    slot = torch.arange(capacity, device=counts.device)
    valid = slot[None, :] < counts[:, None]  # [E, C]
    sorted_row = (routing.offsets[:-1, None].long() + slot[None, :]).clamp(max=max(routing.max_rows - 1, 0))
    token = torch.where(valid, routing.token_of_row.long()[sorted_row], 0).reshape(-1)
    source = torch.where(valid, routing.source_of_row.long()[sorted_row], 0).reshape(-1)
    mask = valid.reshape(-1, 1)

    def run(x, routing, w_gate, w_up, w_down):
        num_experts = w_gate.shape[0]
        x_pad = (x[token] * mask).view(num_experts, capacity, -1)
        h = _swiglu(torch.bmm(x_pad, w_gate), torch.bmm(x_pad, w_up))
        y = torch.bmm(h, w_down).view(num_experts * capacity, -1)
        weight = torch.where(mask[:, 0], routing.probs.reshape(-1)[source], 0.0)
        out = torch.zeros(x.shape, device=x.device, dtype=torch.float32)
        return out.index_add(0, token, weight[:, None] * y.float()).to(x.dtype)

    return run


def combine_backward_in_torch(grad_out, y_rows, probs, routing):
    """The combine's backward in eager torch: grad_rows [max_rows, d], grad_probs fp32 [T, k]."""
    rows = routing.row_id_map.long()
    kept = rows >= 0
    tokens = torch.arange(rows.numel(), device=rows.device) // routing.k
    grad_slots = grad_out[tokens].float()
    # dropped slots write one spare row past the end, cut off after (a mask would sync)
    target = torch.where(kept, rows, routing.max_rows)
    grad_rows = torch.empty(routing.max_rows + 1, grad_out.shape[1], device=grad_out.device, dtype=grad_out.dtype)
    grad_rows.index_copy_(0, target, (grad_slots * probs.reshape(-1)[:, None]).to(grad_out.dtype))
    dots = (grad_slots * y_rows[rows.clamp(min=0)].float()).sum(-1)
    return grad_rows[:-1], torch.where(kept, dots, 0.0).view_as(probs)


def grouped_mm_missing(device: torch.device) -> str | None:
    """torch._grouped_mm runs on every CUDA card of SM80 and up, but (torch's GroupedBlas.cpp)
    only SM90 and SM100 take its CUTLASS kernels; any other card, the RTX's sm_120 among them,
    takes its fallback: the offsets copied to the host (a sync each call) and one mm per
    expert. That fallback is what an RTX user gets, so on such a card it is timed; the rtx
    profile on a Hopper card would time the CUTLASS path instead, so there it is not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type != "cuda":
        return "torch._grouped_mm's kernels are timed on CUDA devices only"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"torch._grouped_mm needs SM80 or newer; this device is sm_{major}{minor}"
    if active_profile(device) == "rtx" and major != 12:
        return ("the rtx profile stands in for the RTX card (sm_120), where torch._grouped_mm takes its fallback "
                "(offsets read on the host, one mm per expert); this card would time its CUTLASS path instead")
    return None
