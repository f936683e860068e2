"""Liger-Kernel (the extra `[peers]`) where gates time it as a peer: whether it can run here, and
its fused MoE experts inside a transformers model.

Inside a model Liger's experts are `LigerExperts.forward`, the forward that Liger's
`apply_liger_kernel_to_qwen3_moe` / `_mixtral(model=...)` bind to a built model's experts
modules; here it is switched on through transformers' experts interface, as "liger", the way
`use_suite_experts` switches on "suite". Liger's apply functions themselves are not called:
besides the given model's experts they replace the family's classes module-wide (every model
built after, the stock one timed beside it among them), and OLMoE has none for its experts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import torch
from torch import nn

from suite.device_profile import active_profile

# Triton's autotuner benchmarks its configs on a GPU, which the interpreter has not: an autotuned
# kernel cannot run interpreted. Liger's fused MoE pins one config per kernel when
# LIGER_FUSED_MOE_AUTOTUNE=0 as it is imported (any import of liger_kernel.ops loads it), so on
# the interpreter that is set before a gate imports Liger. A GPU keeps Liger's autotuning.
if os.environ.get("TRITON_INTERPRET") == "1":
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

EXPERTS_IMPLEMENTATION = "liger"
# why a block with Liger's experts is no contender under torch.compile(fullgraph=True), read in its
# source (liger_kernel/ops/fused_moe.py, compute_routing_metadata); a CUDA test holds it
FULLGRAPH_BREAK = ("Liger's fused MoE reads its tile count on the host (.item()) inside its autograd Function: a "
                   "graph break, which torch.compile(fullgraph=True) refuses (train-step times it in a compiled model)")


def liger_missing(device: torch.device) -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'suite[peers]')"
    return None


def _autotune_pinned() -> bool:
    kernels = sys.modules.get("liger_kernel.ops.fused_moe_kernels")
    if kernels is not None:  # imported already: what it read then
        return bool(getattr(kernels, "_AUTOTUNE_DISABLED", False))
    return os.environ.get("LIGER_FUSED_MOE_AUTOTUNE", "1").lower() in ("0", "false", "no")


def fused_moe_missing(device: torch.device) -> str | None:
    """Why Liger's fused MoE (liger_kernel.ops.fused_moe, Triton) cannot run on `device`, or None:
    any CUDA card (the RTX's sm_120 included), or a CPU under Triton's interpreter."""
    reason = liger_missing(device)
    if reason is not None:
        return reason
    locations = importlib.util.find_spec("liger_kernel").submodule_search_locations or []
    if not any(Path(place, "ops", "fused_moe.py").is_file() for place in locations):
        return (f"liger-kernel {importlib.metadata.version('liger-kernel')} has no fused MoE "
                "(liger_kernel.ops.fused_moe, in 0.8.5): pip install -U 'liger-kernel>=0.8.5'")
    if device.type == "cpu":
        from suite.triton_support import interpreted

        if not interpreted():
            return "Liger's fused MoE runs on a CPU only under Triton's interpreter (TRITON_INTERPRET=1 before triton)"
        if not _autotune_pinned():
            return ("Liger's fused MoE autotunes its kernels, which Triton's interpreter cannot (no GPU to time "
                    "configs on): set LIGER_FUSED_MOE_AUTOTUNE=0 before liger_kernel is imported")
        return None
    if device.type != "cuda":
        return f"Liger's fused MoE runs on CUDA devices or a CPU under Triton's interpreter, not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if active_profile(device) == "rtx" and major != 12:
        return ("the rtx profile stands in for the RTX card (sm_120, 99 KB of shared memory a block); Liger's "
                f"autotuner on this sm_{major}{minor} card would pick among configs that card cannot run")
    return None


def register() -> None:
    """`LigerExperts.forward` as transformers' experts implementation "liger" (idempotent)."""
    from liger_kernel.transformers.swiglu import LigerExperts
    from transformers.integrations import moe as hf_moe

    hf_moe.ExpertsInterface.register(EXPERTS_IMPLEMENTATION, LigerExperts.forward)


def experts_unsupported(module: nn.Module) -> str | None:
    """Why LigerExperts' forward cannot stand in for this experts module's, or None: it computes
    silu(gate) * up, reads gate_up_proj as [E, 2f, d] (gate rows, then up rows) and down_proj as
    [E, d, f], and takes the width from `hidden_dim`."""
    from suite.arms.moe import SwiGLU
    from suite.integrations import transformers as hf

    hf.register()  # the suite's checks read transformers' default gate from there
    reason = hf.experts_unsupported(module)
    if reason is not None:
        return reason
    name = type(module).__name__
    glu = hf.glu_of(module, hf.gate_rule(module))
    if glu != SwiGLU():
        return f"{name} computes {glu}; Liger's experts compute silu(gate) * up"
    if module.is_transposed or not module.is_concatenated:
        return (f"{name} stores gate_up_proj with is_transposed={module.is_transposed}, is_concatenated="
                f"{module.is_concatenated}; Liger's experts read [E, 2f, d], gate rows then up rows")
    if not hasattr(module, "hidden_dim"):
        return f"{name} has no hidden_dim, which LigerExperts' forward reads"
    return None


def use_liger_experts(model: nn.Module) -> int:
    """Switch every experts module of a transformers model to Liger's fused MoE and return how
    many; a model with none, or one Liger cannot take, raises and is left as it was."""
    from suite.integrations.transformers import checked_experts_modules

    found = checked_experts_modules(model, experts_unsupported)
    register()
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return len(found)
