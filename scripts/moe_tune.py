#!/usr/bin/env python3
"""Where the fused MoE experts' time goes on a GPU, and which tiles would take less.

    python scripts/moe_tune.py --preset olmoe --preset mixtral [--sweep] [--profile rtx]

On the GPU machine: `bash scripts/device_check.sh python scripts/moe_tune.py --preset olmoe`.
A full --sweep compiles about 130 kernel variants a preset (minutes): one preset a call, or
--kernel to sweep some.
For each moe-bwd preset (the gate's own buffers and routing, bf16), every GEMM kernel of one
forward and backward and the combine backward is timed alone as CUDA-graph replays with the L2 flushed (device time), at the
config the arm picks: the table says which kernels hold the step's time and at what fraction of
the bf16 GEMM or copy ceiling (measured here), the combine backward beside a plain copy of its
bytes. With --sweep each GEMM kernel is also timed at a
fixed list of alternative tiles, and the combine backward at alternative tile shapes, each
checked against the default's outputs (a different reduction step changes fp32 rounding only).
Other entries time a kernel's work other ways (EXPERIMENTS, outside the sums): the gate/up weight
gradient as two one-output launches, and on x rows already in sorted order (what the gather in
its loop costs); the row GEMMs (up, d_a, down, dx) on the pointer-fed kernels, where the arm
feeds them through TMA descriptors (`tma_gemms`); the TMA ones in Triton's warp-specialized
loop; and each GEMM as torch._grouped_mm (CUTLASS on sm90/sm100) does it,
gathering x by token first where the kernel gathers in its loop; each checked against the
kernel's outputs.
Configs are held to the profile's shared memory (--profile rtx: the RTX card's 99 KB). Writes
everything to $OUT/moe_tune.json (or --json) and prints one table per preset last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from typing import Any, Callable

# (block_m, block_n, block_k, num_stages, num_warps, group_m); block_n is per B tile (two-
# accumulator kernels hold two of them); group_m > 0 walks the tiles in groups of that many row
# tiles (L2 reuse of the A rows). The arm's own config is also timed with group_m 8 and 16.
GEMM_CANDIDATES = (
    (128, 128, 64, 3, 8, 0), (128, 128, 64, 4, 8, 0), (128, 128, 64, 4, 8, 16), (128, 64, 64, 4, 4, 0),
    (128, 64, 64, 4, 8, 0), (128, 64, 64, 4, 8, 8), (128, 128, 32, 4, 8, 0),
    # vLLM's tuned fused_moe tile on the H200 for E=8,N=14336, E=128,N=768 and E=64,N=1280/640
    # (BLOCK_SIZE_M/N/K 128/256/64, GROUP_SIZE_M 16, 8 warps, 4 stages; one accumulator)
    (128, 256, 64, 3, 8, 0), (128, 256, 64, 4, 8, 16),
    (64, 128, 64, 4, 4, 0), (64, 256, 64, 3, 8, 0),
    # taller tiles and finer row steps, for the weight gradients (a short K loop of token rows)
    (256, 64, 64, 3, 8, 16), (256, 64, 32, 4, 8, 16), (128, 64, 32, 6, 8, 16), (128, 128, 32, 4, 8, 16),
    # within the RTX card's 99 KB
    (128, 64, 32, 3, 8, 0), (64, 128, 32, 3, 4, 0), (64, 128, 32, 3, 4, 16), (64, 64, 64, 2, 4, 0),
)
# (block_t, block_d, num_warps)
COMBINE_CANDIDATES = tuple((t, bd, w) for t in (1, 2, 4, 8, 16, 32) for bd in (128, 256, 512, 1024) for w in (4, 8))
# the arm's GEMM kernels of one layer: name, operand tiles (n_a, n_b) a step, FLOPs per
# (row, d, f); they add up to the layer's 18 T k d f
KERNELS = (
    ("expert_up", (1, 2), 4),
    ("expert_down", (1, 1), 2),
    ("swiglu_backward", (1, 1), 2),  # d_a's GEMM, then the elementwise pass
    ("dw_down", (1, 1), 2),
    ("dx_rows", (1, 1), 4),
    ("dw_gate_up", (1, 2), 4),
    ("dw_gate_up_separate", (1, 1), 4),
    ("dw_gate_up_presorted", (1, 2), 4),
    # the row GEMMs with every operand through pointers (the arm's TMA-fed ones where `tma_gemms` holds)
    ("expert_up_pointers", (1, 2), 4),
    ("expert_down_pointers", (1, 1), 2),
    ("swiglu_backward_pointers", (1, 1), 2),
    ("dx_rows_pointers", (1, 1), 4),
    # the TMA row GEMMs with Triton's warp-specialized loop
    ("expert_up_ws", (1, 2), 4),
    ("expert_down_ws", (1, 1), 2),
    ("dx_rows_ws", (1, 1), 4),
    # torch._grouped_mm's take on each (no tile of ours: operands None)
    ("expert_up_grouped_mm", None, 4),
    ("expert_down_grouped_mm", None, 2),
    ("swiglu_backward_grouped_mm", None, 2),
    ("dw_down_grouped_mm", None, 2),
    ("dx_rows_grouped_mm", None, 4),
    ("dw_gate_up_grouped_mm", None, 4),
)
# experiments timed beside the arm's kernels, never in the layer's sums: the gate/up weight
# gradient as two one-output launches, and on x rows sorted before the timed call (what the
# gather in its loop costs; the sort itself is not timed); the row GEMMs on the pointer
# kernels, at the arm's tiles (swept with them); and the GEMMs as torch._grouped_mm
EXPERIMENTS = ("dw_gate_up_separate", "dw_gate_up_presorted", "expert_up_pointers", "expert_down_pointers",
               "swiglu_backward_pointers", "dx_rows_pointers", "expert_up_ws", "expert_down_ws", "dx_rows_ws") + tuple(
                   name for name, operands, _ in KERNELS if operands is None)
# the kernel whose outputs an experiment's are checked against
SAME_AS = {"dw_gate_up_separate": "dw_gate_up", "dw_gate_up_presorted": "dw_gate_up"} | {
    name: name.removesuffix("_grouped_mm").removesuffix("_pointers") for name in EXPERIMENTS
    if name.endswith(("_grouped_mm", "_pointers"))} | {
    name: name.removesuffix("_ws") for name in EXPERIMENTS if name.endswith("_ws")}


KERNEL_NAMES = [name for name, _, _ in KERNELS] + ["combine_backward"]


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"needs a whole number >= 1, not {text!r}")
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="moe-bwd preset (repeatable; default olmoe)")
    parser.add_argument("--sweep", action="store_true", help="also time the alternative tiles")
    parser.add_argument("--kernel", action="append", choices=KERNEL_NAMES,
                        help="only these kernels (repeatable; default all)")
    parser.add_argument("--profile", default=None, choices=("auto", "rtx", "none"),
                        help="default: SUITE_PROFILE, else auto")
    parser.add_argument("--layout", default="stored", choices=("stored", "out_in"),
                        help="the weights as MoEExperts stores them, or as transposed views of [E, out, in] storage "
                             "(a transformers model's experts)")
    parser.add_argument("--tma", default="rule", choices=("rule", "always"),
                        help="the arm's row GEMMs through TMA descriptors where its size rule (`tma_gemms`) says, or "
                             "at any size (to measure a layer the rule leaves on the pointer kernels; sm90)")
    parser.add_argument("--replays", type=_positive, default=20, help="graph replays per figure; the median is kept")
    parser.add_argument("--json", default=None, help="where to write the figures (default $OUT/moe_tune.json; a relative path goes under $OUT when set)")
    return parser.parse_args(argv)


def gemm_candidates(n_a: int, n_b: int, itemsize: int, limit: int) -> list[Any]:
    """The sweep's configs for a kernel with n_a A tiles and n_b B tiles a step, within `limit`
    bytes of shared memory (their estimate, scratch included) and one 128x256 fp32 tile of
    accumulators (more spills registers)."""
    from suite.arms.moe.config import GemmConfig

    configs = []
    for block_m, block_n, block_k, stages, warps, group_m in GEMM_CANDIDATES:
        config = GemmConfig(block_m, block_n, block_k, warps, stages, n_a, n_b, itemsize, group_m)
        if config.smem_bytes <= limit and block_m * block_n * n_b <= 128 * 256:
            configs.append(config)
    return configs


def layer_flops(kernel_flops: int, rows: int, d: int, f: int) -> int:
    return kernel_flops * rows * d * f


@contextlib.contextmanager
def gemm_config(config):
    """Every grouped GEMM launched inside takes `config`, its operand counts kept."""
    from suite.arms.moe import config as moe_config

    def forced(kind, *args):
        (n_a, n_b), _ = moe_config.GEMM_KINDS[kind]
        return dataclasses.replace(config, n_a=n_a, n_b=n_b)

    with moe_config.forced(gemm=forced):
        yield


@contextlib.contextmanager
def combine_config(config):
    from suite.arms.moe import config as moe_config

    with moe_config.forced(combine=lambda n_tokens, d, device: config):
        yield


def recorded_gemm_configs(fn: Callable[[], Any]) -> list[Any]:
    """The configs the arm picks for fn's GEMM launches."""
    from suite.arms.moe import config as moe_config

    seen = []

    def record(*args):
        seen.append(moe_config.choose_gemm_config(*args))
        return seen[-1]

    with moe_config.forced(gemm=record):
        fn()
    return seen


def build(preset_name: str, device, layout: str = "stored"):
    """-> (params, routing, kernels, outputs): kernels maps a name to a call writing into
    preallocated outputs (so a capture allocates nothing; torch._grouped_mm's returns its own,
    from the capture's pool), the layer's tensors made once. layout "out_in": the weights as
    transposed views of [E, out, in] storage, as a transformers model's experts hand them over."""
    import torch

    import gates
    from suite.arms.moe import launch as mk
    from suite.arms.moe import route

    gate = gates.get("moe-bwd")
    preset = gate.preset(preset_name)
    p = preset.params
    buffers = gate.make_buffers(preset, 0, device)
    routing = route(buffers["logits"], p["top_k"], capacity_factor=p["capacity_factor"])
    x, wg, wu, wd, grad_out = (buffers[n] for n in ("x", "w_gate", "w_up", "w_down", "grad_out"))
    if layout == "out_in":
        wg, wu, wd = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (wg, wu, wd))
    tor, offsets, row_map, probs = routing.token_of_row, routing.offsets, routing.row_id_map, routing.probs.detach()
    a, g, u = mk.expert_up(x, wg, wu, tor, offsets)
    y = mk.expert_down(a, wd, offsets)
    grad_rows, grad_probs = mk.combine_backward(grad_out, y, probs, row_map)
    # caller-owned outputs keep the entry points on our kernels (without them a layer the
    # grouped_mm rules take would leave grouped_mm's outputs as the kernels' references)
    dw_down, dw_gate, dw_up = (torch.empty(w.shape, dtype=w.dtype, device=device) for w in (wd, wg, wu))
    dg, du, dw_down = mk.expert_down_backward(grad_rows, a, g, u, wd, offsets, dw_down_out=dw_down)
    dx_rows, dw_gate, dw_up = mk.expert_up_backward(dg, du, x, wg, wu, tor, offsets, dx_rows_out=torch.empty_like(y),
                                                    dw_gate_out=dw_gate, dw_up_out=dw_up)
    sources = tor.long().clamp(min=0)  # rows past R hold token 0's: never read
    x_sorted = x[sources]
    x_gathered = torch.empty_like(x_sorted)
    ends = offsets[1:]
    wd_t = wd.transpose(1, 2)
    dg_other, du_other = torch.empty_like(dg), torch.empty_like(du)
    a_ptr, g_ptr, u_ptr, y_ptr, dg_ptr, du_ptr, dx_ptr = (torch.empty_like(t) for t in (a, g, u, y, dg, du, dx_rows))
    a_ws, g_ws, u_ws, y_ws, dx_ws = (torch.empty_like(t) for t in (a, g, u, y, dx_rows))
    n_rows, n_experts, d, f, dtype = tor.shape[0], wg.shape[0], x.shape[1], wg.shape[2], x.dtype

    def pointers(kind, two, w_strides, w2_strides=None, **through):  # a rows GEMM's launch on the pointer kernel
        n_k, n_n = (d, f) if kind == "swiglu_grad" else (f, d)
        return mk.rows_launch(kind, n_rows, n_k, n_n, n_experts, w_strides, w2_strides or w_strides, two, dtype,
                               device, **(through or {"tma": False}))

    made = {}  # torch._grouped_mm returns new tensors: the experiments leave theirs here

    def grouped(name, *tensors):
        made[name] = tensors

    def up_grouped_mm():
        torch.index_select(x, 0, sources, out=x_gathered)
        g_, u_ = torch._grouped_mm(x_gathered, wg, offs=ends), torch._grouped_mm(x_gathered, wu, offs=ends)
        grouped("expert_up_grouped_mm", torch.nn.functional.silu(g_.float()).mul_(u_.float()).to(g_.dtype), g_, u_)

    def swiglu_backward_grouped_mm():
        d_a = torch._grouped_mm(grad_rows, wd_t, offs=ends)
        mk.swiglu_backward(d_a, g, u, offsets, dg_other, du_other)

    def dw_gate_up_grouped_mm():
        torch.index_select(x, 0, sources, out=x_gathered)
        grouped("dw_gate_up_grouped_mm", *mk.vendor_dw_gate_up(x_gathered, dg, du, offsets))

    s_e, s_f, s_d = wd.stride()
    g_e, g_d, g_f = wg.stride()
    u_e, u_d, u_f = wu.stride()
    kernels = {
        "expert_up": lambda: mk.expert_up(x, wg, wu, tor, offsets, out=a, gate_out=g, up_out=u),
        "expert_down": lambda: mk.expert_down(a, wd, offsets, out=y),
        "dw_down": lambda: mk.weight_grad(a, None, grad_rows, offsets, dw_down),
        "swiglu_backward": lambda: (
            mk.grouped_rows("swiglu_grad", grad_rows, wd, (s_e, s_d, s_f), offsets, du),
            mk.swiglu_backward(du, g, u, offsets, dg, du)),
        "dx_rows": lambda: mk.grouped_rows("dx", dg, wg, (g_e, g_f, g_d), offsets, dx_rows, a2=du, w2=wu,
                                            w2_strides=(u_e, u_f, u_d)),
        "dw_gate_up": lambda: mk.weight_grad(x, tor, dg, offsets, dw_gate, grad2=du, dw2=dw_up),
        # the gate and up weight gradients as two one-output launches at the dW_down kind's tile
        "dw_gate_up_separate": lambda: (mk.weight_grad(x, tor, dg, offsets, dw_gate),
                                        mk.weight_grad(x, tor, du, offsets, dw_up)),
        # the same kernel reading x's rows already in the sorted order (no gather in its loop)
        "dw_gate_up_presorted": lambda: mk.weight_grad(x_sorted, None, dg, offsets, dw_gate, grad2=du, dw2=dw_up),
        "combine_backward": lambda: mk.combine_backward(grad_out, y, probs, row_map, grad_rows_out=grad_rows,
                                                        grad_probs_out=grad_probs),
        "expert_up_grouped_mm": up_grouped_mm,
        "expert_down_grouped_mm": lambda: grouped("expert_down_grouped_mm", torch._grouped_mm(a, wd, offs=ends)),
        "swiglu_backward_grouped_mm": swiglu_backward_grouped_mm,
        "dw_down_grouped_mm": lambda: grouped("dw_down_grouped_mm", torch._grouped_mm(a.t(), grad_rows, offs=ends)),
        # two products, each rounded, the second added into the first (as the eager reference rounds)
        "dx_rows_grouped_mm": lambda: grouped("dx_rows_grouped_mm", torch._grouped_mm(dg, wg.transpose(1, 2), offs=ends)
                                              .add_(torch._grouped_mm(du, wu.transpose(1, 2), offs=ends))),
        "dw_gate_up_grouped_mm": dw_gate_up_grouped_mm,
        "expert_up_pointers": lambda: mk.up_launch(n_rows, n_experts, d, f, x.stride(0), wg.stride(), wu.stride(),
                                                    dtype, device, tma=False)(x, wg, wu, tor, offsets, a_ptr, g_ptr,
                                                                              u_ptr),
        "expert_down_pointers": lambda: pointers("rows", False, wd.stride())(a, a, wd, wd, offsets, y_ptr),
        "swiglu_backward_pointers": lambda: (
            pointers("swiglu_grad", False, (s_e, s_d, s_f))(grad_rows, grad_rows, wd, wd, offsets, du_ptr),
            mk.swiglu_backward(du_ptr, g, u, offsets, dg_ptr, du_ptr)),
        "dx_rows_pointers": lambda: pointers("dx", True, (g_e, g_f, g_d), (u_e, u_f, u_d))(dg, du, wg, wu, offsets,
                                                                                            dx_ptr),
        "expert_up_ws": lambda: mk.up_launch(n_rows, n_experts, d, f, x.stride(0), wg.stride(), wu.stride(), dtype,
                                              device, warp_specialize=True)(x, wg, wu, tor, offsets, a_ws, g_ws, u_ws),
        "expert_down_ws": lambda: pointers("rows", False, wd.stride(), warp_specialize=True)(a, a, wd, wd, offsets,
                                                                                              y_ws),
        "dx_rows_ws": lambda: pointers("dx", True, (g_e, g_f, g_d), (u_e, u_f, u_d), warp_specialize=True)(
            dg, du, wg, wu, offsets, dx_ws),
    }
    outputs = {"expert_up": (a, g, u), "expert_down": (y,), "swiglu_backward": (dg, du), "dw_down": (dw_down,),
               "dx_rows": (dx_rows,), "dw_gate_up": (dw_gate, dw_up), "dw_gate_up_separate": (dw_gate, dw_up), "dw_gate_up_presorted": (dw_gate, dw_up), "combine_backward": (grad_rows, grad_probs),
               "swiglu_backward_grouped_mm": (dg_other, du_other), "expert_up_pointers": (a_ptr, g_ptr, u_ptr),
               "expert_down_pointers": (y_ptr,), "swiglu_backward_pointers": (dg_ptr, du_ptr),
               "dx_rows_pointers": (dx_ptr,), "expert_up_ws": (a_ws, g_ws, u_ws), "expert_down_ws": (y_ws,),
               "dx_rows_ws": (dx_ws,)}
    for name in EXPERIMENTS:
        outputs.setdefault(name, lambda name=name: made[name])
    return p, routing, kernels, outputs


def _made(outputs) -> tuple:
    """An entry's output tensors: kept ones, or (an experiment's) a call that returns them."""
    return outputs() if callable(outputs) else outputs


def rel_diff(got, want) -> float:
    """Largest |got - want| over the largest |want|; inf where either holds a NaN or an Inf (a
    config that wrote garbage, or left rows the default wrote unwritten)."""
    worst = 0.0
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        if not (bool(g.isfinite().all()) and bool(w.isfinite().all())):
            return float("inf")
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((g - w).abs().max()) / scale)
    return worst


def time_kernel(timer, fn: Callable[[], Any], replays: int) -> float:
    replay = timer.capture(fn)
    return statistics.median(timer.time_calls(replay, replays, flush_l2=True, window=1))


@contextlib.contextmanager
def tma_rule(mode: str):
    """mode "always": the arm's row GEMMs through TMA descriptors whatever the layer's size."""
    from suite.arms.moe import config as moe_config

    with moe_config.forced(tma=True) if mode == "always" else contextlib.nullcontext():
        yield


def tune_preset(name: str, args, timer, ceilings, device, kernel_done=lambda figures: None) -> dict[str, Any]:
    """Every chosen kernel of preset `name` timed; kernel_done(figures so far) after each (a
    sweep cut short by a time limit still leaves what it measured)."""
    with tma_rule(args.tma):
        return _tune_preset(name, args, timer, ceilings, device, kernel_done)


def _tune_preset(name: str, args, timer, ceilings, device, kernel_done) -> dict[str, Any]:
    import torch

    from suite.arms.moe import config as moe_config
    from suite.device_profile import smem_limit

    p, routing, kernels, outputs = build(name, device, args.layout)
    rows = routing.max_rows
    d, f, tokens, k = p["hidden"], p["ffn"], p["tokens"], p["top_k"]
    limit = smem_limit(device)
    figures: dict[str, Any] = {"preset": name, "params": dict(p), "layout": args.layout, "tma": args.tma,
                               "smem_limit": limit, "kernels": []}
    chosen = set(args.kernel or KERNEL_NAMES)
    # a row output is compared over the kept rows alone: those past them are nobody's (a
    # grouped_mm output leaves them as its pool had them)
    kept = int(routing.offsets[-1])

    def kept_rows(tensors):
        return [t[:kept] if t.dim() == 2 and t.shape[0] == rows else t for t in tensors]

    references: dict[str, list] = {}  # each kernel's outputs at its default, for the experiments
    for kernel, operands, per_rdf in KERNELS:
        if kernel not in chosen:
            continue
        fn = kernels[kernel]
        flops = layer_flops(per_rdf, rows, d, f)
        base = SAME_AS.get(kernel, kernel)  # build ran the layer once: its buffers hold the defaults' outputs
        reference = references.get(base) or [t.clone() for t in kept_rows(_made(outputs[base]))]
        if kernel not in EXPERIMENTS:
            references[kernel] = reference
        if operands is None:  # torch._grouped_mm: no tile of ours to pick or sweep
            default = None
            entry = {"kernel": kernel, "flops": flops, "default": None, "timings": []}
            candidates = [None]
        else:
            default = recorded_gemm_configs(fn)[0]
            entry = {"kernel": kernel, "flops": flops, "default": default.__dict__, "timings": []}
            candidates = [default]
        if args.sweep and default is not None:
            candidates += [dataclasses.replace(default, group_m=g) for g in (8, 16)]
            candidates += gemm_candidates(*operands, default.itemsize, limit)
            candidates = list(dict.fromkeys(candidates))  # a default that is already grouped, once
        for config in candidates:
            described = config.__dict__ if config else None
            try:
                with gemm_config(config) if config else contextlib.nullcontext():
                    ms = time_kernel(timer, fn, args.replays)  # the replays leave its outputs
                diff = rel_diff(kept_rows(_made(outputs[kernel])), reference)
            except Exception as exc:  # a config that fails to compile or launch is reported
                entry["timings"].append({"config": described, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            entry["timings"].append({"config": described, "ms": ms, "tflops": flops / ms / 1e9,
                                     "of_gemm": flops / ms / 1e9 / ceilings.gemm_bf16_tflops, "rel_diff": diff})
        fn()  # the default's outputs again: the next kernels read them
        figures["kernels"].append(entry)
        kernel_done(figures)

    if "combine_backward" not in chosen:
        return figures
    item = outputs["combine_backward"][0].element_size()
    nbytes = item * (tokens * d + 2 * tokens * k * d) + 12 * tokens * k
    fn, reference = kernels["combine_backward"], [t.clone() for t in outputs["combine_backward"]]
    default = moe_config.combine_config(tokens, d, device)
    entry = {"kernel": "combine_backward", "bytes": nbytes, "default": default.__dict__, "timings": []}
    candidates = [default] + ([moe_config.CombineConfig(*c) for c in COMBINE_CANDIDATES] if args.sweep else [])
    for config in candidates:
        try:
            with combine_config(config):
                ms = time_kernel(timer, fn, args.replays)
            diff = rel_diff(outputs["combine_backward"], reference)
        except Exception as exc:
            entry["timings"].append({"config": config.__dict__, "error": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        entry["timings"].append({"config": config.__dict__, "ms": ms, "gbps": nbytes / ms / 1e6,
                                 "of_copy": nbytes / ms / 1e6 / ceilings.copy_gbps, "rel_diff": diff})
    # the same bytes moved by a plain copy, timed the same way: what a transfer of this size
    # reaches at all (the ceiling's copy moves about 2 GB)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = time_kernel(timer, lambda: dst.copy_(src), args.replays)
    entry["same_bytes_copy"] = {"ms": copy_ms, "gbps": nbytes / copy_ms / 1e6,
                                "of_copy": nbytes / copy_ms / 1e6 / ceilings.copy_gbps}
    figures["kernels"].append(entry)
    kernel_done(figures)
    return figures


def _config_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "torch._grouped_mm"
    if "block_t" in c:
        return f"{c['block_t']}x{c['block_d']} w{c['num_warps']}"
    return (f"{c['block_m']}x{c['block_n']}x{c['block_k']} s{c['num_stages']} w{c['num_warps']}"
            + (f" g{c['group_m']}" if c.get("group_m") else ""))


def print_table(figures: dict[str, Any]) -> None:
    print(f"\n{figures['preset']} {figures['params']}, weights {figures['layout']}, TMA {figures['tma']} "
          f"(smem limit {figures['smem_limit']} B)")
    print(f"{'kernel':26s} {'config':24s} {'ms':>9s} {'rate':>14s} {'of ceiling':>10s} {'rel diff':>9s}")
    defaults, bests = {}, {}
    for entry in figures["kernels"]:
        timed = [t for t in entry["timings"] if "ms" in t]
        if not timed:
            print(f"{entry['kernel']:26s} every config failed: {entry['timings'][0].get('error')}")
            continue
        if entry["kernel"] not in EXPERIMENTS:
            defaults[entry["kernel"]] = timed[0]["ms"]
            bests[entry["kernel"]] = min(t["ms"] for t in timed)
        for i, t in enumerate(sorted(timed, key=lambda t: t["ms"])[:4] if len(timed) > 1 else timed):
            rate = f"{t['tflops']:.0f} TFLOP/s" if "tflops" in t else f"{t['gbps']:.0f} GB/s"
            share = t.get("of_gemm", t.get("of_copy"))
            mark = " (default)" if entry["default"] and t["config"] == entry["default"] else ""
            print(f"{entry['kernel'] if i == 0 else '':26s} {_config_text(t['config']) + mark:24s} {t['ms']:9.4f} "
                  f"{rate:>14s} {100 * share:9.1f}% {t['rel_diff']:9.1e}")
        for t in entry["timings"]:
            if "error" in t:
                print(f"{'':26s} {_config_text(t['config']):24s} failed: {t['error']}")
    for entry in figures["kernels"]:
        if "same_bytes_copy" in entry:
            copy = entry["same_bytes_copy"]
            print(f"{'  a copy of its bytes':50s} {copy['ms']:9.4f} {copy['gbps']:9.0f} GB/s {100 * copy['of_copy']:9.1f}%")
    print(f"{'sum of kernels':26s} {'default':24s} {sum(defaults.values()):9.4f}\n"
          f"{'':26s} {'best of each':24s} {sum(bests.values()):9.4f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile:
        os.environ["SUITE_PROFILE"] = args.profile
    import torch

    import gates
    from suite.errors import UsageError

    try:
        for name in args.preset or ["olmoe"]:
            gates.get("moe-bwd").preset(name)
    except UsageError as exc:  # a typo is named on any machine, before a GPU is looked for
        print(f"moe_tune: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("moe_tune needs a CUDA GPU", file=sys.stderr)
        return 3
    major, minor = torch.cuda.get_device_capability()
    if args.tma == "always" and major < 9:  # no TMA before Hopper: the descriptor kernels would not compile
        print(f"moe_tune: --tma always needs a card with TMA (sm90 or newer), not sm_{major}{minor}; "
              "leave it at --tma rule here", file=sys.stderr)
        return 2
    from suite.harness.timers import CudaTimer
    from suite.harness.timing import measure_ceilings

    device = torch.device("cuda")
    timer = CudaTimer(device)
    ceilings = measure_ceilings(device)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "profile": os.environ.get("SUITE_PROFILE", "auto"), "ceilings": ceilings.model_dump(),
               "presets": []}
    path = args.json or ("moe_tune.json" if os.environ.get("OUT") else None)
    if path and os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], path)  # an absolute path stays itself
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def save(figures: dict[str, Any]) -> None:
        entry = figures["kernels"][-1]
        timed = [t["ms"] for t in entry["timings"] if "ms" in t]
        default = next((t for t in entry["timings"] if t["config"] == entry["default"]), {})
        print(f"{figures['preset']} {entry['kernel']}: {len(timed)} configs timed, default "
              f"{default.get('ms', float('nan')):.4f} ms{' (failed)' if 'error' in default else ''}, "
              f"best {min(timed, default=float('nan')):.4f} ms", flush=True)
        if path:
            with open(path, "w") as fh:
                json.dump({**results, "presets": results["presets"] + [figures]}, fh, indent=1)

    for name in args.preset or ["olmoe"]:
        results["presets"].append(tune_preset(name, args, timer, ceilings, device, save))
        torch.cuda.empty_cache()
    if path:
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"{results['device']}, torch {results['torch']}, profile {results['profile']}, "
          f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 GEMM {ceilings.gemm_bf16_tflops:.0f} TFLOP/s")
    for figures in results["presets"]:
        print_table(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
