#!/usr/bin/env python3
"""Where the time of one MoE forward+backward goes, kernel by kernel, for the arm and the peers
it is measured against (the gate's own contenders, buffers and routing):

    python scripts/moe_peer_profile.py --preset mixtral --contender arm --contender "grouped_mm gate|up compiled"
    python scripts/moe_peer_profile.py --case block --preset mixtral-4k   (the block a user runs: suite and stock)
    python scripts/moe_peer_profile.py --timeline --case bwd --preset top2-small --contender arm

On the GPU machine: `bash scripts/device_check.sh python scripts/moe_peer_profile.py --preset olmoe`.
Each contender's call of the case (default fwd+bwd) is warmed up, then run --calls times under torch.profiler; the
table gives each contender's device time per call split by kernel (the largest first, grouped by
kernel name), so a loss to a peer can be traced to the GEMM that holds it. Writes
$OUT/moe_peer_profile.json (or --json) too.

--timeline: where an eager call spends the time its graph replay does not. Each contender's
call runs as the bench's eager timer runs it (behind an untimed lead-in call) and, in the
case's graph mode, captured and replayed; printed a call: the span on the device, its busy
time, the idle gaps (the largest with the kernel each held back), the kernel count and the
CUDA runtime calls that can stall (syncs, copies, allocations); each chrome trace goes to $OUT,
named by case, preset and contender. A case the bench builds and times on a stream of its own
(BenchCase.own_stream: the bwd case) is built and run on one here too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
from collections import defaultdict

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from gates.moe_bwd import GATE
from suite.errors import UsageError
from suite.harness.runner import case_stream
from suite.harness.timers import CudaTimer

DEFAULT_CONTENDERS = ("arm", "sonicmoe", "grouped_mm gate|up compiled")


def kernel_times(call, calls: int) -> dict[str, float]:
    """ms per call of each kernel name, over `calls` calls after two untimed ones."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / 1000 / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


# runtime calls that can hold the host or the device's queue back
STALLS = ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaStreamWaitEvent")


def gaps_of(spans: list[tuple[float, float, str]]) -> tuple[float, float, float, list[tuple[float, str]]]:
    """(span, busy, idle, gaps largest first as (us, kernel held back)) of device spans (start us,
    end us, name), overlapping spans counted once."""
    spans = sorted(spans)
    reach, busy, gaps = spans[0][0], 0.0, []
    for start, end, name in spans:
        if start > reach:
            gaps.append((start - reach, name))
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return reach - spans[0][0], busy, sum(g for g, _ in gaps), sorted(gaps, reverse=True)


def timeline(call, calls: int, mode: str, trace_path: str) -> dict:
    """One contender's calls in `mode` (graph: replays of a capture; eager: plain calls, the
    first behind an untimed lead-in as the bench's are) under the profiler: ms a call of span,
    busy and idle, kernels a call, the largest gaps and the stalling runtime calls a call."""
    fn = CudaTimer(torch.device("cuda")).capture(call) if mode == "graph" else call
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.events()
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in events
             if e.device_type == torch.autograd.DeviceType.CUDA]
    span, busy, idle, gaps = gaps_of(spans)
    stalls: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and any(s in e.name for s in STALLS):
            stalls[e.name] += 1 / calls
    prof.export_chrome_trace(trace_path)
    with open(trace_path, "rb") as src, gzip.open(trace_path + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(trace_path)
    return dict(span_ms=span / 1e3 / calls, busy_ms=busy / 1e3 / calls, idle_ms=idle / 1e3 / calls,
                kernels=len(spans) / calls, gaps=gaps[:4], stalls=dict(stalls))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, each preset checked to time the case and each contender to be timed in it
    (before any GPU work); args.names holds each preset's contenders."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="moe-bwd preset (repeatable; default olmoe)")
    parser.add_argument("--case", default="fwd+bwd", choices=[case.name for case in GATE.benches],
                        help="the bench case profiled (default fwd+bwd)")
    parser.add_argument("--contender", action="append",
                        help=f"contender (repeatable; default {DEFAULT_CONTENDERS} for fwd+bwd, else the case's own)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per contender")
    parser.add_argument("--json", default=None)
    parser.add_argument("--timeline", action="store_true",
                        help="eager calls against graph replays: gaps, stalls and chrome traces (see above)")
    args = parser.parse_args(argv)
    bench = next(c for c in GATE.benches if c.name == args.case)
    args.names = {}
    for preset_name in args.preset or ["olmoe"]:
        try:
            preset = GATE.preset(preset_name)
        except UsageError as error:
            parser.error(str(error))
        if bench.presets is not None and preset_name not in bench.presets:
            parser.error(f"case {args.case} is timed at {list(bench.presets)}, not at {preset_name}")
        contenders = [c.name for c in GATE.contenders_for(bench, preset)]
        names = args.contender or (DEFAULT_CONTENDERS if args.case == "fwd+bwd" else contenders)
        unknown = [name for name in names if name not in contenders]
        if unknown:
            parser.error(f"{unknown} not timed in case {args.case} at {preset_name}; its contenders: {contenders}")
        args.names[preset_name] = names
    return args


def timelines(call, bench, label: str, calls: int) -> dict:
    """`timeline` of the call in each mode its case is timed in, printed; traces to $OUT."""
    found = {}
    for mode in bench.modes:
        trace = os.path.join(os.environ.get("OUT", "."), f"trace-{re.sub(r'[^A-Za-z0-9]+', '_', label)}-{mode}.json")
        found[mode] = t = timeline(call, calls, mode, trace)
        print(f"\n{label} ({mode}): span {t['span_ms']:.4f} ms a call, busy {t['busy_ms']:.4f}, "
              f"idle {t['idle_ms']:.4f}, {t['kernels']:.1f} kernels")
        print("  largest gaps: " + ("; ".join(f"{g:.0f} us before {k[:60]}" for g, k in t["gaps"]) or "none"))
        print("  stalling runtime calls a call: "
              + (", ".join(f"{k} {n:g}" for k, n in sorted(t["stalls"].items())) or "none"))
    return found


def main(argv: list[str] | None = None, device: torch.device | None = None) -> None:
    args = parse_args(argv)
    device = device or torch.device("cuda")
    bench = next(c for c in GATE.benches if c.name == args.case)
    figures = {}
    with case_stream(bench, device):  # as the bench runs the case
        for preset_name, names in args.names.items():
            figures.update(profile_preset(args, bench, preset_name, names, device))
    path = args.json or os.path.join(os.environ.get("OUT", "."), "moe_peer_profile.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(figures, fh, indent=1)


def profile_preset(args, bench, preset_name: str, names: list[str], device: torch.device) -> dict:
    """Each named contender of the preset profiled (or its timelines), printed; -> its figures,
    keyed "case preset/contender"."""
    figures = {}
    preset = GATE.preset(preset_name)
    contenders = {c.name: c for c in GATE.contenders_for(bench, preset)}
    buffers = GATE.make_buffers(preset, 0, device)
    for name in names:
        label = f"{bench.name} {preset_name}/{name}"
        missing = contenders[name].unavailable(device)
        if missing:
            print(f"\n{label}: unavailable ({missing})")
            continue
        call = contenders[name].build(bench, buffers, preset)
        if args.timeline:
            figures[label] = timelines(call, bench, label, args.calls)
            continue
        times = kernel_times(call, args.calls)
        figures[label] = times
        rows = [(k[:90], f"{ms:.4f}", f"{100 * ms / sum(times.values()):.1f}%") for k, ms in list(times.items())[:args.top]]
        print(f"\n{label}: {sum(times.values()):.4f} ms of kernels a call, {len(times)} kernel names")
        print(tabulate(rows, headers=("kernel", "ms/call", "share")))
    return figures


if __name__ == "__main__":
    main()
