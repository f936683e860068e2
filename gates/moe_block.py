"""moe-bwd's block cases: the MoE block of a transformers model as a user runs it, with the model's
router, its top-k and its experts module. Experts implementation "suite" (what
`use_suite_experts` switches a model to) is timed against "grouped_mm" (transformers' stock), as
eager calls of the block (`block`) and with the block under torch.compile (`block-compiled`).

The experts' weights come from the gate's buffers, put in the block's own layout (transformers 5's
gate_up_proj [E, 2f, d] and down_proj [E, d, f]). The router's weight is drawn from a fixed
seed. Every block of one build shares these Parameters: the timed calls take gradients with
autograd.grad, so sharing adds nothing up, and mixtral's 2.8 GB of weights is held once, not once
per contender. A model preset's block (and its -4k one's) is its family's (olmoe, qwen3-30b-a3b,
mixtral); the tiny presets take OLMoE's.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from gates.moe_peers import compiled, gate_up_layout, transformers5_missing
from suite.harness.gate import BenchCase, Buffers, Preset

# preset -> (transformers' module, class prefix, the config's names for f and E)
_FAMILIES = {
    "olmoe": ("olmoe", "Olmoe", "intermediate_size", "num_experts"),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3Moe", "moe_intermediate_size", "num_experts"),
    "mixtral": ("mixtral", "Mixtral", "intermediate_size", "num_local_experts"),
}
BLOCK_CASES = ("block", "block-compiled")
# the builds' Parameters, by the buffers' x: they go when the runner lets the buffers go
_shared: WeakIdKeyDictionary = WeakIdKeyDictionary()


def block_missing(device: torch.device) -> str | None:
    """Both implementations go through transformers' experts interface; grouped_mm runs on any
    device (on cards without its CUTLASS kernels torch's fallback is what their users run)."""
    return transformers5_missing()


def _parameters(buffers: Buffers, preset: Preset) -> list[nn.Parameter]:
    """[router weight, gate_up_proj, down_proj] of this build, made once for its buffers."""
    x = buffers["x"]
    if x not in _shared:
        weights = [buffers[n] for n in ("w_gate", "w_up", "w_down")]
        gen = torch.Generator().manual_seed(0)
        router = torch.randn(weights[0].shape[0], x.shape[1], generator=gen) * x.shape[1] ** -0.5
        _shared[x] = [nn.Parameter(router.to(x.device, x.dtype)), *gate_up_layout(weights)]
    return _shared[x]


def make_block(preset: Preset, buffers: Buffers, implementation: str) -> nn.Module:
    """The preset's family's MoE block with experts implementation `implementation`, holding the
    build's shared Parameters, in training mode."""
    if implementation == "suite":
        from suite.integrations.transformers import register

        register()
    import transformers

    module, prefix, ffn_name, experts_name = _FAMILIES.get(preset.name.removesuffix("-4k"), _FAMILIES["olmoe"])
    p = preset.params
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=p["hidden"], num_experts_per_tok=p["top_k"], **{ffn_name: p["ffn"], experts_name: p["experts"]})
    config._experts_implementation = implementation
    classes = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    with torch.device("meta"):  # the Parameters below replace every weight it would make
        block = getattr(classes, f"{prefix}SparseMoeBlock")(config)
    block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj = _parameters(buffers, preset)
    return block.train()


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

