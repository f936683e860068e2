"""Run ON THE GPU MACHINE with SonicMoE installed (scripts/device_check.sh python ...): SonicMoE's
forward and backward once at each named preset of gate moe-bwd, built as the bench builds it
(its parity check against the arm included), so that QuACK autotunes and compiles each shape's
GEMMs now and its cache (device_check.sh returns it) spares the benches that work. Prints the
seconds each preset took; once --budget seconds have gone, starts no further preset.

    python scripts/sonicmoe_warm.py --budget 480 host-probe qwen3-30b-a3b mixtral
"""

from __future__ import annotations

import argparse
import time

import torch

from gates.moe_bwd import BENCHES, GATE, build_sonicmoe, sonicmoe_missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="+", help="gate moe-bwd presets, cheapest first")
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds; after them no preset but the first starts")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    missing = sonicmoe_missing(device)
    if missing:
        raise SystemExit(missing)
    case = next(c for c in BENCHES if c.name == "fwd+bwd")
    started = time.perf_counter()
    for i, name in enumerate(args.presets):
        if i and time.perf_counter() - started > args.budget:
            print(f"{name}: not started, the budget of {args.budget:.0f} s is spent", flush=True)
            continue
        preset = GATE.preset(name)
        buffers = GATE.make_buffers(preset, 0, device)
        t0 = time.perf_counter()
        call = build_sonicmoe(case, buffers, preset)
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        print(f"{name}: SonicMoE built and ran in {time.perf_counter() - t0:.1f} s", flush=True)
        del call, buffers
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
