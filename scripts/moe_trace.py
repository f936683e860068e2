#!/usr/bin/env python3
"""Where a moe-bwd contender's eager call spends the time its graph replay does not: each
contender's call of the case, warmed up, run as the bench's eager timer runs it (an untimed
lead-in call, then timed calls) under torch.profiler, and, where the case is timed in graph
replays, the same call captured and replayed:

    python scripts/moe_trace.py --preset top2-small --case bwd
    python scripts/moe_trace.py --preset olmoe-4k --case block-compiled --contender arm --contender stock

Prints per contender and mode the device busy time a call, the call's span on the device, the
idle gaps inside it (largest first, with the kernel each gap held back) and the kernel count;
writes each chrome trace to $OUT (trace-<contender>-<mode>.json.gz) for a closer look.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from gates.moe_bwd import GATE
from suite.harness.timers import CudaTimer


def device_kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every kernel and memcpy/memset on the device, in start order."""
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(spans)


def summarize(spans, calls: int) -> dict:
    start, end = spans[0][0], max(s[1] for s in spans)
    busy, gaps, reach = 0.0, [], start
    for s, e, name in spans:
        if s > reach:
            gaps.append((s - reach, name))
        busy += max(0.0, e - max(s, reach))
        reach = max(reach, e)
    gaps.sort(reverse=True)
    return dict(span_ms=(end - start) / 1e3 / calls, busy_ms=busy / 1e3 / calls,
                idle_ms=sum(g for g, _ in gaps) / 1e3 / calls, kernels=len(spans) / calls, gaps=gaps[:6])


def run(name: str, mode: str, call, calls: int, out: str) -> dict:
    timer = CudaTimer(torch.device("cuda"))
    fn = timer.capture(call) if mode == "graph" else call
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    fn()  # the lead-in: the timed calls start behind a call of their own, as the bench's do
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = device_kernels(prof)
    # only the timed calls' kernels: the lead-in's still running at the profile's start are cut
    summary = summarize(spans, calls)
    path = os.path.join(out, f"trace-{re.sub(r'[^A-Za-z0-9]+', '_', name)}-{mode}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="top2-small")
    parser.add_argument("--case", default="bwd")
    parser.add_argument("--contender", action="append", help="default: the arm")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    out = os.environ.get("OUT", ".")
    preset = GATE.preset(args.preset)
    bench = next(c for c in GATE.benches if c.name == args.case)
    contenders = {c.name: c for c in GATE.contenders_for(bench, preset)}
    buffers = GATE.make_buffers(preset, 0, torch.device("cuda"))
    rows = []
    for name in args.contender or ["arm"]:
        call = contenders[name].build(bench, buffers, preset)
        modes = ("eager",) if args.case.startswith("block") else ("graph", "eager")
        for mode in modes:
            s = run(name, mode, call, args.calls, out)
            gaps = "; ".join(f"{g:.0f} us before {k[:40]}" for g, k in s["gaps"][:4])
            rows.append((name, mode, f"{s['span_ms']:.4f}", f"{s['busy_ms']:.4f}", f"{s['idle_ms']:.4f}",
                         f"{s['kernels']:.1f}", gaps))
    print(tabulate(rows, headers=("contender", "mode", "span ms/call", "busy ms/call", "idle ms/call", "kernels/call",
                                  "largest gaps")))


if __name__ == "__main__":
    main()
