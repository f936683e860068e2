"""Gate `graph-capture`: the optimizer step captured in one CUDA graph (suite.arms.graph)
against the same optimizer stepped eagerly, bit for bit, over K saved gradient sets.

A transformer-shaped parameter set (per layer: wq, wk, wv, wo of d x d, w1, w3 of 4d x d,
w2 of d x 4d, two norm vectors) is trained from saved initial parameters through K saved
gradient sets by gates.optimizer_runs.train, for Muon (matrices) + AdamW (vectors) and for torch
AdamW (foreach, torch's default, and fused), in the scenarios of gates.optimizer_runs.SCENARIOS:
constant lr; warm-up + cosine lr through LambdaLR; weight decay changed mid-run (Muon only);
a state_dict saved at K/2, loaded into fresh optimizers, continued; and OneCycleLR, which cycles
Muon's lr and betas[0] every step (torch AdamW reads betas as host numbers: lr only). The arm's
schedulers attach to the CapturedOptimizer itself, the reference's to the eager optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gates.optimizer_runs import ADAMW_LR, MUON_LR, SCENARIOS, WEIGHT_DECAY, Wrap, param_names, train
from suite.arms.graph import CapturedOptimizer
from suite.arms.muon import Muon
from suite.harness.criteria import BusyBound, NotSlowerThan
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Buffers,
    Contender,
    Gate,
    Outputs,
    Preset,
    Saboteur,
)

MATRICES = (("wq", 1, 1), ("wk", 1, 1), ("wv", 1, 1), ("wo", 1, 1), ("w1", 4, 1), ("w3", 4, 1), ("w2", 1, 4))


def transformer_shapes(preset: Preset) -> dict[str, tuple[int, ...]]:
    """A transformer's parameter shapes by name (preset params layers, d); gate checkpoint saves them too."""
    d = preset.params["d"]
    shapes = {}
    for layer in range(preset.params["layers"]):
        for name, rows, cols in MATRICES:
            shapes[f"layers.{layer}.{name}"] = (rows * d, cols * d)
        shapes[f"layers.{layer}.attn_norm"] = (d,)
        shapes[f"layers.{layer}.mlp_norm"] = (d,)
    return shapes


# The larger presets judge the scenarios whose bits depend on the shapes (kernels and cuBLAS
# algorithms chosen by size): a resumed state and a one-cycle schedule (lr, and Muon's betas,
# moving every step). Every scenario runs at `tiny` (where each `suite run` runs the saboteurs)
# and at `dispatch-bound` (216 tensors: the multi-tensor paths chunk as a real model's do).
ALL = [f"{kind}/{scenario}" for kind, scenarios in SCENARIOS.items() for scenario in scenarios]
SHAPE_BOUND = [f"{kind}/{scenario}" for kind, scenarios in SCENARIOS.items() for scenario in scenarios
               if scenario in ("resume", "onecycle", "onecycle-lr")]


def _preset(name: str, layers: int, d: int, steps: int, scenarios: list[str], standard: bool = True,
            note: str = "") -> Preset:
    n = sum(math.prod(s) for s in transformer_shapes(Preset(name, dict(layers=layers, d=d))).values())
    # fp32: initial params and K grad sets; the final params of every scenario for the
    # reference and for the arm's two runs; a run's params, grads and optimizer state
    memory = 4 * n * (steps + 1 + 3 * len(scenarios) + 4) + (1 << 30)
    return Preset(name, dict(layers=layers, d=d, steps=steps, params=n, scenarios=scenarios), where="cuda",
                  standard=standard, memory_bytes=memory, note=note)


PRESETS = (
    _preset("tiny", 2, 64, 20, ALL, standard=False, note="seconds: for tests and the saboteurs"),
    _preset("dispatch-bound", 24, 256, 12, ALL, note="216 small tensors: launch overhead dominates"),
    _preset("medium", 24, 1024, 12, SHAPE_BOUND, note="168 matrices, 403 M params"),
    _preset("large", 2, 4096, 12, SHAPE_BOUND, standard=False,
            note="18 large tensors, GPU-bound: suite bench graph-capture --preset large"),
)


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    gen = torch.Generator(device=device).manual_seed(seed)
    buffers = {}
    for name, shape in transformer_shapes(preset).items():
        fan_in = shape[-1]
        init = torch.randn(shape, generator=gen, device=device) / math.sqrt(fan_in)
        buffers[f"param/{name}"] = torch.ones(shape, device=device) + 0.02 * init if len(shape) == 1 else init
    for step in range(preset.params["steps"]):
        for name, shape in transformer_shapes(preset).items():
            # gradients shrink over the run, as a loss does
            buffers[f"grad{step:02d}/{name}"] = 1e-3 / (1 + step) * torch.randn(shape, generator=gen, device=device)
    return buffers


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    steps = len({k.split("/")[0] for k in buffers if k.startswith("grad")})
    return dict(steps=steps, params=sum(t.numel() for k, t in buffers.items() if k.startswith("param/")))


def _all_scenarios(buffers: Buffers, preset: Preset, wrap: Wrap | None, swap_grads: bool = False) -> Outputs:
    outputs: Outputs = {}
    # recorded buffers name no scenarios: then every one runs
    for name in preset.params.get("scenarios", ALL):
        kind, scenario = name.split("/")
        outputs.update(train(kind, scenario, buffers, preset.params["steps"], wrap, swap_grads))
    return outputs


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    return _all_scenarios(buffers, preset, wrap=None)


def arm(buffers: Buffers, preset: Preset) -> Outputs:
    return _all_scenarios(buffers, preset, wrap=lambda opt, params: CapturedOptimizer(opt))


SABOTEURS = (
    Saboteur("lr-baked", "lr read as a float at capture: the schedule stops reaching the step",
             lambda b, p: _all_scenarios(b, p, wrap=lambda opt, params: CapturedOptimizer(opt, live_lr=False))),
    Saboteur("grads-swapped", "grad tensors replaced after capture (zero_grad(set_to_none) + backward), unchecked",
             lambda b, p: _all_scenarios(b, p, wrap=lambda opt, params: CapturedOptimizer(opt, check_grads=False),
                                         swap_grads=True)),
    Saboteur("param-left-out", "one matrix left out of the captured step",
             lambda b, p: _all_scenarios(
                 b, p, wrap=lambda opt, params: CapturedOptimizer(opt, exclude=[next(iter(params.values()))]))),
)

# ---- bench: warm optimizer steps, host dispatch included; every contender declared once ----


def _muon_groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": [p for p in params if p.dim() == 2], "use_muon": True},
            {"params": [p for p in params if p.dim() == 1], "use_muon": False, "lr": ADAMW_LR}]


def _adamw(params: list[torch.Tensor], **implementation) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95), **implementation)


def _step(make: Callable[[str, list[torch.Tensor]], Any]) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    """A contender's build: an optimizer over a copy of the saved parameters, with the first
    saved gradients; one timed call is one step."""

    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        names = param_names(buffers)
        params = [buffers[f"param/{n}"].clone().requires_grad_() for n in names]
        for p, n in zip(params, names):
            p.grad = buffers[f"grad00/{n}"].clone()
        return make(case.name, params).step

    return build


def _eager(case: str, params: list[torch.Tensor]) -> Any:
    if case == "muon-step":
        return Muon(_muon_groups(params), lr=MUON_LR, weight_decay=WEIGHT_DECAY)
    # torch's fused AdamW, the fastest eager one, against its own capture
    return _adamw(params, fused=True)


def _captured(case: str, params: list[torch.Tensor]) -> Any:
    if case == "muon-step":
        return CapturedOptimizer(Muon(_muon_groups(params), lr=MUON_LR, weight_decay=WEIGHT_DECAY, capturable=True))
    return CapturedOptimizer(_adamw(params, fused=True, capturable=True))


CONTENDERS = (
    Contender("reference", "reference", _step(_eager), note="the optimizer stepped eagerly (AdamW: fused)"),
    Contender("arm", "arm", _step(_captured), note="the same optimizer's step captured (CapturedOptimizer)"),
    Contender("AdamW foreach", "peer", _step(lambda case, params: _adamw(params, foreach=True)),
              note="torch.optim.AdamW(foreach=True), torch's default", cases=("adamw-step",)),
    Contender("AdamW foreach captured", "peer",
              _step(lambda case, params: CapturedOptimizer(_adamw(params, foreach=True, capturable=True))),
              note="CapturedOptimizer(AdamW(foreach=True, capturable=True))", cases=("adamw-step",)),
    Contender("AdamW for-loop", "peer", _step(lambda case, params: _adamw(params, foreach=False)),
              note="torch.optim.AdamW(foreach=False)", cases=("adamw-step",)),
)


def _step_bytes(per_param: int) -> Callable[[Preset], int]:
    return lambda preset: per_param * preset.params["params"]


def _muon_flops(preset: Preset) -> int:
    # Newton-Schulz per step on each matrix (m x n, m <= n): A = X X^T, A @ A, B @ X
    total = 0
    for shape in transformer_shapes(preset).values():
        if len(shape) == 2:
            m, n = sorted(shape)
            total += preset.params.get("ns_steps", 5) * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
    return total


# Host-bound steps: eager windows only (a graph replay of the reference would be the arm), the
# L2 warm (a training loop's optimizer state stays where the last step left it), GPU busy time
# beside the wall time so the dispatch cost shows.
BENCHES = (
    # Muon: read p, g, m; write p, m (fp32) = 20 B/param; the Newton-Schulz GEMMs dominate
    BenchCase("muon-step", "one Muon(+AdamW) optimizer step, dispatch included", bytes=_step_bytes(20),
              flops=_muon_flops, ceiling="gemm", l2="warm", modes=("eager",), window=2, gpu_busy=True,
              calls_per_round=2, cold_calls=4),
    # AdamW: read p, g, m, v; write p, m, v (fp32) = 28 B/param
    BenchCase("adamw-step", "one AdamW optimizer step, dispatch included", bytes=_step_bytes(28),
              l2="warm", modes=("eager",), window=5, gpu_busy=True, calls_per_round=3, cold_calls=4),
)

GATE = Gate(
    name="graph-capture",
    summary="Optimizer step (Muon + AdamW) captured in one CUDA graph vs eager, bitwise",
    arm_name="suite.arms.graph.CapturedOptimizer",
    needs_cuda=True,
    presets=PRESETS,
    make_buffers=make_buffers,
    buffer_params=buffer_params,
    reference=reference,
    arm=arm,
    parity=Bitwise(),
    saboteurs=SABOTEURS,
    contenders=CONTENDERS,
    benches=BENCHES,
    criteria=(
        NotSlowerThan(),
        # with batched Newton-Schulz the eager step keeps the GPU busy for most of its time, so the
        # demand that holds on any machine: the captured step within 5% of the eager one's device
        # time (docs/tuning.md)
        BusyBound(1.05, presets=("medium",), cases=("muon-step",)),
    ),
)
