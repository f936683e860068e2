#!/usr/bin/env python3
"""Why an eager RMSNorm forward+backward can take longer than its device time at large shapes.

    python scripts/rmsnorm_eager_probe.py [--shape 16384x4096]   (on the GPU machine)

For the arm (impl="auto": our kernels from 2^25 elements, the default shape's class; below it
its eager calls are torch's fused op while its graph figure is still ours, captures taking our
kernels) and F.rms_norm, bf16, the forward and autograd.grad backward for x and the weight: the
host's enqueue time per call (perf_counter around 20 calls with no sync inside, so it grows past
the host's own cost only if something in the call waits on the device), the caching
allocator's device allocations during 50 calls (each cudaMalloc can stall the host), the
per-call time of back-to-back eager calls in windows of 5 and of 50 between a CUDA event pair,
with and without an L2 flush before each window, one call's device time (a replayed CUDA
graph), the forward's and the backward's enqueue times alone, and the CUDA runtime calls the
host made (torch.profiler). Then a timeline of our kernels' call (impl="fused") at this shape
and at 8x4096, where the GPU idles: timestamps at the call, inside the autograd.Function's
forward and backward (the backward on autograd's device thread) and around each launch, the
median us of each interval over 200 calls. Prints the tables; writes
$OUT/rmsnorm_eager_probe.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


TIMELINE = (  # (interval, from mark, to mark) in one call's order of marks
    ("rms_norm() to forward body (wrapper, Function.apply)", "call", "forward in"),
    ("forward body to its launch (config, allocations)", "forward in", "launch in"),
    ("forward launch", "launch in", "launch out"),
    ("forward launch to body end (save, dW buffer)", "launch out", "forward out"),
    ("forward body end to y returned (apply's exit)", "forward out", "y returned"),
    ("y returned to backward body (autograd.grad, to the device thread)", "y returned", "backward in"),
    ("backward body to its launch (saved tensors, dx, workspace)", "backward in", "launch in#2"),
    ("backward launch", "launch in#2", "launch out#2"),
    ("backward launch to body end", "launch out#2", "backward out"),
    ("backward body end to autograd.grad returned (back to the caller)", "backward out", "grad returned"),
    ("forward: call to y returned", "call", "y returned"),
    ("backward: y returned to autograd.grad returned", "y returned", "grad returned"),
    ("whole call", "call", "grad returned"),
)


class _Marks(list):
    stamp = staticmethod(time.perf_counter_ns)

    def __call__(self, name: str) -> None:
        self.append((name, self.stamp()))


def _instrumented(function, marks: _Marks) -> None:
    """function's forward and backward wrapped with marks (undo with _restored)."""
    forward, backward = function.forward, function.backward

    def timed_forward(ctx, *args):
        marks("forward in")
        out = forward(ctx, *args)
        marks("forward out")
        return out

    def timed_backward(ctx, *grads):
        marks("backward in")
        out = backward(ctx, *grads)
        marks("backward out")
        return out

    function.forward, function.backward = staticmethod(timed_forward), staticmethod(timed_backward)
    function.untimed = (forward, backward)


def _restored(function) -> None:
    forward, backward = function.untimed
    function.forward, function.backward = staticmethod(forward), staticmethod(backward)
    del function.untimed


def timeline(norm, x, weight, dy, marks: _Marks, calls: int = 200, warm: int = 20) -> dict[str, float | None]:
    """Median us of each TIMELINE interval of norm's eager forward + autograd.grad (intervals
    whose marks the variant does not make are None)."""
    import gc

    per_call: list[dict[str, int]] = []
    gc.disable()
    try:
        for i in range(calls + warm):
            marks.clear()
            marks("call")
            y = norm(x, weight)
            marks("y returned")
            torch.autograd.grad(y, (x, weight), dy, allow_unused=True)  # the identity leaves weight out
            marks("grad returned")
            if i >= warm:
                seen: dict[str, int] = {}
                for name, at in marks:
                    n = sum(1 for k in seen if k.split("#")[0] == name)
                    seen[name if n == 0 else f"{name}#{n + 1}"] = at
                per_call.append(seen)
        torch.cuda.synchronize()
    finally:
        gc.enable()
    return {
        label: statistics.median((c[end] - c[start]) / 1e3 for c in per_call) if start in per_call[0] and end in per_call[0] else None
        for label, start, end in TIMELINE
    }


def timeline_variants(x, weight, dy, calls: int = 200, warm: int = 20) -> dict[str, dict[str, float | None]]:
    """The timeline of: our kernels as the arm calls them (its launches timed around
    the config's KeptLaunches); a floor, a Function that does only the unavoidable (the allocations, and
    each launch a DirectLaunch with its scalars prepared once; left out where the fast path is
    off); an identity Function (autograd and the thread handoffs alone); F.rms_norm (its outer
    marks only)."""
    from suite.arms import rmsnorm as arm
    from suite.arms.triton_support import KeptLaunches

    marks = _Marks()
    launch = KeptLaunches.__call__

    def timed_launch(*args):
        marks("launch in")
        launch(*args)
        marks("launch out")

    rows, cols = x.shape
    cfg = arm._launch_config(rows, cols, x.device)
    fused = lambda a, w: arm.rms_norm(a, w, 1e-6, impl="fused")  # noqa: E731
    # the arm's own DirectLaunches for these arguments (None where the fast path is off)
    y, stats = torch.empty_like(x), torch.zeros(rows + cfg.n_counters, dtype=torch.float32, device=x.device)
    dx, dw = torch.empty_like(x), torch.empty(cols, dtype=weight.dtype, device=x.device)
    partials = torch.empty((cfg.max_parts, cols), dtype=torch.float32, device=x.device)
    fwd_scalars = (cols, rows, cols, cfg.n_counters, 1e-6, 0.0)
    bwd_scalars = (cols, cols, rows, cols, 0.0, cfg.group_size)
    fwd = cfg.forward.direct(cfg.row_grid, x, weight, y, stats, *fwd_scalars)
    bwd = cfg.backward.direct(cfg.bwd_grid, dy, x, weight, stats, stats, dx, partials, dw, *bwd_scalars)
    stream = torch._C._cuda_getCurrentRawStream(x.device.index) if x.is_cuda else 0

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            y = torch.empty_like(a)
            stats = torch.empty(rows + cfg.n_counters, dtype=torch.float32, device=a.device)
            marks("launch in")
            fwd(stream, a.data_ptr(), w.data_ptr(), y.data_ptr(), stats.data_ptr(), *fwd_scalars)
            marks("launch out")
            ctx.save_for_backward(a, w, stats)
            ctx.dw = torch.empty(cols, dtype=w.dtype, device=w.device)
            return y

        @staticmethod
        def backward(ctx, grad):
            a, w, stats = ctx.saved_tensors
            dx = torch.empty_like(a)
            marks("launch in")
            bwd(stream, grad.data_ptr(), a.data_ptr(), w.data_ptr(), stats.data_ptr(), stats.data_ptr(),
                dx.data_ptr(), partials.data_ptr(), ctx.dw.data_ptr(), *bwd_scalars)
            marks("launch out")
            return dx, ctx.dw

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, w):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    variants = [("ours", fused, arm._RMSNormFunction, timed_launch)]
    if fwd is not None and bwd is not None:
        variants.append(("floor", Floor.apply, Floor, None))
    variants += [("identity Function", Identity.apply, Identity, None),
                 ("F.rms_norm", lambda a, w: F.rms_norm(a, (cols,), w, 1e-6), None, None)]
    out: dict[str, dict[str, float | None]] = {}
    for name, norm, function, launch_with in variants:
        if function is not None:
            _instrumented(function, marks)
        if launch_with is not None:
            KeptLaunches.__call__ = launch_with
        try:
            out[name] = timeline(norm, x, weight, dy, marks, calls, warm)
        finally:
            KeptLaunches.__call__ = launch
            if function is not None:
                _restored(function)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16384x4096", help="ROWSxCOLS (default 16384x4096)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("rmsnorm_eager_probe needs a CUDA GPU", file=sys.stderr)
        return 3
    from torch.profiler import ProfilerActivity, profile

    from suite.arms.rmsnorm import rms_norm
    from suite.harness.timers import CudaTimer

    rows, cols = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = torch.ones(cols, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    norms = {"arm (impl=auto)": lambda: rms_norm(x, weight, 1e-6),
             "F.rms_norm": lambda: F.rms_norm(x, (cols,), weight, 1e-6)}
    timer = CudaTimer("cuda")
    figures, entry_calls = {}, {}
    for name, norm in norms.items():
        def step():
            return torch.autograd.grad(norm(), (x, weight), dy)

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        enqueue_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        for _ in range(50):
            step()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        mallocs = after.get("num_device_alloc", 0) - before.get("num_device_alloc", 0)
        retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
        entry = {"host_enqueue_us": enqueue_us, "cuda_mallocs_in_50_calls": mallocs, "alloc_retries": retries}
        for window in (5, 50):
            for flush in (False, True):
                ms = statistics.median(timer.time_calls(step, 11, flush_l2=flush, window=window))
                entry[f"eager_us_window{window}{'_flushed' if flush else ''}"] = ms * 1e3
        replay = timer.capture(step)
        entry["graph_us_flushed"] = statistics.median(timer.time_calls(replay, 21, flush_l2=True, window=1)) * 1e3
        del replay
        figures[name] = entry
    # second pass: a CUDA-graph capture after the profiler has run fails, so the captures come first
    for name, norm in norms.items():
        entry = figures[name]

        def step():
            return torch.autograd.grad(norm(), (x, weight), dy)

        for part, fn in (("forward only", norm), ("backward only", None)):
            if fn is None:  # autograd.grad over one forward kept alive
                out = norm()
                fn = lambda: torch.autograd.grad(out, (x, weight), dy, retain_graph=True)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            entry[f"host_enqueue_us_{part.replace(' ', '_')}"] = (time.perf_counter() - t0) / 20 * 1e6
            torch.cuda.synchronize()
        # the CUDA runtime and driver calls the host made in 20 calls: a synchronising one
        # (cudaStreamSynchronize, cudaEventSynchronize, cudaMalloc, ...) shows what blocks it
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        calls = {}
        for event in prof.key_averages():
            if event.key.startswith(("cuda", "cu")) and not event.key.startswith("cutlass"):
                calls[event.key] = [event.count, round(event.cpu_time_total / 20, 1)]
        entry_calls[name] = calls
        print(name, json.dumps(entry), json.dumps(calls), flush=True)
    keys = list(next(iter(figures.values())))
    for name, calls in entry_calls.items():
        print(f"{name}: runtime calls in 20 fwd+bwd [count, host us per fwd+bwd]: {calls}")
    small = [torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    timelines = {
        f"{rows}x{cols}": timeline_variants(x, weight, dy),
        "8x4096": timeline_variants(small[0].requires_grad_(), torch.ones(4096, device="cuda", dtype=torch.bfloat16,
                                                                          requires_grad=True), small[1]),
    }
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rmsnorm_eager_probe.json"), "w") as fh:
            json.dump({"shape": [rows, cols], "figures": figures, "runtime_calls": entry_calls,
                       "timeline_us": timelines}, fh, indent=1)
    print(f"{rows}x{cols} bf16 forward + autograd.grad, us per call")
    print(f"{'':36s}" + "".join(f"{name:>18s}" for name in figures))
    for key in keys:
        print(f"{key:36s}" + "".join(f"{figures[name][key]:18.1f}" for name in figures))
    for shape, variants in timelines.items():
        print(f"{shape}, one eager forward + autograd.grad: median us per interval")
        print(f"{'':68s}" + "".join(f"{name[:22]:>24s}" for name in variants))
        for label, _, _ in TIMELINE:
            cells = (variants[name][label] for name in variants)
            print(f"{label:68s}" + "".join(f"{'-' if c is None else f'{c:.1f}':>24s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
