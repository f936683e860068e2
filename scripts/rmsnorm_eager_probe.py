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
host made (torch.profiler). Prints one table; writes $OUT/rmsnorm_eager_probe.json when OUT is
set.
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16384x4096", help="ROWSxCOLS (default 16384x4096)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("rmsnorm_eager_probe needs a CUDA GPU", file=sys.stderr)
        return 3
    from torch.profiler import ProfilerActivity, profile

    from suite.arms.rmsnorm import rms_norm
    from suite.harness.timing import CudaTimer

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
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "rmsnorm_eager_probe.json"), "w") as fh:
            json.dump({"shape": [rows, cols], "figures": figures, "runtime_calls": entry_calls}, fh, indent=1)
    keys = list(next(iter(figures.values())))
    for name, calls in entry_calls.items():
        print(f"{name}: runtime calls in 20 fwd+bwd [count, host us per fwd+bwd]: {calls}")
    print(f"{rows}x{cols} bf16 forward + autograd.grad, us per call")
    print(f"{'':36s}" + "".join(f"{name:>18s}" for name in figures))
    for key in keys:
        print(f"{key:36s}" + "".join(f"{figures[name][key]:18.1f}" for name in figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
