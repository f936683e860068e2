#!/usr/bin/env python3
"""Where the RMSNorm arm's time goes on a CUDA GPU: host time per call, back-to-back eager calls
and CUDA-graph device time, against F.rms_norm and peers.

    python scripts/rmsnorm_launch_probe.py            (on the GPU machine, project installed)

Needs torch, triton and the project (its timing comes from suite.harness.timers, so pydantic
too: scripts/device_check.sh brings it). Writes every figure to
$OUT/rmsnorm_probe.json when OUT is set (or --json PATH), and prints a short table last.
Sections, in order:

1. checks: the folded dW reduction gives the two-stage blocks' bits over repeated launches, and
   the cached launch gives kernel[grid]'s bits (a failed check is reported, not fatal).
2. host: host time per call at (8, 4096) bf16 (the GPU's work is smaller than the host's
   there), forward under no_grad and forward + autograd.grad backward; best of 5 batches of 200
   calls, perf_counter around the calls, the device synchronised before and after each batch.
   Contenders: the arm (cached launch), the arm through kernel[grid] (SUITE_TRITON_FAST_LAUNCH=0),
   F.rms_norm, torch.compile of the eager reference, torch.compile(fullgraph=True) of the arm,
   Liger when importable.
3. components: host time of the pieces of one arm call at (8, 4096).
4. eager: per-call time of back-to-back eager calls (a window of 50 calls between one CUDA
   event pair, inputs rotated over sets that together exceed 2x the L2; median of 11 windows),
   arm vs F.rms_norm at 4096x2048, 8192x2880, 16384x4096. This is what a training loop sees.
5. graph: device time of one call replayed from a CUDA graph, the L2 flushed before each replay
   (median of 30), for the same shapes; the arm also with its two-stage dW (two backward
   launches) to show what folding the reduction costs or saves on the device.
GB/s counts 4 B/elem forward and 10 B/elem forward+backward (bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

DEVICE = "cuda"
EPS = 1e-6
HOST_SHAPE = (8, 4096)
SHAPES = ((4096, 2048), (8192, 2880), (16384, 4096))
CASES = ("fwd", "fwd+bwd")
BYTES_PER_ELEMENT = {"fwd": 4, "fwd+bwd": 10}  # bf16: read x, write y; + read x, dy, write dx


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="where to write the figures (default $OUT/rmsnorm_probe.json)")
    parser.add_argument("--host-calls", type=int, default=200, help="calls per host-time batch")
    parser.add_argument("--host-batches", type=int, default=5, help="batches; the best is kept")
    parser.add_argument("--window", type=int, default=50, help="eager calls between one event pair")
    parser.add_argument("--windows", type=int, default=11, help="eager windows; the median is kept")
    parser.add_argument("--replays", type=int, default=30, help="graph replays timed; the median is kept")
    parser.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile contenders")
    args = parser.parse_args(argv)
    if args.json is None and os.environ.get("OUT"):
        args.json = os.path.join(os.environ["OUT"], "rmsnorm_probe.json")
    return args


# ---- pure helpers (tested on the CPU) ---------------------------------------------------------


def gb_per_s(case: str, rows: int, cols: int, ms: float) -> float:
    return BYTES_PER_ELEMENT[case] * rows * cols / (ms * 1e-3) / 1e9


def format_table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


# ---- timing: the harness's own (suite.harness.timers) ---------------------------------------


def timer():
    from suite.harness.timers import CudaTimer

    return CudaTimer(DEVICE)


def host_us(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    """Best host time per call over batches of back-to-back calls (one untimed batch first)."""
    from suite.harness.timers import host_us_per_call

    return host_us_per_call(fn, torch.cuda.synchronize, calls=args.host_calls, batches=args.host_batches)


# ---- contenders ------------------------------------------------------------------------------


def contenders(arm, skip_compile: bool) -> dict[str, Callable]:
    """name -> norm(x, weight); None for one that cannot run here (with why in NOTES)."""
    norms: dict[str, Callable] = {
        "arm": partial(arm.rms_norm, eps=EPS),
        "arm kernel[grid]": partial(arm.rms_norm, eps=EPS),  # run with FAST_LAUNCH off
        "fused": partial(arm.rms_norm, eps=EPS, impl="fused"),  # our kernels at every size
        "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS),
    }
    if skip_compile:
        NOTES["torch.compile"] = "skipped (--skip-compile)"
    else:
        norms["torch.compile(reference)"] = torch.compile(partial(arm.rms_norm_reference, eps=EPS), dynamic=False)
        norms["torch.compile(arm, fullgraph)"] = torch.compile(partial(arm.rms_norm, eps=EPS), fullgraph=True, dynamic=False)
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        norms["Liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)
    except ImportError as error:
        NOTES["Liger"] = f"not importable: {error}"
    return norms


NOTES: dict[str, str] = {}


def make_inputs(rows: int, cols: int, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, device=DEVICE).bfloat16()
    weight = (1 + 0.1 * torch.randn(cols, generator=gen, device=DEVICE)).bfloat16()
    dy = torch.randn(rows, cols, generator=gen, device=DEVICE).bfloat16()
    return x, weight, dy


def call(norm: Callable, case: str, x, weight, dy) -> Callable[[], Any]:
    """One call of the case: the forward under no_grad, or forward + autograd.grad."""
    if case == "fwd":

        def forward():
            with torch.no_grad():
                return norm(x, weight)

        return forward
    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    return lambda: torch.autograd.grad(norm(xg, wg), (xg, wg), dy)


class fast_launch_off:
    """The arm through kernel[grid], as SUITE_TRITON_FAST_LAUNCH=0 would have it."""

    def __init__(self, name: str):
        from suite.arms import triton_support

        self.support, self.off = triton_support, name == "arm kernel[grid]"

    def __enter__(self):
        self.saved = self.support.FAST_LAUNCH
        self.support.FAST_LAUNCH = self.saved and not self.off

    def __exit__(self, *exc):
        self.support.FAST_LAUNCH = self.saved


# ---- sections --------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def checks(arm, support) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rows, cols in SHAPES:
        x, _, dy = make_inputs(rows, cols)
        weight = (1 + 0.1 * torch.randn(cols, device=DEVICE)).float()  # fp32 dW shows order changes
        _, stats = arm.rms_norm_forward(x, weight, EPS, 0.0)
        _, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
        expected = bits(arm.reduce_dw_partials(partials, weight.dtype))
        mismatches = sum(
            not torch.equal(bits(arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)[1]), expected)
            for _ in range(50)
        )
        counters_zero = not stats[rows:].view(torch.int32).any().item()
        out[f"folded dW == two-stage, 50 launches, {rows}x{cols}"] = mismatches == 0 and counters_zero
    x, weight, dy = make_inputs(*SHAPES[0])
    results = {}
    for name in ("arm", "arm kernel[grid]"):
        with fast_launch_off(name):
            results[name] = [t.clone() for t in call(arm.rms_norm, "fwd+bwd", x, weight, dy)()]
    out["cached launch == kernel[grid] (dx, dw)"] = all(torch.equal(bits(a), bits(b)) for a, b in zip(*results.values()))
    return out


def host_section(arm, norms, args) -> dict[str, dict[str, float]]:
    x, weight, dy = make_inputs(*HOST_SHAPE)
    out: dict[str, dict[str, float]] = {}
    for name, norm in norms.items():
        out[name] = {}
        for case in CASES:
            with fast_launch_off(name):
                out[name][case] = host_us(call(norm, case, x, weight, dy), args)
    return out


def components_section(arm, support, args) -> dict[str, float]:
    """Host us of the pieces of an arm call at HOST_SHAPE (read against host['arm'])."""
    x, weight, dy = make_inputs(*HOST_SHAPE)
    rows, cols = HOST_SHAPE
    cfg = arm._launch_config(rows, cols, x.device)
    y, stats = arm.rms_norm_forward(x, weight, EPS, 0.0)
    fwd_args = (x, weight, y, stats, x.stride(0), rows, cols, cfg.n_counters, EPS, 0.0)
    fwd_meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, LOOPED=cfg.looped, STORE_STATS=True, num_warps=cfg.num_warps)
    kernel = arm._rms_norm_fwd_kernel

    def probe_function(saved=lambda a, b: (), backward=lambda grad: (grad, None)):
        """An autograd.Function whose forward is an identity view saving saved(a, b), and whose
        backward unpacks them and returns backward(grad)."""

        class Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, a, b):
                ctx.save_for_backward(*saved(a, b))
                return a.view_as(a)

            @staticmethod
            def backward(ctx, grad):
                ctx.saved_tensors
                return backward(grad)

        return Probe

    Identity = probe_function()
    SavesThree = probe_function(saved=lambda a, b: (a, b, stats))  # what ours saves
    # the folded launch leaves the counters in stats at zero: reusable
    OurBackwardOnly = probe_function(backward=lambda grad: arm._backward(grad, x, weight, stats, 0.0, cfg, True))
    # our backward's two halves, each on autograd's device thread: why it costs there about
    # twice what it costs on the main thread
    dx_kept, (_, dw_kept) = torch.empty_like(x), arm._backward(dy, x, weight, stats, 0.0, cfg, True)
    partials_kept = torch.empty((cfg.n_parts, cols), dtype=torch.float32, device=x.device)
    bwd_args = (dy, x, weight, stats, stats, dx_kept, partials_kept, dw_kept, dy.stride(0), x.stride(0), rows, cols,
                0.0, cfg.group_size)
    bwd_meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROW_FITS=not cfg.looped, REDUCE_DW=True,
                    FOLD_BLOCK_N=cfg.fold_block_n, UNROLL=arm.FOLD_UNROLL, num_warps=cfg.num_warps)

    def launch_only(grad):
        support.launch(arm._rms_norm_bwd_kernel, cfg.bwd_grid, *bwd_args, **bwd_meta)
        return dx_kept, dw_kept

    AllocationsOnly = probe_function(backward=lambda grad: (
        torch.empty_like(x), torch.empty((cfg.n_parts, cols), dtype=torch.float32, device=x.device),
        torch.empty(cols, dtype=weight.dtype, device=x.device))[::2])
    LaunchOnly = probe_function(backward=launch_only)

    # The backward's launch as the arm makes it (a DirectLaunch: the C launcher, addresses as
    # integers, no key): compiled kernels only (the interpreter has no C launcher).
    direct = cfg.backward.direct(cfg.bwd_grid, *bwd_args)
    direct_pieces = {}
    if direct is not None:
        values = support._pointers(bwd_args)

        def direct_launch(grad=None):
            direct(torch._C._cuda_getCurrentRawStream(x.device.index), *values)
            return dx_kept, dw_kept

        def two_allocations_and_direct_launch(grad):
            torch.empty_like(x), torch.empty(cols, dtype=weight.dtype, device=x.device)
            return direct_launch()

        DirectLaunchOnly = probe_function(backward=direct_launch)
        TwoAllocationsDirect = probe_function(backward=two_allocations_and_direct_launch)
        xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
        direct_pieces = {
            "our backward launch, DirectLaunch, main thread": direct_launch,
            "identity forward, a backward of a DirectLaunch + autograd.grad": lambda: torch.autograd.grad(
                DirectLaunchOnly.apply(xd, wd), (xd, wd), dy),
            "identity forward, a backward of 2 allocations + a DirectLaunch + autograd.grad":
                lambda: torch.autograd.grad(TwoAllocationsDirect.apply(xd, wd), (xd, wd), dy),
            "Launcher guards: torch.cuda.current_device()": torch.cuda.current_device,
            "Launcher guards: the current raw stream": lambda: torch._C._cuda_getCurrentRawStream(x.device.index),
        }
    OneAllocation = probe_function(backward=lambda grad: (torch.empty_like(x), None))

    def one_thread(fn):
        """fn with autograd's multithreading off: every node on the calling thread."""

        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()

        return run

    xg = x.detach().requires_grad_()
    wg = weight.detach().requires_grad_()
    pieces = {
        "ours, forward + autograd.grad (impl=fused)": lambda: torch.autograd.grad(
            arm.rms_norm(xg, wg, EPS, impl="fused"), (xg, wg), dy),
        "torch.rms_norm forward + autograd.grad": lambda: torch.autograd.grad(
            torch.rms_norm(xg, (cols,), wg, EPS), (xg, wg), dy),
        "ours, forward under grad, no backward (Function.apply)": lambda: arm.rms_norm(xg, wg, EPS, impl="fused"),
        "torch.rms_norm forward under grad, no backward": lambda: torch.rms_norm(xg, (cols,), wg, EPS),
        # the routed path (impl=auto at this size) against what a user would call instead
        "ours routed forward (impl=auto), no grad needed": lambda: arm.rms_norm(x, weight, EPS),
        "F.rms_norm forward, no grad needed": lambda: F.rms_norm(x, (cols,), weight, EPS),
        "torch.rms_norm forward, no grad needed": lambda: torch.rms_norm(x, (cols,), weight, EPS),
        "torch._fused_rms_norm forward, no grad needed": lambda: torch._fused_rms_norm(x, (cols,), weight, EPS),
        "ours routed forward (impl=auto) + autograd.grad": lambda: torch.autograd.grad(
            arm.rms_norm(xg, wg, EPS), (xg, wg), dy),
        "F.rms_norm forward + autograd.grad": lambda: torch.autograd.grad(
            F.rms_norm(xg, (cols,), wg, EPS), (xg, wg), dy),
        "torch._fused_rms_norm forward + autograd.grad": lambda: torch.autograd.grad(
            torch._fused_rms_norm(xg, (cols,), wg, EPS)[0], (xg, wg), dy),
        # (CPU-only torch binds a stub that raises: the probe's CPU test has no stream to ask)
        "the capture query alone (_cuda_isCurrentStreamCapturing)": arm._capturing if x.is_cuda else bool,
        "identity Function saving 3 tensors + autograd.grad": lambda: torch.autograd.grad(SavesThree.apply(xg, wg), xg, dy),
        "identity forward, our backward + autograd.grad": lambda: torch.autograd.grad(
            OurBackwardOnly.apply(xg, wg), (xg, wg), dy),
        "identity forward, a backward of our 3 allocations only + autograd.grad": lambda: torch.autograd.grad(
            AllocationsOnly.apply(xg, wg), (xg, wg), dy),
        "identity forward, a backward of our launch only + autograd.grad": lambda: torch.autograd.grad(
            LaunchOnly.apply(xg, wg), (xg, wg), dy),
        "our backward launch alone, main thread": lambda: launch_only(dy),
        "our _backward block alone (3 allocations, launch)": lambda: arm._backward(dy, x, weight, stats, 0.0, cfg, True),
        "3 torch.empty": lambda: (torch.empty_like(x), torch.empty((cfg.n_parts, cols), dtype=torch.float32, device=x.device),
                                  torch.empty(cols, dtype=weight.dtype, device=x.device)),
        "rms_norm_forward block (config, 2 allocations, launch)": lambda: arm.rms_norm_forward(x, weight, EPS, 0.0),
        "rms_norm_backward_reduced block (3 allocations, launch)": lambda: arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0),
        "launch() of the forward kernel, cached": lambda: support.launch(kernel, cfg.row_grid, *fwd_args, **fwd_meta),
        "the config's bound Launcher of the forward kernel": lambda: cfg.forward(cfg.row_grid, *fwd_args),
        "kernel[grid] of the forward kernel": lambda: kernel[cfg.row_grid](*fwd_args, **fwd_meta),
        "specialization key of the forward's arguments": lambda: support.specialization_key(fwd_args),
        "launch config lookup (reads SUITE_PROFILE)": lambda: arm._launch_config(rows, cols, x.device),
        "torch.empty": lambda: torch.empty((rows, cols), dtype=x.dtype, device=x.device),
        "identity autograd.Function apply (forward only)": lambda: Identity.apply(xg, weight),
        "identity autograd.Function forward + autograd.grad": lambda: torch.autograd.grad(Identity.apply(xg, weight), xg, dy),
        # the backward's pieces on autograd's device thread, with less Python around the launch
        **direct_pieces,
        "identity forward, a backward of 1 allocation + autograd.grad": lambda: torch.autograd.grad(
            OneAllocation.apply(xg, wg), xg, dy),
        "Launcher guards: the hooks check": lambda: support._hooks_idle(kernel),
        # is the device thread the cost? the same calls with every node on the calling thread
        "ours, forward + autograd.grad (impl=fused), multithreading off": one_thread(lambda: torch.autograd.grad(
            arm.rms_norm(xg, wg, EPS, impl="fused"), (xg, wg), dy)),
        "torch.rms_norm forward + autograd.grad, multithreading off": one_thread(lambda: torch.autograd.grad(
            torch.rms_norm(xg, (cols,), wg, EPS), (xg, wg), dy)),
        "identity forward, our backward + autograd.grad, multithreading off": one_thread(lambda: torch.autograd.grad(
            OurBackwardOnly.apply(xg, wg), (xg, wg), dy)),
    }
    measured = {name: host_us(fn, args) for name, fn in pieces.items()}
    return measured


def eager_section(arm, args) -> dict[str, Any]:
    from suite.harness.runner import rotation_sets
    from suite.harness.timing import Rotation

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    norms = {"arm": partial(arm.rms_norm, eps=EPS), "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)}
    events = timer()
    out: dict[str, Any] = {}
    for rows, cols in SHAPES:
        n_sets = rotation_sets(2 * rows * cols * 2, l2)  # x and dy, bf16
        sets = [make_inputs(rows, cols, seed) for seed in range(n_sets)]
        for case in CASES:
            for name, norm in norms.items():
                rotating = Rotation([call(norm, case, *inputs) for inputs in sets])
                events.time_calls(rotating, 2, flush_l2=False, window=args.window)  # warm-up
                ms = statistics.median(events.time_calls(rotating, args.windows, flush_l2=False, window=args.window))
                out[f"{rows}x{cols} {case} {name}"] = {"ms": ms, "GB/s": gb_per_s(case, rows, cols, ms), "input_sets": n_sets}
        del sets
        torch.cuda.empty_cache()
    return out


def two_stage(arm):
    """The arm's forward and backward from the two-stage blocks (dW reduced in a second launch)."""

    def fwd_bwd(x, weight, dy):
        y, stats = arm.rms_norm_forward(x, weight, EPS, 0.0)
        dx, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
        return y, dx, arm.reduce_dw_partials(partials, weight.dtype)

    return fwd_bwd


def graph_section(arm, args) -> dict[str, Any]:
    events = timer()
    norms = {"arm": partial(arm.rms_norm, eps=EPS), "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS)}
    out: dict[str, Any] = {}
    for rows, cols in SHAPES:
        x, weight, dy = make_inputs(rows, cols)
        fns = {(case, name): call(norm, case, x, weight, dy) for case in CASES for name, norm in norms.items()}
        fns[("fwd+bwd", "arm two-stage dW")] = partial(two_stage(arm), x, weight, dy)
        for (case, name), fn in fns.items():
            replay = events.capture(fn)
            events.time_calls(replay, 3, flush_l2=True, window=1)  # warm-up
            ms = statistics.median(events.time_calls(replay, args.replays, flush_l2=True, window=1))
            out[f"{rows}x{cols} {case} {name}"] = {"ms": ms, "GB/s": gb_per_s(case, rows, cols, ms)}
        del x, dy, fns
        torch.cuda.empty_cache()
    return out


def kernel_resources(support, arm) -> dict[str, Any]:
    """Registers and spills of every cached compile of the backward kernel (the folded
    reduction must not cost the main loop its occupancy)."""
    out = {}
    for bound in support.launchers_of(arm._rms_norm_bwd_kernel):
        meta = bound.meta
        name = f"bwd BLOCK_M={meta.get('BLOCK_M')} BLOCK_N={meta.get('BLOCK_N')} warps={meta.get('num_warps')} REDUCE_DW={meta.get('REDUCE_DW')}"
        for entry in bound.entries.values():
            if entry is not None:
                compiled = entry.compiled
                out[name] = {"n_regs": compiled.n_regs, "n_spills": compiled.n_spills, "shared": compiled.metadata.shared}
    return out


def environment(support) -> dict[str, Any]:
    import triton

    props = torch.cuda.get_device_properties(0)
    sha = os.environ.get("SUITE_GIT_SHA")
    if sha is None and os.path.exists(".git-sha"):
        sha = open(".git-sha").read().strip()
    return {
        "gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(), "commit": sha or "unknown (no SUITE_GIT_SHA, no .git-sha)",
        "fast_launch_verified_for_this_triton": support._fast_launch_verified,
        "SUITE_PROFILE": os.environ.get("SUITE_PROFILE", "auto"),
    }


# ---- report ----------------------------------------------------------------------------------


def summary(result: dict[str, Any]) -> str:
    parts = []
    host = result.get("host_us_at_8x4096", {})
    if "error" not in host:
        parts.append(format_table(
            [[name, f"{v['fwd']:.1f}", f"{v['fwd+bwd']:.1f}"] for name, v in host.items()],
            ["host us per call, (8, 4096) bf16", "fwd", "fwd+bwd"],
        ))
    eager, graph = result.get("eager_back_to_back", {}), result.get("graph_device", {})

    def cell(figures, key):
        got = figures.get(key)
        return f"{got['ms'] * 1e3:.1f} ({got['GB/s']:.0f})" if got else "-"

    rows = []
    for rows_cols in (f"{r}x{c}" for r, c in SHAPES):
        for case in CASES:
            arm_e, f_e = eager.get(f"{rows_cols} {case} arm"), eager.get(f"{rows_cols} {case} F.rms_norm")
            rows.append([
                f"{rows_cols} {case}",
                cell(eager, f"{rows_cols} {case} arm"), cell(eager, f"{rows_cols} {case} F.rms_norm"),
                ("yes" if arm_e["ms"] <= f_e["ms"] else "NO") if arm_e and f_e else "-",
                cell(graph, f"{rows_cols} {case} arm"), cell(graph, f"{rows_cols} {case} F.rms_norm"),
                cell(graph, f"{rows_cols} {case} arm two-stage dW"),
            ])
    parts.append(format_table(rows, [
        "us per call (GB/s)", "eager arm", "eager F.rms_norm", "arm <= F", "graph arm", "graph F.rms_norm",
        "graph arm two-stage dW",
    ]))
    parts.append(
        "eager: back-to-back calls, host dispatch included (the requirement: arm <= F.rms_norm at every "
        "shape here); graph: device time of a replayed CUDA graph, L2 flushed; two-stage dW: the arm "
        "with the dW reduction in a second launch instead of folded into the backward."
    )
    checked = result.get("checks", {})
    parts.append("checks: " + ", ".join(f"{k}: {'ok' if v is True else ('FAILED' if v is False else v)}" for k, v in checked.items()))
    errors = [name for name, value in result.items() if isinstance(value, dict) and "error" in value]
    if errors:
        parts.append("sections that raised (see the traceback above and the JSON): " + ", ".join(errors))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("rmsnorm_launch_probe: needs a CUDA GPU", file=sys.stderr)
        return 3
    from suite.arms import rmsnorm as arm
    from suite.arms import triton_support as support

    started = time.perf_counter()
    result: dict[str, Any] = {"environment": environment(support), "notes": NOTES}

    def section(name: str, fn: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as error:  # report it and go on: the other sections still measure
            traceback.print_exc()
            result[name] = {"error": repr(error)}
        print(f"[{time.perf_counter() - started:6.1f} s] {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if args.json:  # write as we go: a run cut short still leaves what it measured
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    print(json.dumps(result["environment"]), flush=True)
    section("checks", lambda: checks(arm, support))
    norms = contenders(arm, args.skip_compile)
    section("host_us_at_8x4096", lambda: host_section(arm, norms, args))
    section("components_us_at_8x4096", lambda: components_section(arm, support, args))
    section("eager_back_to_back", lambda: eager_section(arm, args))
    section("graph_device", lambda: graph_section(arm, args))
    section("backward_kernel_resources", lambda: kernel_resources(support, arm))
    result["seconds"] = time.perf_counter() - started
    section("seconds", lambda: result["seconds"])

    print()
    components = result["components_us_at_8x4096"]
    if "error" not in components:
        print(format_table([[k, f"{v:.1f}"] for k, v in components.items()], ["arm pieces at (8, 4096)", "host us"]))
    print("backward kernel compiles:", json.dumps(result["backward_kernel_resources"], indent=1))
    if NOTES:
        print("notes:", json.dumps(NOTES))
    print()
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
