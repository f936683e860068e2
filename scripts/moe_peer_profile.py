#!/usr/bin/env python3
"""Where the time of one MoE forward+backward goes, kernel by kernel, for the arm and the peers
it is measured against (the gate's own contenders, buffers and routing):

    python scripts/moe_peer_profile.py --preset mixtral --contender arm --contender "grouped_mm gate|up compiled"
    python scripts/moe_peer_profile.py --case block --preset mixtral-4k   (the block a user runs: suite and stock)

On the GPU machine: `bash scripts/device_check.sh python scripts/moe_peer_profile.py --preset olmoe`.
Each contender's call of the case (default fwd+bwd) is warmed up, then run --calls times under torch.profiler; the
table gives each contender's device time per call split by kernel (the largest first, grouped by
kernel name), so a loss to a peer can be traced to the GEMM that holds it. Writes
$OUT/moe_peer_profile.json (or --json) too.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from gates.moe_bwd import GATE
from suite.errors import UsageError

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


def main(argv: list[str] | None = None, device: torch.device | None = None) -> None:
    args = parse_args(argv)
    device = device or torch.device("cuda")
    bench = next(c for c in GATE.benches if c.name == args.case)
    figures = {}
    for preset_name, names in args.names.items():
        preset = GATE.preset(preset_name)
        contenders = {c.name: c for c in GATE.contenders_for(bench, preset)}
        buffers = GATE.make_buffers(preset, 0, device)
        for name in names:
            missing = contenders[name].unavailable(device)
            if missing:
                print(f"\n{preset_name} / {name}: unavailable ({missing})")
                continue
            times = kernel_times(contenders[name].build(bench, buffers, preset), args.calls)
            figures[f"{preset_name}/{name}"] = times
            rows = [(k[:90], f"{ms:.4f}", f"{100 * ms / sum(times.values()):.1f}%") for k, ms in list(times.items())[:args.top]]
            print(f"\n{preset_name} / {name}: {sum(times.values()):.4f} ms of kernels a call, {len(times)} kernel names")
            print(tabulate(rows, headers=("kernel", "ms/call", "share")))
        del buffers
    path = args.json or os.path.join(os.environ.get("OUT", "."), "moe_peer_profile.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
