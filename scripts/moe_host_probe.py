#!/usr/bin/env python3
"""Host time per call of the MoE experts' entry points (suite.arms.moe.launch) and, on a GPU,
of the layers: the experts' forward+backward under autograd (alone, and per layer of eight
chained into one backward, as a model's layers share one), the routing alone, and a whole
MoEExperts forward+backward from its input (router, routing, experts), and its two parts (the
router's nn.Linear under cuBLAS and cuBLASLt; the routing and experts' one autograd node).

    python scripts/moe_host_probe.py [--tokens 8] [--hidden 1024 --ffn 2816 --experts 16 --top-k 2]
                                     [--profile CALLS]   (cProfile of each layer: where the time goes)
                                     [--trace CALLS]     (torch.profiler of each layer: the ops')

On a CUDA GPU the kernels launch: at a few tokens the GPU's work is smaller than the host's, so
back-to-back calls measure dispatch (the checks, the tile choice, the launch path, autograd).
The device time of each call (CUDA-graph replays) is printed beside it: where the host time
exceeds it, an eager loop waits on the host. Without a GPU the launches are stubbed and what
is left is the Python of the entry points, and of the experts layer under autograd and the
routing, the part a change to their checks, buffers or tile choice moves (the 2-core CPU of
CI and development); a CPU device takes the RTX card's shared-memory
limit (suite.device_profile), so its tiles are chosen as on the user's card, where the first
tile tried fits less often than on the H200. Defaults: the top2-small preset's layer.

Writes every figure to $OUT/moe_host_probe.json when OUT is set (or --json PATH), and prints a
table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from contextlib import contextmanager, nullcontext
from typing import Any, Callable

import torch
from tabulate import tabulate

if not torch.cuda.is_available():  # the launch paths Triton's interpreter takes, before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

from suite.arms import moe  # noqa: E402
from suite.arms.moe import launch as mk  # noqa: E402
from suite.triton_support import KeptLaunches  # noqa: E402
from suite.harness.timers import CudaTimer, host_us_per_call  # noqa: E402

# layers chained into one forward and one backward: their row is per layer
STACK = 8
STACKED = f"experts fwd+bwd, per layer of {STACK} in one backward"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8, help="tokens of the layer (few: the host's time shows)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="calls a timed batch")
    parser.add_argument("--json", default=None, help="where to write the figures (default: $OUT/moe_host_probe.json)")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="also cProfile this many calls of each layer and print the top functions")
    parser.add_argument("--trace", type=int, default=0, metavar="CALLS",
                        help="also trace this many calls of each layer with torch.profiler and print the ops with "
                             "the most host time of their own (allocations, launches, the autograd engine's)")
    return parser.parse_args(argv)


VIEWS = "experts on a model's weights' views fwd+bwd"


@contextmanager
def launches_stubbed():
    """The Python alone: no kernel launches (planned or kept: the routing's too), and CPU
    tensors accepted. What the stubbed kernels would have written is left unwritten."""
    saved = mk.PlannedLaunch.__call__, mk.require_runnable, KeptLaunches.__call__
    mk.PlannedLaunch.__call__, mk.require_runnable = (lambda self, *tensors: None), (lambda t, fn, *rest, **others: None)
    KeptLaunches.__call__ = lambda self, *args: None
    try:
        yield
    finally:
        mk.PlannedLaunch.__call__, mk.require_runnable, KeptLaunches.__call__ = saved


def entry_points(args: argparse.Namespace, device: torch.device) -> tuple[dict[str, Callable[[], Any]],
                                                                          dict[str, Callable[[], Any]]]:
    """Each entry point with caller-owned buffers (as the autograd Function calls them, minus
    its allocations), and the layers: the experts' forward+backward on a routing made once,
    the routing alone, and a whole MoEExperts layer's forward+backward from its input."""
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    t, d, f, e, k = args.tokens, args.hidden, args.ffn, args.experts, args.top_k

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    x = randn(t, d)
    w_gate, w_up, w_down = randn(e, d, f, scale=d**-0.5), randn(e, d, f, scale=d**-0.5), randn(e, f, d, scale=f**-0.5)
    routing = moe.route(torch.randn(t, e, generator=gen).to(device), k)
    rows = routing.max_rows
    probs, offsets, token_of_row, row_id_map = routing.probs.detach(), routing.offsets, routing.token_of_row, routing.row_id_map

    def empty(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype, device=device)

    a, g, u, y, grad_rows, dg, du, dx_rows = (empty(rows, w) for w in (f, f, f, d, d, f, f, d))
    out, grad_out, dx = empty(t, d), randn(t, d), empty(t, d)
    grad_probs = empty(t, k, dtype=torch.float32)
    dw_gate, dw_up, dw_down = empty(e, d, f), empty(e, d, f), empty(e, f, d)
    calls = {
        "expert_up": lambda: mk.expert_up(x, w_gate, w_up, token_of_row, offsets, out=a, gate_out=g, up_out=u),
        "expert_down": lambda: mk.expert_down(a, w_down, offsets, out=y),
        "combine": lambda: mk.combine(y, row_id_map, probs, out=out),
        "combine_backward": lambda: mk.combine_backward(grad_out, y, probs, row_id_map, grad_rows_out=grad_rows,
                                                        grad_probs_out=grad_probs),
        "expert_down_backward": lambda: mk.expert_down_backward(grad_rows, a, g, u, w_down, offsets, dg_out=dg,
                                                                du_out=du, dw_down_out=dw_down),
        "expert_up_backward": lambda: mk.expert_up_backward(dg, du, x, w_gate, w_up, token_of_row, offsets,
                                                            dx_rows_out=dx_rows, dw_gate_out=dw_gate, dw_up_out=dw_up),
        "combine (dx)": lambda: mk.combine(dx_rows, row_id_map, top_k=k, out=dx),
    }
    leaves = [p.requires_grad_() for p in (x.clone(), w_gate.clone(), w_up.clone(), w_down.clone())]
    layer_probs = routing.probs.detach().requires_grad_()
    # as route() made it (its checks would read what stubbed kernels left unwritten)
    layer_routing = moe.trusted_routing(**{**vars(routing), "probs": layer_probs})

    def experts_layer():
        result = moe.experts(leaves[0], layer_routing, *leaves[1:])
        return torch.autograd.grad(result, [*leaves, layer_probs], grad_out)

    # a model's own fused weights (transformers' gate_up_proj [E, 2f, d], down_proj [E, d, f]), as
    # use_suite_experts passes them: gate_up_experts, and the experts on their views (the old way)
    model_layout = moe.GateUpLayout()
    fused = [torch.cat([w_gate, w_up], 2).transpose(1, 2).contiguous().requires_grad_(),
             w_down.transpose(1, 2).contiguous().requires_grad_()]

    def gate_up_layer():
        result = moe.gate_up_experts(leaves[0], layer_routing, *fused)
        return torch.autograd.grad(result, [leaves[0], *fused, layer_probs], grad_out)

    def views_layer():
        result = moe.experts(leaves[0], layer_routing, *model_layout.views(*fused))
        return torch.autograd.grad(result, [leaves[0], *fused, layer_probs], grad_out)

    # a model's layers share one backward: the autograd engine's start (on a GPU its hand-off to
    # the device's thread) is paid once a step, not once a layer as in experts_layer. Each layer
    # has weights of its own (shared ones would add their gradients up); their values are never
    # read on the CPU and do not change a GPU's time
    stack_weights = [leaves[1:]] + [[torch.empty_like(w).requires_grad_() for w in leaves[1:]]
                                    for _ in range(STACK - 1)]

    def experts_stack():
        h = leaves[0]
        for weights in stack_weights:
            h = moe.experts(h, layer_routing, *weights)
        return torch.autograd.grad(h, [leaves[0], *(w for ws in stack_weights for w in ws), layer_probs], grad_out)

    logits = torch.randn(t, e, generator=gen).to(device)
    module = moe.MoEExperts(d, f, e, k, device=device, dtype=dtype)
    module_x = x.clone().requires_grad_()

    def module_layer():
        out = module(module_x)
        return torch.autograd.grad(out, [module_x, *module.parameters()], grad_out)

    # MoEExperts in its two parts: the router's nn.Linear (under cuBLAS, then cuBLASLt: each call
    # sets its library, a microsecond or two of its row), and the routing plus experts behind
    # their one autograd node, from fixed logits
    router_x, router_grad = x.clone().requires_grad_(), randn(t, e)
    fused_logits = module.router(x).detach().requires_grad_()

    def router_layer(blas: str):
        torch.backends.cuda.preferred_blas_library(blas)
        return torch.autograd.grad(module.router(router_x), [router_x, module.router.weight], router_grad)

    def fused_layer():
        out, _ = moe.fused_layer(fused_logits, module_x, module.w_gate, module.w_up, module.w_down, k,
                                  module.renormalize, module._capacity, False)
        return torch.autograd.grad(out, [fused_logits, module_x, module.w_gate, module.w_up, module.w_down], grad_out)

    layers = {
        "experts fwd+bwd (autograd)": experts_layer,
        "gate_up_experts fwd+bwd (a model's weights)": gate_up_layer,
        VIEWS: views_layer,
        STACKED: experts_stack,
        "route (logits -> Routing)": lambda: moe.route(logits, k),
        "MoEExperts fwd+bwd (router, route, experts)": module_layer,
        "MoEExperts' router fwd+bwd, cuBLAS": lambda: router_layer("cublas"),
        "MoEExperts' router fwd+bwd, cuBLASLt": lambda: router_layer("cublaslt"),
        "MoEExperts' route+experts fwd+bwd (one node)": fused_layer,
    }
    return calls, layers


def print_profile(fn: Callable[[], Any], calls: int, sync: Callable[[], None], top: int = 25) -> None:
    """Where the host's time goes: the functions with the most own time over `calls` calls."""
    import cProfile
    import pstats

    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    sync()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def print_trace(fn: Callable[[], Any], calls: int, sync: Callable[[], None], top: int = 25) -> None:
    """The host's time by op (torch.profiler, CPU side): where Python's profile shows only the
    autograd engine and the builtins, this names the aten ops, the allocator and the launches."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def measure(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rows = []
    with nullcontext() if cuda else launches_stubbed():
        calls, layers = entry_points(args, device)
        # on the CPU the MoEExperts layer's router runs its real matmuls there, and the views'
        # gradients their real copies: not the host's cost
        named = [*calls.items(), *((n, fn) for n, fn in layers.items()
                                   if cuda or not (n.startswith("MoEExperts") or n == VIEWS))]
        blas = torch.backends.cuda.preferred_blas_library() if cuda else None
        timer = CudaTimer(device) if cuda else None
        for name, fn in named:
            fn()  # compiles
            per = STACK if name == STACKED else 1
            row = {"call": name, "host_us": host_us_per_call(fn, sync, calls=args.calls) / per}
            if timer is not None:
                replay = timer.capture(fn)
                row["device_us"] = 1e3 * min(timer.time_calls(replay, 20, flush_l2=False, window=10)) / per
            rows.append(row)
            if blas is not None:
                torch.backends.cuda.preferred_blas_library(blas)  # the router rows set their own
        if cuda and args.profile:
            for name, fn in layers.items():
                print(f"--- cProfile of {args.profile} calls: {name}")
                print_profile(fn, args.profile, sync)
        if cuda and args.trace:
            for name, fn in layers.items():
                print(f"--- torch.profiler of {args.trace} calls: {name}")
                print_trace(fn, args.trace, sync)
    return {
        "what": "launched on CUDA" if cuda else "python only: launches stubbed, CPU tensors",
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__, "shape": {k: getattr(args, k) for k in ("tokens", "hidden", "ffn", "experts", "top_k")},
        "rows": rows,
        "sum_of_entry_points_host_us": sum(r["host_us"] for r in rows if r["call"] in calls),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    path = args.json or (os.path.join(os.environ["OUT"], "moe_host_probe.json") if os.environ.get("OUT") else None)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)
    print(f"{result['what']} ({result['device']}, torch {result['torch']}), shape {result['shape']}")
    rows = [[row["call"], row["host_us"], row.get("device_us")] for row in result["rows"]]
    rows.append(["sum of the entry points", result["sum_of_entry_points_host_us"], None])
    print(tabulate(rows, headers=["call", "host us", "device us"], floatfmt=".1f", missingval="-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
