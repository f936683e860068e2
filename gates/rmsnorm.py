"""Gate `rmsnorm`: the fused Triton RMSNorm (suite.arms.rmsnorm) against eager fp32-math torch.

Buffers are drawn the way a bf16 LM step sees them: activation rows whose scale spans four
decades (so eps matters on the small ones), two outlier channels, and gradients of order
1e-6 (so a path that rounds through fp16 underflows and shows).
"""

from __future__ import annotations

import itertools
import math
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from gates.liger import liger_missing
from suite.arms.rmsnorm import (
    reduce_dw_partials,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_reference,
)
from suite.harness.criteria import CeilingFraction, NotSlowerThan
from suite.harness.gate import (
    BenchCase,
    Buffers,
    Contender,
    Gate,
    Outputs,
    Preset,
    Saboteur,
    Tolerance,
)
from suite.errors import BadBuffers
from suite.files.buffers import expect_buffer
from suite.harness.results import Check

# bytes per element of x a GPU preset needs at its peak (x, dy, the arm's, the reference's and
# the float64 truth's y and dx, the eager fwd+bwd's fp32 temporaries and the graph pools while
# timing): the H200's measured peak (docs/gpu-notes.md, "Memory") plus a margin
_GPU_BYTES_PER_ELEMENT = 60


def _tiny(name: str, shape, dtype, weight_dtype, offset, standard=False, note="") -> Preset:
    params = dict(shape=list(shape), dtype=dtype, weight_dtype=weight_dtype, eps=1e-6, offset=offset)
    return Preset(name, params, where="any", standard=standard, note=note)


def _gpu(rows: int, cols: int, standard: bool = True, note: str = "") -> Preset:
    params = dict(shape=[rows, cols], dtype="bfloat16", weight_dtype="bfloat16", eps=1e-6, offset=0.0)
    return Preset(f"{rows}x{cols}", params, where="cuda", standard=standard, note=note,
                  memory_bytes=rows * cols * _GPU_BYTES_PER_ELEMENT)


PRESETS = (
    _tiny("tiny", (3, 16, 96), "bfloat16", "float32", 0.0, standard=True, note="bf16 x, fp32 weight"),
    _tiny("tiny-gemma", (40, 130), "float16", "float16", 1.0, note="zero-centred weight, odd width"),
    _tiny("tiny-fp32", (33, 64), "float32", "float32", 0.0, note="fp32 end to end"),
    _gpu(8, 4096, standard=False, note="host probe: too small to keep the GPU busy"),
    # one preset per size class in `suite run`; the other two shapes on request (suite bench
    # rmsnorm --preset 32768x2048 --preset 8192x8192), which keeps `suite run` within its budget
    _gpu(4096, 2048, note="a small model's step: where dispatch decides"),
    _gpu(8192, 2880),
    _gpu(16384, 4096),
    _gpu(32768, 2048, standard=False, note="the 16384x4096 class, more rows"),
    _gpu(8192, 8192, standard=False, note="the 16384x4096 class, wider"),
    _gpu(4096, 65536, note="rows over 16384: the looped path"),
)


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    p = preset.params
    shape, dtype, wdtype = tuple(p["shape"]), getattr(torch, p["dtype"]), getattr(torch, p["weight_dtype"])
    rows, cols = math.prod(shape[:-1]), shape[-1]
    gen = torch.Generator(device=device).manual_seed(seed)
    row_scale = 10.0 ** (torch.rand(rows, 1, generator=gen, device=device) * 4 - 3)
    x = torch.randn(rows, cols, generator=gen, device=device) * row_scale
    outliers = torch.randint(0, cols, (2,), generator=gen, device=device)
    x[:, outliers] *= 20
    weight = (1.0 - p["offset"]) + 0.1 * torch.randn(cols, generator=gen, device=device)
    dy = 1e-6 * torch.randn(rows, cols, generator=gen, device=device)
    return {
        "x": x.to(dtype).reshape(shape),
        "weight": weight.to(wdtype),
        "dy": dy.to(dtype).reshape(shape),
    }


FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    x = expect_buffer("rmsnorm", buffers, "x", dtypes=FLOATS)
    if x.dim() == 0:
        raise BadBuffers("rmsnorm buffer 'x' must have a hidden dimension, got a 0-d tensor; record them again with "
                         "`suite record rmsnorm --out DIR`")
    weight = expect_buffer("rmsnorm", buffers, "weight", shape=(x.shape[-1],), dtypes=FLOATS)
    expect_buffer("rmsnorm", buffers, "dy", shape=tuple(x.shape), dtypes=(x.dtype,))
    return dict(shape=list(x.shape), dtype=str(x.dtype).removeprefix("torch."), weight_dtype=str(weight.dtype).removeprefix("torch."))


def _forward_backward(norm: Callable[..., torch.Tensor], buffers: Buffers, preset: Preset) -> Outputs:
    x = buffers["x"].detach().requires_grad_()
    weight = buffers["weight"].detach().requires_grad_()
    y = norm(x, weight, eps=preset.params["eps"], offset=preset.params["offset"])
    dx, dw = torch.autograd.grad(y, (x, weight), buffers["dy"])
    return {"y": y.detach(), "dx": dx, "dw": dw}


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    return _forward_backward(rms_norm_reference, buffers, preset)


def arm(buffers: Buffers, preset: Preset) -> Outputs:
    return _forward_backward(rms_norm, buffers, preset)


def truth(buffers: Buffers, preset: Preset) -> Outputs:
    """Closed-form float64 forward and backward, independent of the reference's autograd.

    Rows are processed in chunks so the float64 temporaries stay small on large presets.
    """
    eps, offset = preset.params["eps"], preset.params["offset"]
    shape = buffers["x"].shape
    x2 = buffers["x"].reshape(-1, shape[-1])
    dy2 = buffers["dy"].reshape(-1, shape[-1])
    scale = offset + buffers["weight"].double()
    y = torch.empty(x2.shape, dtype=torch.float64, device=x2.device)
    dx = torch.empty_like(y)
    dw = torch.zeros_like(scale)
    chunk = max(1, (1 << 22) // max(shape[-1], 1))
    for start in range(0, x2.shape[0], chunk):
        xs, dys = x2[start : start + chunk].double(), dy2[start : start + chunk].double()
        rstd = torch.rsqrt(xs.square().mean(-1, keepdim=True) + eps)
        g = dys * scale
        y[start : start + chunk] = xs * rstd * scale
        dx[start : start + chunk] = rstd * g - xs * rstd.pow(3) * (g * xs).mean(-1, keepdim=True)
        dw += (dys * xs * rstd).sum(0)
    return {"y": y.reshape(shape), "dx": dx.reshape(shape), "dw": dw}


# ---- saboteurs: known-bad variants assembled from the arm's own building blocks ----


def _blocks(buffers: Buffers, preset: Preset, *, eps: float | None = None, partials=lambda p: p) -> Outputs:
    """The arm's forward and backward in the two-stage form (the same bits as the arm's folded
    dW reduction), so a saboteur can tamper with the partials between the stages."""
    shape = buffers["x"].shape
    x2, dy2 = buffers["x"].reshape(-1, shape[-1]), buffers["dy"].reshape(-1, shape[-1])
    weight, offset = buffers["weight"], preset.params["offset"]
    y, stats = rms_norm_forward(x2, weight, preset.params["eps"] if eps is None else eps, offset)
    dx, dw_partials = rms_norm_backward(dy2, x2, weight, stats, offset)
    dw = reduce_dw_partials(partials(dw_partials), weight.dtype)
    return {"y": y.reshape(shape), "dx": dx.reshape(shape), "dw": dw}


def _dx_through_narrower(buffers: Buffers, preset: Preset) -> Outputs:
    out = _blocks(buffers, preset)
    dtype = out["dx"].dtype
    out["dx"] = out["dx"].to(torch.bfloat16 if dtype == torch.float16 else torch.float16).to(dtype)
    return out


def _last_row_unwritten(buffers: Buffers, preset: Preset) -> Outputs:
    out = _blocks(buffers, preset)
    shape = buffers["x"].shape
    x2 = buffers["x"].reshape(-1, shape[-1])
    y = torch.empty_like(x2)
    y[:-1] = rms_norm_forward(x2[:-1], buffers["weight"], preset.params["eps"], preset.params["offset"])[0]
    out["y"] = y.reshape(shape)
    return out


def _writes_into_input(buffers: Buffers, preset: Preset) -> Outputs:
    out = _blocks(buffers, preset)
    buffers["x"].copy_(out["y"])
    return out


_calls = itertools.count(1)


def _rotated(partials: torch.Tensor) -> torch.Tensor:
    # like atomics: the summation order moves from one call to the next
    return partials.roll(next(_calls), dims=0)


SABOTEURS = (
    Saboteur("eps-ignored", "forward normalises with eps = 0", lambda b, p: _blocks(b, p, eps=0.0)),
    Saboteur("dw-one-partial", "dW reduced from the first partial only", lambda b, p: _blocks(b, p, partials=lambda t: t[:1])),
    Saboteur(
        "dx-through-narrower",
        "dx rounded through fp16 (underflows small gradients), or bf16 for fp16 inputs",
        _dx_through_narrower,
    ),
    Saboteur("last-row-unwritten", "forward skips the last row of y", _last_row_unwritten, caught_by=Check.POISON),
    Saboteur(
        "dw-order-varies",
        "dW partials summed in an order that changes from call to call",
        lambda b, p: _blocks(b, p, partials=_rotated),
        caught_by=Check.DETERMINISM,
        # an order change moves fp32 sums by an ulp or so: it shows only in an fp32 dW
        applies=lambda p: p.params["weight_dtype"] == "float32",
    ),
    Saboteur("writes-into-input", "stores y into the input x", _writes_into_input, caught_by=Check.INPUTS),
)

# ---- bench: every contender declared once ----


def _liger(eps: float, offset: float) -> Callable:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # "gemma" casting computes everything in fp32 like the reference; never in place
    return lambda x, w: LigerRMSNormFunction.apply(x, w, eps, offset, "gemma", False)


def _native(eps: float, offset: float) -> Callable:
    return lambda x, w: F.rms_norm(x, (x.shape[-1],), w if offset == 0 else w + offset, eps)


def _timed(make_norm: Callable[[float, float], Callable]) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    """A contender's build: its norm called as the case says (forward alone, or forward and
    autograd backward for dx and dW)."""

    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        norm = make_norm(preset.params["eps"], preset.params["offset"])
        x, weight, dy = buffers["x"], buffers["weight"], buffers["dy"]
        if case.name == "fwd":

            def forward():
                with torch.no_grad():
                    return norm(x, weight)

            return forward
        xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()

        def forward_backward():
            return torch.autograd.grad(norm(xg, wg), (xg, wg), dy)

        return forward_backward

    return build


def _with(norm: Callable, compiled: bool = False, **options) -> Callable[[float, float], Callable]:
    def make(eps: float, offset: float) -> Callable:
        if not compiled:
            if options:
                return partial(norm, eps=eps, offset=offset, **options)
            # called as a user writes it: positional, no partial's keyword merging on the host
            return lambda x, w: norm(x, w, eps, offset)
        # A fresh compile for this shape: a run compiles one function for many shapes and grad
        # modes, and past dynamo's recompile limit it would silently run the eager code.
        torch._dynamo.reset()
        return torch.compile(partial(norm, eps=eps, offset=offset), dynamic=False, **options)

    return make


CONTENDERS = (
    Contender("reference", "reference", _timed(_with(rms_norm_reference)), note="eager torch, fp32 math"),
    Contender("arm", "arm", _timed(_with(rms_norm)),
              note="suite.arms.rmsnorm.rms_norm: our kernels, torch's native one for small CUDA tensors"),
    Contender("fused", "peer", _timed(_with(rms_norm, impl="fused")),
              note="rms_norm(impl='fused'): our kernels at every size"),
    Contender("F.rms_norm", "peer", _timed(_native), note="torch.nn.functional.rms_norm (torch's fused kernel)"),
    Contender("torch.compile", "peer", _timed(_with(rms_norm_reference, compiled=True)),
              note="torch.compile of the eager reference"),
    Contender("arm compiled", "peer", _timed(_with(rms_norm, compiled=True, fullgraph=True)),
              note="the arm inside torch.compile(fullgraph=True): a compiled model using it"),
    Contender("liger", "peer", _timed(_liger), unavailable=liger_missing,
              note="Liger-Kernel RMSNorm, gemma casting (fp32 math)"),
)


def _elements(preset: Preset) -> tuple[int, int, int, int]:
    shape = preset.params["shape"]
    esize = getattr(torch, preset.params["dtype"]).itemsize
    wsize = getattr(torch, preset.params["weight_dtype"]).itemsize
    return math.prod(shape), shape[-1], esize, wsize


def _fwd_bytes(preset: Preset) -> int:
    n, cols, esize, wsize = _elements(preset)
    return 2 * n * esize + cols * wsize  # read x, write y (4 B/elem in bf16)


def _fwd_bwd_bytes(preset: Preset) -> int:
    n, cols, esize, wsize = _elements(preset)
    return 5 * n * esize + 2 * cols * wsize  # + read x, dy, write dx (10 B/elem in bf16)


BENCHES = (
    BenchCase("fwd", "forward, no autograd", bytes=_fwd_bytes),
    BenchCase("fwd+bwd", "forward then autograd backward for dx and dW", bytes=_fwd_bwd_bytes),
)

GATE = Gate(
    name="rmsnorm",
    summary="Fused Triton RMSNorm forward+backward vs eager fp32-math torch",
    arm_name="suite.arms.rmsnorm.rms_norm",
    needs_cuda=False,
    presets=PRESETS,
    make_buffers=make_buffers,
    required_buffers=("x", "weight", "dy"),
    buffer_params=buffer_params,
    reference=reference,
    arm=arm,
    truth=truth,
    parity=Tolerance(k=2.0, floor=1e-6),
    saboteurs=SABOTEURS,
    contenders=CONTENDERS,
    benches=BENCHES,
    host_probe="8x4096",
    criteria=(
        # in both modes: an eager loop must not lose to torch's own kernel either
        NotSlowerThan(),
        NotSlowerThan("F.rms_norm"),
        # the ceiling is a claim about the kernels' device time: graph replays only; the bars sit
        # below the fractions measured on the H200 (docs/tuning.md)
        CeilingFraction(0.88, presets=("16384x4096",), cases=("fwd",), modes=("graph",)),
        CeilingFraction(0.65, presets=("16384x4096",), cases=("fwd+bwd",), modes=("graph",)),
    ),
)
