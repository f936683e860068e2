"""Compile every Triton kernel the arms launch at the GPU presets' shapes, for the H200 (sm_90)
and the RTX 50-series card (sm_120, rtx profile), on a machine with no GPU: each build's shared
memory against the card's limit, its registers and spills, or the compiler's error; and every
MoE gradient's shape and dtype against its input's, on the paths only a GPU takes (TMA
descriptors, torch._grouped_mm). Exit 1 on any error, any case that fails, or any build over
its card's shared memory.

Needs a CUDA build of torch (no GPU, no driver; suite/harness/cross_compile.py says why) and
TRITON_INTERPRET unset:

    python scripts/cross_compile.py                       # every case, both cards
    python scripts/cross_compile.py --target sm120 --arm moe --preset mixtral
    python scripts/cross_compile.py --target sm100        # a B200 (no card of ours)

The cases: the moe-bwd gate's GPU presets as their weights are stored (a model's layout or
apart), each model preset also with the clamped SwiGLU and GeGLU and in the other layouts
(transposed, interleaved), top2-small also in fp16 and fp32, the routing kernels (the fused
route with and without z-loss, a model's top-k); the rmsnorm gate's GPU shapes, forward and
both backwards; Muon's fused update; skip-step's fused decision.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from gates import moe_bwd, rmsnorm as rmsnorm_gate
from suite.arms import muon, rmsnorm
from suite.arms.moe import GateUpLayout, GeGLU, SwiGLU, expert_capacity, launch, route_kernels
from suite.arms.moe.routing import row_bound
from suite.arms.skip_step import SkipStepOptimizer
from suite.errors import CouldNotRun
from suite.harness.cross_compile import TARGETS, Build, compiling_for, require_cross_compiling

DEFAULT_TARGETS = ("sm90", "sm120")  # the development card and the user's
MODEL_PRESETS = ("olmoe", "qwen3-30b-a3b", "mixtral")
LAYOUTS = {"model": GateUpLayout(False, True), "transposed": GateUpLayout(True, True),
           "interleaved": GateUpLayout(False, False), "apart": None}
ACTIVATIONS = {"swiglu": SwiGLU(), "clamped": SwiGLU(7.0, "gate"), "geglu": GeGLU()}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def moe_cases(presets: list[str]) -> list[tuple[str, dict]]:
    cases = []
    for preset in moe_bwd.PRESETS:
        if preset.where != "cuda" or (presets and preset.name not in presets):
            continue
        p = dict(preset.params)
        base = dict(p, layout=p.get("weights", "apart"), activation="swiglu", dtype="bf16", route="fused")
        cases.append((preset.name, base))
        if preset.name in MODEL_PRESETS:
            for activation in ("clamped", "geglu"):
                cases.append((f"{preset.name} {activation}", dict(base, activation=activation)))
            for layout in ("transposed", "interleaved", "apart"):
                cases.append((f"{preset.name} {layout}", dict(base, layout=layout, route="topk")))
        if preset.name == "top2-small":
            for dtype in ("fp16", "fp32"):
                cases.append((f"{preset.name} {dtype}", dict(base, dtype=dtype, route="z-loss")))
    return cases


def run_moe(p: dict) -> None:
    tokens, d, f, n_experts, k = p["tokens"], p["hidden"], p["ffn"], p["experts"], p["top_k"]
    dtype, layout = DTYPES[p["dtype"]], LAYOUTS[p["layout"]]
    x = torch.randn(tokens, d, device="cuda", dtype=dtype)
    logits = torch.randn(tokens, n_experts, device="cuda", dtype=torch.float32)
    factor = p.get("capacity_factor")
    capacity = tokens * k if factor is None else expert_capacity(factor, tokens, k, n_experts)
    max_rows = row_bound(tokens, k, n_experts, None if factor is None else capacity)
    z_loss = p["route"] == "z-loss"
    probs, expert_ids, *routing, lse, _ = route_kernels.route_forward(logits, k, True, capacity, max_rows, z_loss)
    if p["route"] == "topk":  # a model's own router: its top-k laid out
        routing = route_kernels.layout(expert_ids, n_experts, capacity, max_rows)
    offsets, row_id_map, _, token_of_row, _ = routing
    if layout is None:
        weights = (torch.randn(n_experts, d, f, device="cuda", dtype=dtype),
                   torch.randn(n_experts, d, f, device="cuda", dtype=dtype),
                   torch.randn(n_experts, f, d, device="cuda", dtype=dtype))
    else:
        gate_up = (n_experts, d, 2 * f) if layout.transposed else (n_experts, 2 * f, d)
        down = (n_experts, f, d) if layout.transposed else (n_experts, d, f)
        weights = (torch.randn(gate_up, device="cuda", dtype=dtype), torch.randn(down, device="cuda", dtype=dtype))
    plan = launch.layer_plan(x, weights, layout, max_rows, k, ACTIVATIONS[p["activation"]])
    out, a, gu, y_rows = plan.forward(x, probs, weights, token_of_row, offsets, row_id_map, one_buffer=True)
    dx, grad_probs, grads = plan.backward(torch.randn_like(out), x, probs, weights, a, gu, y_rows, token_of_row,
                                          offsets, row_id_map, reuse_saved=True)
    # the shapes the GPU-only paths give back (TMA, grouped_mm) are checked here, values are not
    for name, grad, like in (("dx", dx, x), ("grad_probs", grad_probs, probs), *zip(("dw1", "dw2", "dw3"), grads, weights)):
        if grad.shape != like.shape or grad.dtype != like.dtype:
            raise AssertionError(f"{name} came back {tuple(grad.shape)} {grad.dtype}, its input is {tuple(like.shape)} "
                                 f"{like.dtype}")
    grad_z = torch.ones((), device="cuda") if z_loss else None
    route_kernels.route_backward(grad_probs, grad_z, logits, lse, expert_ids, probs, True)


def rmsnorm_cases() -> list[tuple[str, dict]]:
    cases = []
    for preset in rmsnorm_gate.PRESETS:
        if preset.where != "cuda":
            continue
        for x_dtype, w_dtype in (("bfloat16", "float32"), ("bfloat16", "bfloat16")):
            cases.append((f"rmsnorm {preset.name} {x_dtype[:2]}x {w_dtype[:2]}w",
                          dict(preset.params, dtype=x_dtype, weight_dtype=w_dtype)))
    return cases


def run_rmsnorm(p: dict) -> None:
    shape = tuple(p["shape"])
    x = torch.randn(shape, device="cuda", dtype=getattr(torch, p["dtype"])).view(-1, shape[-1])
    weight = torch.randn(shape[-1], device="cuda", dtype=getattr(torch, p["weight_dtype"]))
    y, stats = rmsnorm.rms_norm_forward(x, weight, 1e-6, 0.0)
    rmsnorm.rms_norm_backward_reduced(y, x, weight, stats, 0.0)
    _, partials = rmsnorm.rms_norm_backward(y, x, weight, stats, 0.0)  # a frozen weight's launch
    rmsnorm.reduce_dw_partials(partials, weight.dtype)
    rmsnorm.rms_norm(x, weight, impl="fused")  # no grad: the forward that stores no stats


def run_optimizers() -> None:
    for dtype in DTYPES.values():
        x, y = torch.randn(4096, 1024, device="cuda", dtype=dtype), torch.randn(4096, 1024, device="cuda", dtype=dtype)
        a = torch.ones((), device="cuda")
        muon.launch_kept_update(torch.zeros((), dtype=torch.bool, device="cuda"), x, a, y, a, -1)
        muon.launch_kept_update(None, x, a, y, None, 1)
    param = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    param.grad = torch.randn_like(param)
    optimizer = SkipStepOptimizer(torch.optim.AdamW([param], lr=1e-3, fused=True))
    optimizer.latest_loss = torch.ones((), device="cuda")
    optimizer.step()  # the window's decision in one fused launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", choices=sorted(TARGETS),
                        help=f"a card (repeatable; default {' and '.join(DEFAULT_TARGETS)})")
    parser.add_argument("--arm", action="append", choices=("moe", "rmsnorm", "optimizers"),
                        help="an arm (repeatable; default all)")
    parser.add_argument("--preset", action="append", default=[], help="a moe-bwd preset (repeatable; default all)")
    parser.add_argument("--no-usage", action="store_true", help="skip ptxas's register and spill count")
    parser.add_argument("--json", type=Path, help="write every build here")
    args = parser.parse_args(argv)
    arms = args.arm or ["moe", "rmsnorm", "optimizers"]
    # said before the minutes of compiling, not after them
    known = [p.name for p in moe_bwd.PRESETS if p.where == "cuda"]
    if unknown := [name for name in args.preset if name not in known]:
        parser.error(f"--preset {', '.join(unknown)}: not a GPU preset of moe-bwd; choose from {', '.join(known)}")
    if args.preset and "moe" not in arms:
        parser.error("--preset picks moe-bwd presets: add --arm moe")
    if args.json and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: its directory {args.json.parent} does not exist")
    cases = ([(name, run_moe, p) for name, p in moe_cases(args.preset)] if "moe" in arms else []) + \
            ([(name, run_rmsnorm, p) for name, p in rmsnorm_cases()] if "rmsnorm" in arms else []) + \
            ([("optimizers", lambda _: run_optimizers(), {})] if "optimizers" in arms else [])
    try:
        require_cross_compiling()  # what this machine lacks, said before any case runs
    except CouldNotRun as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    builds: dict[tuple, Build] = {}
    failed_cases = []
    for target in (TARGETS[name] for name in (args.target or DEFAULT_TARGETS)):
        for name, run, params in cases:
            with compiling_for(target, usage=not args.no_usage) as made:
                try:
                    run(params)
                except Exception as error:  # noqa: BLE001 - a case the arm refused is a finding too
                    failed_cases.append(f"{target.name} {name}: {type(error).__name__}: {error}")
            for build in made:
                kept = builds.setdefault(build.key, build)
                kept.cases.append(name)
    report(list(builds.values()), failed_cases)
    if args.json:
        args.json.write_text(json.dumps([asdict(b) for b in builds.values()], indent=1, default=str))
    return 1 if failed_cases or any(not b.fits for b in builds.values()) else 0


def report(builds: list[Build], failed_cases: list[str]) -> None:
    from tabulate import tabulate

    rows = []
    for b in sorted(builds, key=lambda b: (b.target, b.kernel, -(b.shared or 0))):
        tile = ",".join(f"{v}" for name, v in b.meta.items() if name.startswith("BLOCK") or name in ("num_warps", "num_stages"))
        rows.append((b.target, b.kernel, tile, b.shared, b.limit, b.registers, b.spill_bytes,
                     "ERROR" if b.error else ("ok" if b.fits else "OVER"), len(b.cases), b.cases[0]))
    print(tabulate(rows, headers=("card", "kernel", "tiles, warps, stages", "shared", "limit", "regs", "spill B",
                                  "", "cases", "first case")))
    for b in builds:
        if b.error:
            print(f"\n{b.target} {b.kernel} {b.meta} ({', '.join(b.cases[:3])}):\n  {b.error}")
    for line in failed_cases:
        print(f"case failed: {line}")
    errors = sum(1 for b in builds if b.error)
    over = sum(1 for b in builds if not b.error and not b.fits)
    print(f"\n{len(builds)} builds: {errors} errors, {over} over their card's shared memory, "
          f"{sum(1 for b in builds if (b.spill_bytes or 0) > 0)} spilling; {len(failed_cases)} cases failed")


if __name__ == "__main__":
    sys.exit(main())
