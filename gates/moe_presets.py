"""moe-bwd's presets: the layers it judges and times (the tiny ones on any device, the models'
on a GPU) and each one's peak memory, an upper bound that sizes which presets a device runs."""

from __future__ import annotations

from typing import Any

import torch

from gates.moe_block import block_bytes
from gates.moe_buffers import SKEWS
from suite.arms.moe import GeGLU, SwiGLU
from suite.harness.gate import Preset

# How the arm takes its weights:
#   apart   w_gate, w_up [E, d, f] and w_down [E, f, d], through `experts` (as MoEExperts holds them)
#   model   as transformers stores a model's experts, gate_up_proj [E, 2f, d] and down_proj [E, d, f],
#           through `gate_up_experts`: the path use_suite_experts runs, gradients in that layout
# Only "model" is written into a preset's params: buffers recorded without it take "apart".
WEIGHTS = ("apart", "model")


def weights_of(preset: Preset | dict[str, Any]) -> str:
    return (preset if isinstance(preset, dict) else preset.params).get("weights", "apart")


def _params(tokens, hidden, ffn, experts, top_k, dtype, capacity_factor=None, skew="none",
            weights="apart", glu=None) -> dict[str, Any]:
    if skew not in SKEWS or weights not in WEIGHTS:
        raise ValueError(f"moe-bwd: skew must be one of {SKEWS} and weights one of {WEIGHTS}, not {skew!r}, "
                         f"{weights!r}")
    if glu is None or glu == SwiGLU():
        activation = {}
    else:
        activation = dict(glu="geglu") if glu == GeGLU() else dict(swiglu_limit=glu.limit, swiglu_clamp=glu.clamp)
    return dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, dtype=dtype,
                capacity_factor=capacity_factor, skew=skew, **({"weights": weights} if weights != "apart" else {}),
                **activation)


def memory_bytes(p: dict[str, Any]) -> int:
    """Peak device memory of one preset's gate and bench, an upper bound (not all of it lives at
    once; no margin added on top): the experts' parity and bench, the copies a model's layout
    adds, and the block's parity and bench (`block_bytes`)."""
    item = torch.empty((), dtype=getattr(torch, p["dtype"])).element_size()
    layout_copies = 2 * 3 * p["experts"] * p["hidden"] * p["ffn"] * item if weights_of(p) == "model" else 0
    return experts_bytes(p) + layout_copies + block_bytes(p)


def experts_bytes(p: dict[str, Any]) -> int:
    """The experts' part: the buffers; the arm's outputs three times (judged, determinism and
    after-timing runs) and its saved activations; the reference's outputs and its fp32 autograd
    temporaries; the float64 truth's outputs and its temporaries for the largest expert (every
    token); a bench's gradients. It lies above the H200's measured peaks of this part alone
    (docs/gpu-notes.md); a test keeps it between the peak and 1.5x."""
    tokens, d, f, num_experts, k = p["tokens"], p["hidden"], p["ffn"], p["experts"], p["top_k"]
    item = torch.empty((), dtype=getattr(torch, p["dtype"])).element_size()
    rows, weights = tokens * k, 3 * num_experts * d * f
    outputs = (2 * tokens * d + weights) * item + 3 * tokens * (k + num_experts) * 4
    buffers = (2 * tokens * d + weights) * item + tokens * num_experts * 4
    arm_saved = rows * (5 * f + 3 * d) * item  # a, g, u, y_rows; dg, du, grad_rows, dx_rows
    reference_temps = rows * (6 * f + 3 * d) * 4
    truth = (2 * tokens * d + weights) * 8 + tokens * (d + 8 * f) * 8
    bench = outputs + arm_saved
    return buffers + 3 * outputs + arm_saved + outputs + reference_temps + truth + bench


def _tiny(name, top_k, experts, capacity_factor=None, skew="none", tokens=19, hidden=40, ffn=24, standard=False,
          note="", weights="apart", glu=None) -> Preset:
    # hidden and ffn are no multiple of the interpreter's 16-wide tiles, nor T * k of its rows
    params = _params(tokens, hidden, ffn, experts, top_k, "float32", capacity_factor, skew, weights, glu)
    return Preset(name, params, where="any", standard=standard, note=note, memory_bytes=memory_bytes(params))


def _gpu(name, tokens, hidden, ffn, experts, top_k, capacity_factor=None, skew="none", standard=True, in_all=False,
         note="", weights="apart") -> Preset:
    params = _params(tokens, hidden, ffn, experts, top_k, "bfloat16", capacity_factor, skew, weights)
    return Preset(name, params, where="cuda", standard=standard, in_all=in_all, note=note,
                  memory_bytes=memory_bytes(params))


# The odd GPU shape: tokens, hidden and ffn multiples of no tile (rows 64/128, columns 16..128)
_ODD = dict(tokens=4099, hidden=1000, ffn=712)

PRESETS = (
    # the default CPU preset is the smallest and every saboteur shows on it (k = 3 sums slots
    # in an order; the capacity drops rows; rows of 80 bytes, which stock's block takes), so
    # `suite run` on the CPU adds no other preset
    _tiny("tiny", 3, 4, capacity_factor=1.0, skew="skewed", tokens=10, hidden=20, ffn=24, standard=True,
          note="k 3, capacity drops, fp32"),
    _tiny("tiny-top1", 1, 6),
    _tiny("tiny-top2", 2, 6),
    _tiny("tiny-top8", 8, 9, tokens=11),
    _tiny("tiny-empty-expert", 2, 5, skew="empty-expert"),
    _tiny("tiny-one-expert", 2, 4, skew="one-expert"),
    _tiny("tiny-capacity", 2, 4, capacity_factor=0.75, skew="skewed"),
    _tiny("tiny-model-layout", 2, 6, weights="model", note="a model's gate_up_proj and down_proj"),
    # the clamped SwiGLUs (DeepSeek-V4's, Step-3's), at limits that clamp a quarter to a half of
    # the values (pre-activations ~ N(0, 1)), and GeGLU (Gemma 4's); parity alone: the bench's
    # peers compute plain SwiGLU
    _tiny("tiny-clamped", 2, 6, weights="model", glu=SwiGLU(0.6, "gate"),
          note="clamped SwiGLU: gate before silu, limit 0.6; parity only"),
    _tiny("tiny-clamped-silu", 3, 5, glu=SwiGLU(0.3, "silu"), note="clamped SwiGLU: silu's output, limit 0.3; "
          "parity only"),
    _tiny("tiny-geglu", 2, 6, weights="model", glu=GeGLU(), note="GeGLU, gelu's tanh form; parity only"),
    # the models' layers, their weights as transformers stores them (the arm as use_suite_experts runs it)
    _gpu("olmoe", 8192, 2048, 1024, 64, 8, weights="model"),
    _gpu("qwen3-30b-a3b", 8192, 2048, 768, 128, 8, weights="model"),
    _gpu("mixtral", 8192, 4096, 14336, 8, 2, weights="model"),
    # the models' layers at 4096 tokens, on request: where the block a user runs lost most
    *(_gpu(f"{name}-4k", 4096, *widths, standard=False, note="the model's layer at 4096 tokens", weights="model")
      for name, widths in (("olmoe", (2048, 1024, 64, 8)), ("qwen3-30b-a3b", (2048, 768, 128, 8)),
                           ("mixtral", (4096, 14336, 8, 2)))),
    # Qwen3-30B-A3B's layer at the 32768 tokens SonicMoE's paper times it at (no compiled peers)
    _gpu("qwen3-30b-a3b-32k", 32768, 2048, 768, 128, 8, standard=False, weights="model", note="SonicMoE's measure"),
    # `suite run` benches this one alone: the model presets take 0.5-1.5 min each on the H200
    _gpu("top2-small", 8192, 1024, 2816, 16, 2, in_all=True),
    # the edge cases on the GPU: parity on request (--preset), they time nothing new
    _gpu("gpu-top1", top_k=1, experts=16, standard=False, **_ODD),
    _gpu("gpu-top8", top_k=8, experts=64, standard=False, **_ODD),
    _gpu("gpu-empty-expert", top_k=2, experts=16, skew="empty-expert", standard=False, **_ODD),
    _gpu("gpu-one-expert", top_k=2, experts=16, skew="one-expert", standard=False, **_ODD),
    _gpu("gpu-capacity", top_k=2, experts=16, capacity_factor=1.0, skew="skewed", standard=False, **_ODD),
    # each contender's host time per call: top2-small's layer at 8 tokens, where the device
    # waits on the host (a decode step, or the last micro-batch of a ragged one)
    _gpu("host-probe", 8, 1024, 2816, 16, 2, standard=False, note="host probe: too small to keep the GPU busy"),
)
