"""Gate `graph-capture`: the optimizer step captured in one CUDA graph (suite.arms.graph)
against the same optimizer stepped eagerly, bit for bit, over K saved gradient sets.

A transformer-shaped parameter set (per layer: wq, wk, wv, wo of d x d, w1, w3 of 4d x d,
w2 of d x 4d, two norm vectors) is trained from saved initial parameters through K saved
gradient sets by gates.optim_loop.train, for Muon (matrices) + AdamW (vectors) and for torch
AdamW (foreach, torch's default, and fused), in the scenarios of gates.optim_loop.SCENARIOS:
constant lr; warm-up + cosine lr through LambdaLR; weight decay changed mid-run (Muon only);
a state_dict saved at K/2, loaded into fresh optimizers, continued; and OneCycleLR, which cycles
Muon's lr and betas[0] every step (torch AdamW reads betas as host numbers: lr only). The arm's
schedulers attach to the CapturedOptimizer itself, the reference's to the eager optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gates.optim_loop import ADAMW_LR, MUON_LR, SCENARIOS, WEIGHT_DECAY, Wrap, param_names, train
from suite.arms.graph import CapturedOptimizer
from suite.arms.muon import Muon
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Buffers,
    Gate,
    Outputs,
    Peer,
    PerfCriterion,
    Preset,
    Saboteur,
)

MATRICES = (("wq", 1, 1), ("wk", 1, 1), ("wv", 1, 1), ("wo", 1, 1), ("w1", 4, 1), ("w3", 4, 1), ("w2", 1, 4))


def _shapes(preset: Preset) -> dict[str, tuple[int, ...]]:
    d = preset.params["d"]
    shapes = {}
    for layer in range(preset.params["layers"]):
        for name, rows, cols in MATRICES:
            shapes[f"layers.{layer}.{name}"] = (rows * d, cols * d)
        shapes[f"layers.{layer}.attn_norm"] = (d,)
        shapes[f"layers.{layer}.mlp_norm"] = (d,)
    return shapes


def _preset(name: str, layers: int, d: int, steps: int = 20, standard: bool = True, note: str = "") -> Preset:
    n = sum(math.prod(s) for s in _shapes(Preset(name, dict(layers=layers, d=d))).values())
    # fp32: initial params and K grad sets; the final params of every scenario for the
    # reference and for the arm's two runs; a run's params, grads and optimizer state
    scenarios = sum(map(len, SCENARIOS.values()))
    memory = 4 * n * (steps + 1 + 3 * scenarios + 4) + (1 << 30)
    return Preset(name, dict(layers=layers, d=d, steps=steps, params=n), where="cuda",
                  standard=standard, memory_bytes=memory, note=note)


PRESETS = (
    _preset("tiny", 2, 64, standard=False, note="seconds: for tests"),
    _preset("dispatch-bound", 24, 256, note="216 small tensors: launch overhead dominates"),
    _preset("medium", 24, 1024, note="168 matrices, 403 M params"),
    _preset("large", 2, 4096, note="18 large tensors: the AdamW step is bandwidth-bound"),
)


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    gen = torch.Generator(device=device).manual_seed(seed)
    buffers = {}
    for name, shape in _shapes(preset).items():
        fan_in = shape[-1]
        init = torch.randn(shape, generator=gen, device=device) / math.sqrt(fan_in)
        buffers[f"param/{name}"] = torch.ones(shape, device=device) + 0.02 * init if len(shape) == 1 else init
    for step in range(preset.params["steps"]):
        for name, shape in _shapes(preset).items():
            # gradients shrink over the run, as a loss does
            buffers[f"grad{step:02d}/{name}"] = 1e-3 / (1 + step) * torch.randn(shape, generator=gen, device=device)
    return buffers


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    steps = len({k.split("/")[0] for k in buffers if k.startswith("grad")})
    return dict(steps=steps, params=sum(t.numel() for k, t in buffers.items() if k.startswith("param/")))


def _all_scenarios(buffers: Buffers, preset: Preset, wrap: Wrap | None, swap_grads: bool = False) -> Outputs:
    outputs: Outputs = {}
    for kind, scenarios in SCENARIOS.items():
        for scenario in scenarios:
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

# ---- bench: warm optimizer steps, host dispatch included ----


def _bench_optimizer(case: str, impl: str, params: list[torch.Tensor]) -> Any:
    matrices = [p for p in params if p.dim() == 2]
    vectors = [p for p in params if p.dim() == 1]
    if case == "muon-step":
        groups = [{"params": matrices, "use_muon": True}, {"params": vectors, "use_muon": False, "lr": ADAMW_LR}]
        if impl == "reference":
            return Muon(groups, lr=MUON_LR, weight_decay=WEIGHT_DECAY)
        if impl == "arm":
            return CapturedOptimizer(Muon(groups, lr=MUON_LR, weight_decay=WEIGHT_DECAY, capturable=True))
    else:
        # eager vs captured of one optimizer, torch's fused AdamW (the fastest eager one);
        # torch's default (foreach), its capture and the for-loop beside them
        adamw = dict(lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, betas=(0.9, 0.95))
        builders = {
            "reference": lambda: torch.optim.AdamW(params, fused=True, **adamw),
            "arm": lambda: CapturedOptimizer(torch.optim.AdamW(params, fused=True, capturable=True, **adamw)),
            "AdamW foreach": lambda: torch.optim.AdamW(params, foreach=True, **adamw),
            "AdamW foreach captured": lambda: CapturedOptimizer(
                torch.optim.AdamW(params, foreach=True, capturable=True, **adamw)),
            "AdamW for-loop": lambda: torch.optim.AdamW(params, foreach=False, **adamw),
        }
        if impl in builders:
            return builders[impl]()
    raise LookupError(f"{impl} is not timed in the {case} bench")


def bench_callable(case: BenchCase, impl: str, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
    names = param_names(buffers)
    params = [buffers[f"param/{n}"].clone().requires_grad_() for n in names]
    for p, n in zip(params, names):
        p.grad = buffers[f"grad00/{n}"].clone()
    optimizer = _bench_optimizer(case.name, impl, params)
    return optimizer.step


def _step_bytes(per_param: int) -> Callable[[Preset], int]:
    return lambda preset: per_param * preset.params["params"]


def _muon_flops(preset: Preset) -> int:
    # Newton-Schulz per step on each matrix (m x n, m <= n): A = X X^T, A @ A, B @ X
    total = 0
    for shape in _shapes(preset).values():
        if len(shape) == 2:
            m, n = sorted(shape)
            total += preset.params.get("ns_steps", 5) * (2 * m * m * n + 2 * m * m * m + 2 * m * m * n)
    return total


BENCHES = (
    # Muon: read p, g, m; write p, m (fp32) = 20 B/param; the Newton-Schulz GEMMs dominate
    BenchCase("muon-step", "one Muon(+AdamW) optimizer step, dispatch included", bytes=_step_bytes(20),
              flops=_muon_flops, l2="warm", host_bound=True, window=2, calls_per_round=3, cold_calls=4, peers=()),
    # AdamW: read p, g, m, v; write p, m, v (fp32) = 28 B/param
    BenchCase("adamw-step", "one AdamW optimizer step, dispatch included", bytes=_step_bytes(28),
              l2="warm", host_bound=True, window=10, calls_per_round=3, cold_calls=4),
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
    peers=(
        Peer("AdamW foreach", note="torch.optim.AdamW(foreach=True), torch's default, in the adamw-step bench"),
        Peer("AdamW foreach captured",
             note="CapturedOptimizer(AdamW(foreach=True, capturable=True)), in the adamw-step bench"),
        Peer("AdamW for-loop", note="torch.optim.AdamW(foreach=False), in the adamw-step bench"),
    ),
    benches=BENCHES,
    bench_callable=bench_callable,
    perf=PerfCriterion(not_slower_than=("reference",), min_speedup={("medium", "muon-step"): 1.8}),
)
