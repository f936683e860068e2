"""Gate `split-muon`: split-block Muon (suite.arms.muon.Muon with split_sizes) on one fused weight
against the same Muon on its blocks as separate parameters, bit for bit, over K saved gradient sets.

Cases (each with its split saved in the buffers, so recorded buffers describe themselves):
- input-major: a [2, 6] weight split along dim 1 into [2, 3] + [2, 3];
- qkv: a grouped-query QKV weight [q + 2kv, d] split along dim 0 into q, kv, kv (GQA 4:1);
- gate-up: a SwiGLU gate/up weight [2f, d] split into its two halves (f = 4d);
- experts: a MoE layer's gate_up_proj as transformers 5 stores it, a 3-D stack [E, 2f, d] (E 4,
  f = d / 2), each expert's matrix split into its gate and up halves: its reference is the E * 2
  blocks as separate 2-D parameters, expert by expert.
Each runs with both scale rules, Nesterov on and off, and a warm-up + cosine lr (LambdaLR). On a
GPU the qkv and experts cases also run under CapturedOptimizer (the arm captured, the reference
eager).

Why bitwise holds: Muon batches the matrices of equal shape (and dtype, ns_steps, scale rule) in
a fixed order (groups, params, blocks), so the fused parameter's blocks and the separate
parameters (one group, in block order) run the same batched Newton-Schulz calls on the same
contiguous inputs (a batch past Muon.max_batch_elements splits at the same members for both);
momentum, weight decay and the lr step are elementwise. No tolerance is
loosened: where cuBLAS picks another algorithm for a batch than for one matrix, both sides batch
alike.

Also judged, in tolerance mode against a float64 truth (k = 2): one step's direction with the
batched Newton-Schulz (the arm) against one-by-one Newton-Schulz (the reference), outputs ns/*.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from gates.optimizer_runs import MUON_LR, WEIGHT_DECAY, lambda_schedule, newton_schulz_float64
from suite.arms.graph import CapturedOptimizer
from suite.arms.muon import Muon, muon_scale, newton_schulz
from suite.errors import BadBuffers
from suite.harness.criteria import BusyBound, SpeedupOver
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Buffers,
    Contender,
    Gate,
    Outputs,
    Preset,
    Saboteur,
    Tolerance,
)
from suite.harness.parity import bits_checksum

CASES = ("input-major", "qkv", "gate-up", "experts")
EXPERTS = 4
CONFIGS = tuple((rule, nesterov) for rule in ("spectral", "rms") for nesterov in (True, False))
# The cases that also run captured on a GPU.
CAPTURED_CASES = ("qkv", "experts")
NS_STEPS = 5

# (params, split sizes, split dim, scale rule, nesterov, capturable) -> the optimizer stepped
Make = Callable[[list[torch.Tensor], tuple[int, ...], int, str, bool, bool], Muon]


def _dims(preset: Preset) -> tuple[int, int, int, int]:
    """d, q, kv, f: q = d heads' width, kv = q / 4 (GQA 4:1), f = 4d."""
    d = preset.params["d"]
    return d, d, d // 4, 4 * d


def _case_splits(preset: Preset) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Each case's fused shape, split sizes and split dim (of each matrix, for a 3-D stack)."""
    d, q, kv, f = _dims(preset)
    return {
        "input-major": ((2, 6), (3, 3), 1),
        "qkv": ((q + 2 * kv, d), (q, kv, kv), 0),
        "gate-up": ((2 * f, d), (f, f), 0),
        "experts": ((EXPERTS, d, d), (d // 2, d // 2), 0),
    }


def _blocks(t: torch.Tensor, sizes: tuple[int, ...], dim: int) -> list[torch.Tensor]:
    """The blocks the reference steps as separate parameters: a 3-D stack's matrices in order,
    each split."""
    return [block for matrix in (t.unbind(0) if t.dim() == 3 else (t,)) for block in matrix.split(sizes, dim)]


def _joined(blocks: list[torch.Tensor], like: torch.Tensor, sizes: tuple[int, ...], dim: int) -> torch.Tensor:
    """_blocks' inverse: the blocks in like's shape."""
    n = len(sizes)
    matrices = [torch.cat(blocks[i:i + n], dim) for i in range(0, len(blocks), n)]
    return torch.stack(matrices) if like.dim() == 3 else matrices[0]


def _model_shapes(preset: Preset) -> dict[str, list[tuple[int, int]]]:
    """The bench's model: per layer a fused QKV, wo, a fused gate/up and the down projection."""
    d, q, kv, f = _dims(preset)
    layers = preset.params["layers"]
    return {"qkv": [(q + 2 * kv, d)] * layers, "gate-up": [(2 * f, d)] * layers,
            "rest": [(d, q), (d, f)] * layers}


def _preset(name: str, d: int, layers: int, where: str = "cuda", steps: int = 12, in_all: bool = True,
            note: str = "") -> Preset:
    preset = Preset(name, dict(d=d, layers=layers, steps=steps), where=where, note=note)
    gate_elements = sum(math.prod(shape) for shape, _, _ in _case_splits(preset).values())
    model_elements = sum(math.prod(s) for shapes in _model_shapes(preset).values() for s in shapes)
    # fp32 gate buffers (init + K grads), the runs' params, momentum and outputs, the float64
    # truth; bf16 params, grads and momentum for the two contenders of a bench case alive at once,
    # and Newton-Schulz's bf16 temporaries (about four copies of its largest batch, over half the model)
    memory = 4 * gate_elements * (steps + 12) + 2 * (3 * 2 + 4) * model_elements + (4 << 30)
    return Preset(name, dict(d=d, layers=layers, steps=steps), where=where, memory_bytes=memory, in_all=in_all,
                  note=note)


PRESETS = (
    _preset("tiny", 16, 2, where="any", note="seconds, on the CPU too: the gate and the saboteurs"),
    _preset("d1024", 1024, 24, note="24 layers, d=1024: QKV [1536, 1024], gate/up [8192, 1024]"),
    # not in `suite run` (every gate): its parity alone takes most of a minute on the H200
    _preset("d2048", 2048, 24, in_all=False,
            note="24 layers, d=2048: QKV [3072, 2048] (q 2048, kv 512), gate/up [16384, 2048]"),
)


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    gen = torch.Generator(device=device).manual_seed(seed)
    buffers = {}
    for case, (shape, sizes, dim) in _case_splits(preset).items():
        buffers[f"sizes/{case}"] = torch.tensor(sizes, dtype=torch.int64, device=device)
        buffers[f"dim/{case}"] = torch.tensor([dim], dtype=torch.int64, device=device)
        buffers[f"param/{case}"] = torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[1])
        for step in range(preset.params["steps"]):
            # gradients shrink over the run, as a loss does
            buffers[f"grad{step:02d}/{case}"] = 1e-3 / (1 + step) * torch.randn(shape, generator=gen, device=device)
    return buffers


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    """The preset's params of recorded buffers, which must describe each case whole: its split,
    its weight, and one gradient of the weight's shape per step."""
    steps = len({k.split("/")[0] for k in buffers if k.startswith("grad")})
    fix = "record them again with `suite record split-muon --out DIR`"
    if steps == 0:
        raise BadBuffers(f"split-muon buffers hold no gradients (grad00/<case>, ...); {fix}")
    for case in CASES:
        for name in (f"sizes/{case}", f"dim/{case}", f"param/{case}", *(f"grad{s:02d}/{case}" for s in range(steps))):
            if name not in buffers:
                raise BadBuffers(f"split-muon buffers lack {name!r} ({steps} steps of gradients found); {fix}")
        param, sizes, dim = buffers[f"param/{case}"], buffers[f"sizes/{case}"], buffers[f"dim/{case}"]
        if param.dim() not in (2, 3) or not param.is_floating_point():
            raise BadBuffers(f"split-muon buffer 'param/{case}' must be a floating-point matrix or 3-D stack of them, "
                             f"got {param.dtype} of shape {list(param.shape)}; {fix}")
        if dim.numel() != 1 or dim.is_floating_point() or int(dim.item()) not in (0, 1):
            raise BadBuffers(f"split-muon buffer 'dim/{case}' must be [0] or [1], got {dim.tolist()}; {fix}")
        along = param.shape[-2:][int(dim.item())]
        if (sizes.dim() != 1 or sizes.is_floating_point() or sizes.numel() == 0 or bool((sizes <= 0).any())
                or int(sizes.sum()) != along):
            raise BadBuffers(f"split-muon buffer 'sizes/{case}' must be positive block sizes summing to param/{case}'s "
                             f"{along} along dim {int(dim.item())}, got {sizes.tolist()}; {fix}")
        for s in range(steps):
            grad = buffers[f"grad{s:02d}/{case}"]
            if grad.shape != param.shape or grad.dtype != param.dtype:
                raise BadBuffers(f"split-muon buffer 'grad{s:02d}/{case}' must match param/{case} "
                                 f"({param.dtype}, {list(param.shape)}), got {grad.dtype}, {list(grad.shape)}; {fix}")
    return dict(steps=steps)


def _split(buffers: Buffers, case: str) -> tuple[tuple[int, ...], int]:
    return tuple(buffers[f"sizes/{case}"].tolist()), int(buffers[f"dim/{case}"].item())


# ---- the optimizers: the reference's separate blocks, the arm's fused split, the saboteurs ----


def _muon(groups: list[dict], rule: str, nesterov: bool, capturable: bool, cls: type[Muon] = Muon, **extra) -> Muon:
    return cls(groups, lr=MUON_LR, weight_decay=WEIGHT_DECAY, scale=rule, nesterov=nesterov, ns_steps=NS_STEPS,
               capturable=capturable, **extra)


def _separate(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    """The reference: the blocks as separate parameters of one group, in block order."""
    return _muon([{"params": params}], rule, nesterov, capturable)


def _fused_split(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    """The arm: one fused parameter with split_sizes (use_muon given: a 3-D one would go to AdamW)."""
    return _muon([{"params": params, "use_muon": True, "split_sizes": sizes, "split_dim": dim}], rule, nesterov,
                 capturable)


class _WholeMatrixScale(Muon):
    """Saboteur: each block orthogonalised on its own but scaled by the fused matrix's shape."""

    def __init__(self, *args, fused_shape: tuple[int, int], **kwargs):
        self.fused_shape = fused_shape
        super().__init__(*args, **kwargs)

    def orthogonalize(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        return newton_schulz(update, group["ns_steps"]).mul_(muon_scale(*self.fused_shape, group["scale"]))


def _whole_matrix_scale(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    groups = [{"params": params, "use_muon": True, "split_sizes": sizes, "split_dim": dim}]
    return _muon(groups, rule, nesterov, capturable, cls=_WholeMatrixScale, fused_shape=tuple(params[0].shape[-2:]))


def _unsplit(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    return _muon([{"params": params, "use_muon": True}], rule, nesterov, capturable)


def _wrong_dim(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    """As many blocks, as even as they come, along the other dimension."""
    other = 1 - dim
    n, count = params[0].shape[-2:][other], len(sizes)
    even = tuple(n // count + (i < n % count) for i in range(count))
    return _muon([{"params": params, "use_muon": True, "split_sizes": even, "split_dim": other}], rule, nesterov,
                 capturable)


class _StackAsOneMatrix(Muon):
    """Saboteur: a 3-D stack orthogonalised as one tall matrix [E * rows, cols], unsplit (what Muon
    on the stack flattened to a matrix would do)."""

    def split_blocks(self, update: torch.Tensor, group: dict) -> list[torch.Tensor]:
        return super().split_blocks(update.flatten(0, 1) if update.dim() == 3 else update, group)

    def join_blocks(self, directions: list[torch.Tensor], update: torch.Tensor, group: dict) -> torch.Tensor:
        flat = update.flatten(0, 1) if update.dim() == 3 else update
        return super().join_blocks(directions, flat, group).view(update.shape)


def _stack_as_one_matrix(params, sizes, dim, rule, nesterov, capturable) -> Muon:
    return _muon([{"params": params, "use_muon": True}], rule, nesterov, capturable, cls=_StackAsOneMatrix)


# ---- the training loop ----


def _train(buffers: Buffers, preset: Preset, case: str, rule: str, nesterov: bool, make: Make,
           fused: bool, captured: bool = False) -> Outputs:
    """K steps from the saved weight: fused (one param) or as its blocks; each step's fused
    parameter (the blocks concatenated) as a bit checksum, the final one and its momentum whole."""
    sizes, dim = _split(buffers, case)
    init = buffers[f"param/{case}"]
    params = [init.clone()] if fused else [block.clone() for block in _blocks(init, sizes, dim)]
    for p in params:
        p.requires_grad_()
        p.grad = torch.zeros_like(p)
    optimizer = make(params, sizes, dim, rule, nesterov, captured)
    stepper = CapturedOptimizer(optimizer) if captured else optimizer
    steps = preset.params["steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(stepper, lambda_schedule(steps))
    prefix = f"{case}{'-captured' if captured else ''}/{rule}-{'nesterov' if nesterov else 'plain'}"
    outputs: Outputs = {}
    for step in range(steps):
        grad = buffers[f"grad{step:02d}/{case}"]
        # in place: a captured step reads the grad tensors it saw at capture
        for p, block in zip(params, _blocks(grad, sizes, dim) if not fused else [grad]):
            p.grad.copy_(block)
        stepper.step()
        scheduler.step()
        outputs[f"{prefix}/step{step:02d}"] = bits_checksum(_whole([p.detach() for p in params], init, sizes, dim))
    outputs[f"{prefix}/final"] = _whole([p.detach() for p in params], init, sizes, dim)
    outputs[f"{prefix}/momentum"] = _whole([optimizer.state[p]["momentum_buffer"] for p in params], init, sizes, dim)
    return outputs


def _whole(tensors: list[torch.Tensor], like: torch.Tensor, sizes: tuple[int, ...], dim: int) -> torch.Tensor:
    """The fused parameter's one tensor, or the separate blocks joined into its shape."""
    return tensors[0] if len(tensors) == 1 else _joined(tensors, like, sizes, dim)


def _direction(buffers: Buffers, case: str, batch_ns: bool) -> torch.Tensor:
    """One split Muon step from zero with lr 1, no momentum: minus the step's direction."""
    sizes, dim = _split(buffers, case)
    grad = buffers[f"grad00/{case}"]
    p = torch.zeros_like(grad, requires_grad=True)
    p.grad = grad.clone()
    group = {"params": [p], "use_muon": True, "split_sizes": sizes, "split_dim": dim, "batch_ns": batch_ns}
    Muon([group], lr=1.0, momentum=0.0, nesterov=False, ns_steps=NS_STEPS).step()
    return p.detach()


def _on_gpu(buffers: Buffers) -> bool:
    return buffers["param/qkv"].is_cuda


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    outputs: Outputs = {}
    for case in CASES:
        for rule, nesterov in CONFIGS:
            outputs.update(_train(buffers, preset, case, rule, nesterov, _separate, fused=False))
    if _on_gpu(buffers):
        # the captured arm's reference is the same eager run of the separate blocks
        for case in CAPTURED_CASES:
            outputs.update({name.replace(f"{case}/", f"{case}-captured/", 1): value
                            for name, value in list(outputs.items()) if name.startswith(f"{case}/")})
    for case in CASES:
        outputs[f"ns/{case}"] = _direction(buffers, case, batch_ns=False)
    return outputs


def _arm_with(make: Make) -> Callable[[Buffers, Preset], Outputs]:
    def arm(buffers: Buffers, preset: Preset) -> Outputs:
        outputs: Outputs = {}
        for case in CASES:
            for rule, nesterov in CONFIGS:
                outputs.update(_train(buffers, preset, case, rule, nesterov, make, fused=True))
        if _on_gpu(buffers):
            for case in CAPTURED_CASES:
                for rule, nesterov in CONFIGS:
                    outputs.update(_train(buffers, preset, case, rule, nesterov, make, fused=True, captured=True))
        for case in CASES:
            outputs[f"ns/{case}"] = _direction(buffers, case, batch_ns=True)
        return outputs

    return arm


arm = _arm_with(_fused_split)


def truth(buffers: Buffers, preset: Preset) -> Outputs:
    """The ns/* outputs in float64: minus each block's spectral scale times its Newton-Schulz."""
    outputs: Outputs = {}
    for case in CASES:
        sizes, dim = _split(buffers, case)
        grad = buffers[f"grad00/{case}"]
        directions = [muon_scale(*block.shape, "spectral") * newton_schulz_float64(block, NS_STEPS)
                      for block in _blocks(grad, sizes, dim)]
        outputs[f"ns/{case}"] = -_joined(directions, grad, sizes, dim)
    return outputs


SABOTEURS = (
    Saboteur("whole-matrix-scale", "each block orthogonalised on its own but scaled by the fused shape",
             _arm_with(_whole_matrix_scale)),
    Saboteur("no-split", "the fused matrix orthogonalised as a whole", _arm_with(_unsplit)),
    Saboteur("wrong-dim", "the split taken along the other dimension (as many blocks, even sizes)",
             _arm_with(_wrong_dim)),
    Saboteur("stack-as-one-matrix", "a 3-D stack of experts orthogonalised as one tall matrix",
             _arm_with(_stack_as_one_matrix)),
)

# ---- bench: warm optimizer steps of a 24-layer model with fused weights, dispatch included ----


def _model(buffers: Buffers, preset: Preset) -> dict[str, list[torch.Tensor]]:
    """bf16 params with bf16 grads, drawn on the buffers' device (only their shapes matter to
    the step's time)."""
    device = buffers["param/qkv"].device
    gen = torch.Generator(device=device).manual_seed(0)
    model = {}
    for kind, shapes in _model_shapes(preset).items():
        params = []
        for shape in shapes:
            p = (torch.randn(shape, generator=gen, device=device) / math.sqrt(shape[1])).bfloat16().requires_grad_()
            p.grad = (1e-3 * torch.randn(shape, generator=gen, device=device)).bfloat16()
            params.append(p)
        model[kind] = params
    return model


def _model_groups(model: dict[str, list[torch.Tensor]], preset: Preset, split: bool, batch_ns: bool = True) -> list[dict]:
    _, q, kv, f = _dims(preset)
    qkv = {"split_sizes": (q, kv, kv)} if split else {}
    gate_up = {"split_sizes": (f, f)} if split else {}
    return [{"params": model["qkv"], "batch_ns": batch_ns, **qkv},
            {"params": model["gate-up"], "batch_ns": batch_ns, **gate_up},
            {"params": model["rest"], "batch_ns": batch_ns}]


def _bench_step(split: bool, batch_ns: bool = True, captured: bool = False):
    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        groups = _model_groups(_model(buffers, preset), preset, split, batch_ns)
        optimizer = Muon(groups, lr=MUON_LR, weight_decay=WEIGHT_DECAY, capturable=captured)
        return (CapturedOptimizer(optimizer) if captured else optimizer).step

    return build


CONTENDERS = (
    Contender("whole-matrix", "reference", _bench_step(split=False), cases=("split-step",),
              note="Muon on the fused matrices as wholes (batched Newton-Schulz)"),
    Contender("split-block", "arm", _bench_step(split=True), cases=("split-step", "ns-batched"),
              note="split_sizes on the fused QKV and gate/up, batched Newton-Schulz, eager"),
    Contender("split-block one-by-one", "reference", _bench_step(split=True, batch_ns=False), cases=("ns-batched",),
              note="the same, batch_ns=False: Newton-Schulz one matrix at a time"),
    Contender("split-block eager", "reference", _bench_step(split=True), cases=("split-captured",),
              note="split-block again, as the reference of its capture"),
    Contender("split-block captured", "arm", _bench_step(split=True, captured=True), cases=("split-captured",),
              note="CapturedOptimizer(Muon(split, capturable=True))"),
)


def _ns_flops(preset: Preset) -> int:
    """Newton-Schulz per split-block step: per matrix m x n (m <= n), A = X X^T, A @ A, B @ X."""
    _, q, kv, f = _dims(preset)
    layers = preset.params["layers"]
    d = preset.params["d"]
    matrices = [(q, d), (kv, d), (kv, d), (f, d), (f, d), (d, q), (d, f)]
    total = 0
    for shape in matrices:
        m, n = sorted(shape)
        total += NS_STEPS * (4 * m * m * n + 2 * m * m * m)
    return layers * total


def _step_bytes(preset: Preset) -> int:
    # bf16: read p, g, m; write p, m = 10 B/param
    return 10 * sum(math.prod(s) for shapes in _model_shapes(preset).values() for s in shapes)


def _case(name: str, description: str, cold_calls: int = 1) -> BenchCase:
    return BenchCase(name, description, bytes=_step_bytes, flops=_ns_flops, ceiling="gemm", l2="warm",
                     modes=("eager",), window=2, gpu_busy=True, calls_per_round=2, cold_calls=cold_calls)


# Host-bound steps: eager windows only (a captured step is a contender of its own), the L2 warm,
# GPU busy time beside the wall time. FLOPs are the split-block Newton-Schulz in every case.
BENCHES = (
    _case("split-step", "split-block vs whole-matrix Muon step, dispatch included"),
    _case("ns-batched", "split-block step: batched vs one-by-one Newton-Schulz"),
    _case("split-captured", "split-block step: captured vs eager", cold_calls=4),
)

GATE = Gate(
    name="split-muon",
    summary="Split-block Muon on fused weights vs Muon on the blocks as separate params, bitwise",
    arm_name="suite.arms.muon.Muon(split_sizes=...)",
    needs_cuda=False,
    presets=PRESETS,
    make_buffers=make_buffers,
    buffer_params=buffer_params,
    reference=reference,
    arm=arm,
    truth=truth,
    parity=Bitwise(),
    parity_by_output={"ns/*": Tolerance(k=2.0)},
    saboteurs=SABOTEURS,
    contenders=CONTENDERS,
    benches=BENCHES,
    criteria=(
        # "at most 10% slower": the split step's speedup over the whole-matrix step >= 0.9
        SpeedupOver(0.9, presets=("d1024", "d2048"), cases=("split-step",)),
        SpeedupOver(1.5, presets=("d1024",), cases=("ns-batched",)),
        # batched Newton-Schulz keeps the GPU busy for almost all of the eager step, so a capture
        # cannot win much; it must come within 5% of the eager step's device time (docs/tuning.md)
        BusyBound(1.05, presets=("d1024", "d2048"), cases=("split-captured",)),
    ),
)
