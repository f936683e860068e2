"""Muon for matrices, AdamW for the rest, with a step that a CUDA graph can capture.

Muon (Keller Jordan, 2024) steps a 2-D parameter along an orthogonalised momentum:

    m = momentum * m + g
    u = g + momentum * m        (Nesterov; u = m without)
    O = newton_schulz(u)        about U V^T, the orthogonal polar factor of u
    p = p * (1 - lr * weight_decay) - lr * scale * O

newton_schulz runs the quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, in bf16 on the
Frobenius-normalised input. Jordan's coefficients (3.4445, -4.7750, 2.0315) give up exact
convergence for a steep start: after five steps every singular value lies in about [0.7, 1.2],
which trains as well as the exact polar factor and costs only matmuls. `scale` sets the update
size from the shape: "spectral" = sqrt(max(1, rows / cols)) (Jordan), "rms" = 0.2 * sqrt(max(rows,
cols)), which gives the update AdamW's RMS of about 0.2 so that both kinds of group can share an lr.

Fused weights. A model may fuse projections into one wide weight so that one GEMM does their
work (Q, K and V, unequal under grouped-query attention; gate and up of a SwiGLU MLP). Muon on the
fused matrix would mix the singular directions of unrelated blocks and scale the update by the
fused shape. The param-group option split_sizes=(s1, s2, ...) cuts each parameter of the group
along split_dim (0: the output rows of a torch.nn.Linear weight; 1: weights stored input-major)
and gives each block the update a separate parameter of the block's shape would get: its own
Newton-Schulz and its own scale (split_interleaved=True: n equal blocks that alternate, block k
every n-th row or column from k). Momentum stays one buffer of the fused shape (it is
elementwise), and weight decay and lr are the group's.

Batching. The matrices of one step that agree in shape, dtype, device, ns_steps and scale rule
(blocks and whole parameters alike, across the Muon groups) are orthogonalised together, one
Newton-Schulz on a 3-D batch (a bmm chain), in a fixed order: groups in order, each group's params
in order, each one's blocks in order. A fused parameter with split_sizes therefore runs exactly
the batches that its blocks, given in its place as separate parameters in block order, would run,
and gets the same bits. batch_ns=False keeps a group's matrices out of the batches: Newton-Schulz
matrix by matrix (2-D matmuls).

Stacked matrices. A 3-D parameter [n, rows, cols] in a group with use_muon=True is n matrices,
as transformers 5 stores a MoE layer's experts: each is stepped as a separate 2-D parameter of
[rows, cols] would be, its own Newton-Schulz and scale (split_sizes then split each matrix:
split_dim 0 its rows, 1 its columns), and the parameter gets the bits those n matrices, given in
its place in order, would get. A group without use_muon leaves 3-D parameters to AdamW.

Orientation. The spectral scale reads a matrix's rows as the layer's outputs, as a torch.nn.Linear
weight stores them ([out, in]). A group with transposed=True holds matrices stored [in, out]
(transformers' experts with is_transposed, gpt-oss's and Aria's; the suite's MoEExperts): each
block is orthogonalised and scaled as its transpose, the layer's out x in, and gets the bits the
layer's [out, in] matrix would (split_dim still counts the stored dims).

Batches are capped at max_batch_elements: one Newton-Schulz stacks its matrices and keeps bf16
temporaries of about their size, which for a MoE's experts would otherwise be a copy of most of
the model. The cap splits a batch into consecutive runs of its members, the same for a fused
parameter as for its blocks given separately.

Vectors (norm gains, biases) and the matrices a user marks use_muon=False (embeddings, output
heads) get AdamW: Adam moments with bias correction and decoupled weight decay.

Capture. A CUDA graph replays its kernels with the scalars they had at capture, so a step that
passes lr to a kernel as a python float keeps the capture's lr forever. With capturable=True each
group's lr, weight_decay, momentum and betas live in 0-d fp32 tensors on the group's device, which
sync_hyperparameters() refills in place from the group's python numbers (what LR schedulers set,
OneCycleLR's and CyclicLR's momentum cycling included), and the AdamW step count is a device
tensor, so no step reads a device value on the host.

Skipping a step. As torch's fused optimizers do for GradScaler, a step reads `found_inf` (an
attribute: a 0-d float tensor on the params' device, or None): where it is nonzero the step leaves
every parameter and every state tensor (momentum, exp_avg, exp_avg_sq, the step count) with its
bits, decided on the device, so the step needs no host sync and can be captured (suite.arms.skip_step
sets it). On a GPU the momentum and parameter updates are then one Triton kernel each that
rounds as the eager ops do and selects the old value on a skip; elsewhere the eager ops multiply
by 1 and add a signed zero on a skip (a NaN stays NaN there, its payload aside).

Bitwise contract. capturable=False runs the same tensor ops on the same dtypes; only its 0-d
tensors are made afresh from the python numbers every step (torch.full, the same fill). Eager
non-capturable, eager capturable and a replayed capture therefore agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from suite.triton_support import launch_kept, on_device_of

# Keller Jordan's quintic: maximal slope at zero, singular values left within about [0.7, 1.2].
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Keeps the prescale finite for an all-zero update.
NS_EPS = 1e-7
SCALE_RULES = ("spectral", "rms")


def newton_schulz(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """About the orthogonal polar factor U V^T of the matrix G, or of each matrix of the 3-D batch G
    (one bmm chain); computed in bf16, returned in G's dtype."""
    if G.dim() not in (2, 3):
        raise ValueError(f"newton_schulz: G must be a matrix or a 3-D batch of them, got shape {tuple(G.shape)}")
    if not G.is_floating_point():
        raise TypeError(f"newton_schulz: G must be floating point, not {G.dtype}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"newton_schulz: steps must be an int >= 1, got {steps!r}")
    a, b, c = NS_COEFFICIENTS
    X = G.bfloat16()
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1].
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + NS_EPS)
    # Iterate on the wide form: X X^T is then the smaller Gram matrix.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if tall:
        X = X.mT
    return X.to(G.dtype)


def muon_scale(rows: int, cols: int, rule: str) -> float:
    """Factor on the orthogonalised update of a rows x cols matrix under `rule`."""
    if rule == "spectral":
        return max(1.0, rows / cols) ** 0.5
    if rule == "rms":
        # An orthogonal rows x cols matrix has RMS 1 / sqrt(max(rows, cols)).
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f'muon_scale: rule must be one of {SCALE_RULES}, not {rule!r}')


def _stream_capturing() -> bool:
    # The CPU build cannot capture (and its query raises).
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A finite python number (a bool is no number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _device_values(group: dict, key: str) -> dict[str, float]:
    """The 0-d device tensors that the live group key `key` fills, by name, with their host values."""
    if key == "betas":
        beta1, beta2 = group["betas"]
        # 1 - beta is taken in double and rounded once, as torch's AdamW passes it to its kernels:
        # 1 - fp32(beta) keeps beta's rounding error, 1.3e-5 relative for beta = 0.999.
        return {"beta1": beta1, "beta2": beta2, "one_minus_beta1": 1 - beta1, "one_minus_beta2": 1 - beta2}
    return {key: group[key]}


class StepScalars(NamedTuple):
    """A param group's hyperparameters for one step: 0-d fp32 tensors on the group's device."""

    lr: torch.Tensor
    decay: torch.Tensor  # 1 - lr * weight_decay
    momentum: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    one_minus_beta1: torch.Tensor
    one_minus_beta2: torch.Tensor
    # 0-d bool: this step changes nothing (the optimizer's found_inf is nonzero); None: never
    skip: torch.Tensor | None = None


@triton.jit
def _kept_update_kernel(x_ptr, y_ptr, a_ptr, b_ptr, skip_ptr, n, SIGN: tl.constexpr, HAS_B: tl.constexpr,
                        HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    """x <- x * a + SIGN * (y * b), rounded as the eager CUDA ops round it (launched without FMA
    contraction): a and b (0-d fp32 device tensors) first to x's dtype, as ATen casts a 0-d
    device operand to the other's dtype; each product and the sum to x's dtype. Unless skip:
    then x keeps its bits. Without b, y itself (y * 1 is y); without skip, every step updates."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    a = tl.load(a_ptr).to(x.dtype).to(tl.float32)
    xa = (x.to(tl.float32) * a).to(x.dtype).to(tl.float32)
    if HAS_B:
        b = tl.load(b_ptr).to(y.dtype).to(tl.float32)
        yb = (y.to(tl.float32) * b).to(y.dtype).to(tl.float32)
    else:
        yb = y.to(tl.float32)
    new = (xa + SIGN * yb).to(x.dtype)
    if HAS_SKIP:
        new = tl.where(tl.load(skip_ptr) != 0, x, new)
    tl.store(x_ptr + offsets, new, mask=mask)


_KEPT_BLOCK = 4096
_KEPT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kept_update(skip: torch.Tensor | None, x: torch.Tensor, a: torch.Tensor, y: torch.Tensor,
                 b: torch.Tensor | None, sign: int) -> bool:
    """x.mul_(a).add_(y * b, alpha=sign) in one pass (that a skip leaves undone), on a GPU for
    contiguous x and y of one dtype of _KEPT_DTYPES (mixed, a NaN's payload could differ from the
    eager ops'; float64, the kernel's fp32 would round it): the eager ops make three passes over
    x and a temporary. False where the caller must run the ops itself (the CPU too: Triton's
    interpreter would run it, at some milliseconds a launch)."""
    if not (x.is_cuda and x.dtype in _KEPT_DTYPES and x.dtype == y.dtype and x.shape == y.shape
            and x.is_contiguous() and y.is_contiguous()):
        return False
    with on_device_of(x):
        launch_kept_update(skip, x, a, y, b, sign)
    torch.autograd.graph.increment_version(x)  # as an in-place op does: autograd sees x changed
    return True


def launch_kept_update(skip: torch.Tensor | None, x: torch.Tensor, a: torch.Tensor, y: torch.Tensor,
                       b: torch.Tensor | None, sign: int) -> None:
    """The launch itself, wherever Triton runs (the tests run it under the interpreter). An
    absent b or skip is passed as `a`, which the kernel then never reads: every pointer stays a
    tensor, as kept launches need."""
    n = x.numel()
    launch_kept(_kept_update_kernel, (triton.cdiv(n, _KEPT_BLOCK),), x, y, a, a if b is None else b,
                a if skip is None else skip, n, SIGN=sign, HAS_B=b is not None, HAS_SKIP=skip is not None,
                BLOCK=_KEPT_BLOCK, enable_fp_fusion=False)


def _keep_unless(skip: torch.Tensor, kept: torch.Tensor, new: torch.Tensor) -> None:
    """kept <- new, unless skip (a 0-d bool on the device): then kept keeps its bits, NaN and -0.0
    included, which no arithmetic blend by a 0/1 factor guarantees."""
    kept.copy_(torch.where(skip, kept, new))


def param_label(group: dict, position: int) -> str:
    """A parameter's name for messages: its name when the optimizer was given named parameters."""
    names = group.get("param_names")
    if names:
        return repr(names[position])
    return f"params[{position}] (shape {tuple(group['params'][position].shape)})"


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with use_muon=True, AdamW on the others.

    A group without "use_muon" gets Muon when every param in it is 2-D, AdamW otherwise; mark
    embeddings and output heads use_muon=False. Every hyperparameter can be overridden per group.
    The group's values stay python numbers, so torch LR schedulers work as usual. The defaults hold
    "betas", so OneCycleLR and CyclicLR with cycle_momentum=True cycle betas[0] (of every group; the
    AdamW groups read it) and leave the Muon groups' momentum alone.

    capturable=True keeps lr, weight_decay, momentum and betas in device tensors (see the module
    docstring); an eager step refreshes them itself, a capture wrapper calls sync_hyperparameters()
    before each replay.

    Param-group options of the Muon groups: split_sizes (None, or two or more positive sizes that
    sum to each matrix's size along split_dim) and split_dim (0 or 1) orthogonalise and scale each
    block of a fused weight on its own; split_interleaved=True takes n equal blocks that alternate
    (block k is every n-th row or column from k: gpt-oss's gate and up); transposed=True: the
    matrices are stored [in, out], and each is stepped as the layer's [out, in]; batch_ns=False runs
    Newton-Schulz one matrix at a time. A Muon group may hold 3-D params, stacks of matrices each
    stepped on its own (module docstring).

    Subclasses change the update by overriding muon_momentum (the momentum step, which returns the
    matrix to orthogonalise), split_blocks and join_blocks (its inverse), orthogonalize (scale *
    Newton-Schulz of a matrix or of a batch; given the group of the batch's first matrix) or
    adamw_update; the updates receive the group's StepScalars (0-d fp32 device tensors).
    """

    # The hyperparameters a captured step reads from device tensors, hence may change between replays.
    live_hyperparameters = ("lr", "weight_decay", "momentum", "betas")
    # The most elements one batched Newton-Schulz takes (its stack; its bf16 temporaries are about
    # as large): a bound on the step's extra memory. Its cost in speed is not yet measured
    # (docs/arms/split-muon.md, Limits).
    max_batch_elements = 1 << 27
    # Group values that say how this optimizer runs, not what it learned: a loaded checkpoint keeps
    # the loading optimizer's (a checkpoint of whole-matrix Muon resumes split, and the reverse).
    kept_on_load = ("capturable", "split_sizes", "split_dim", "split_interleaved", "transposed", "batch_ns")
    # what a group may set besides its params and how they split (a constructor's defaults)
    group_options = ("lr", "momentum", "nesterov", "weight_decay", "scale", "ns_steps", "betas", "eps", "capturable",
                     "batch_ns")

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, scale: str = "spectral", ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, capturable: bool = False):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, scale=scale,
                        ns_steps=ns_steps, betas=betas, eps=eps, capturable=capturable,
                        split_sizes=None, split_dim=0, split_interleaved=False, transposed=False, batch_ns=True)
        # Device copies of the live hyperparameters by group index; kept out of param_groups so
        # that state_dict never saves them and a load never restores stale ones.
        self._device_hyperparameters: dict[int, dict[str, torch.Tensor]] = {}
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------
    # Groups
    # ----------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        try:
            self._resolve_group(len(self.param_groups) - 1, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()  # leave the optimizer as it was
            raise

    def _resolve_group(self, index: int, group: dict) -> None:
        """Infer use_muon when absent, then validate the group."""
        params = group["params"]
        where = f"Muon: param group {index}"
        if "use_muon" not in group:
            # A group mixing shapes is most likely "everything else", which AdamW handles.
            group["use_muon"] = all(p.dim() == 2 for p in params)
        if not isinstance(group["use_muon"], bool):
            raise ValueError(f"{where}: use_muon must be True or False, not {group['use_muon']!r}")
        self._resolve_split(where, group)
        for key in ("batch_ns", "transposed"):
            if not isinstance(group[key], bool):
                raise ValueError(f"{where}: {key} must be True or False, not {group[key]!r}")
        if group["use_muon"]:
            for position, p in enumerate(params):
                if p.dim() not in (2, 3):
                    raise ValueError(
                        f"{where} has use_muon=True but {param_label(group, position)} is {p.dim()}-D: "
                        f"Muon orthogonalises matrices and 3-D stacks of them only; put it in a group with "
                        f"use_muon=False (AdamW)"
                    )
        for key in ("lr", "weight_decay"):
            if not (_is_number(group[key]) and group[key] >= 0):
                raise ValueError(
                    f"{where}: {key} must be a finite python number >= 0, not {group[key]!r} (with capturable=True "
                    f"Muon keeps its own device copy; LR schedulers set python floats)"
                )
        if not (_is_number(group["momentum"]) and 0 <= group["momentum"] < 1):
            raise ValueError(f"{where}: momentum must be a python number in [0, 1), not {group['momentum']!r}")
        if group["scale"] not in SCALE_RULES:
            raise ValueError(f"{where}: scale must be one of {SCALE_RULES}, not {group['scale']!r}")
        if not (_is_int(group["ns_steps"]) and group["ns_steps"] >= 1):
            raise ValueError(f"{where}: ns_steps must be an int >= 1, not {group['ns_steps']!r}")
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2
                and all(_is_number(beta) and 0 <= beta < 1 for beta in betas)):
            raise ValueError(f"{where}: betas must be two python numbers in [0, 1), not {betas!r}")
        if not (_is_number(group["eps"]) and group["eps"] >= 0):
            raise ValueError(f"{where}: eps must be a finite number >= 0, not {group['eps']!r}")
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(
                f"{where} holds params on {sorted(map(str, devices))}: a group's lr tensor lives on one "
                f"device, so split the group by device"
            )

    @staticmethod
    def _resolve_split(where: str, group: dict) -> None:
        """Validate split_dim and split_sizes against every param of the group; sizes become a tuple."""
        dim, sizes = group["split_dim"], group["split_sizes"]
        if not (_is_int(dim) and dim in (0, 1)):
            raise ValueError(f"{where}: split_dim must be 0 (output rows) or 1 (input columns), not {dim!r}")
        if not isinstance(group["split_interleaved"], bool):
            raise ValueError(f"{where}: split_interleaved must be True or False, not {group['split_interleaved']!r}")
        if sizes is None:
            if group["split_interleaved"]:
                raise ValueError(f"{where}: split_interleaved says how split_sizes cuts; give split_sizes too")
            return
        # before the use_muon check: a vector in the group is why use_muon was inferred False
        for position, p in enumerate(group["params"]):
            if p.dim() not in (2, 3):
                raise ValueError(
                    f"{where}: split_sizes splits matrices (or each matrix of a 3-D stack), but "
                    f"{param_label(group, position)} is {p.dim()}-D"
                )
        if not group["use_muon"]:
            raise ValueError(
                f"{where} has split_sizes but use_muon=False: only Muon orthogonalises blocks; put the fused "
                f"weight in a Muon group"
            )
        if not (isinstance(sizes, (tuple, list)) and len(sizes) >= 2):
            raise ValueError(f"{where}: split_sizes must list two or more block sizes, not {sizes!r}")
        if not all(_is_int(size) and size > 0 for size in sizes):
            raise ValueError(f"{where}: split_sizes must be positive ints, not {sizes!r}")
        group["split_sizes"] = tuple(sizes)
        if group["split_interleaved"] and len(set(sizes)) > 1:
            raise ValueError(f"{where}: split_interleaved takes every n-th row (or column) into a block, so its "
                             f"split_sizes must be equal, not {tuple(sizes)}")
        for position, p in enumerate(group["params"]):
            along = p.shape[-2:][dim]  # a 3-D param's matrices split as a 2-D param does
            if sum(sizes) != along:
                raise ValueError(
                    f"{where}: split_sizes {tuple(sizes)} sum to {sum(sizes)}, but {param_label(group, position)} "
                    f"has {along} along split_dim={dim}; every param of the group must split the same way"
                )

    # ----------------------------------------------------------------------------------------
    # Hyperparameters on the device
    # ----------------------------------------------------------------------------------------

    def sync_hyperparameters(self, keys: Iterable[str] | None = None) -> None:
        """Copy every capturable group's host values of `keys` (default: all live ones) into its
        device tensors, in place: a captured graph keeps reading the same tensors. Call it outside
        any capture; non-capturable groups have nothing to sync."""
        keys = self.live_hyperparameters if keys is None else tuple(keys)
        unknown = set(keys) - set(self.live_hyperparameters)
        if unknown:
            raise ValueError(
                f"Muon.sync_hyperparameters: {sorted(unknown)} are not live; live are {self.live_hyperparameters}"
            )
        for index, group in enumerate(self.param_groups):
            if not (group["capturable"] and group["params"]):
                continue
            tensors = self._device_hyperparameters.get(index)
            if tensors is None:
                device = group["params"][0].device
                tensors = {name: torch.zeros((), dtype=torch.float32, device=device)
                           for key in self.live_hyperparameters for name in _device_values(group, key)}
                self._device_hyperparameters[index] = tensors
            for key in keys:
                for name, value in _device_values(group, key).items():
                    tensors[name].fill_(value)

    def _step_scalars(self, index: int, group: dict, capturing: bool) -> StepScalars:
        """The group's live values: its device tensors when capturable, else made from its numbers."""
        if group["capturable"]:
            tensors = self._device_hyperparameters.get(index)
            if tensors is None:
                raise RuntimeError(
                    f"Muon: param group {index} has no device hyperparameters yet; call "
                    f"sync_hyperparameters() (or run one eager step) before capturing"
                )
        elif capturing:
            raise RuntimeError(
                f"Muon: param group {index} has capturable=False, so a CUDA graph would keep the "
                f"{', '.join(self.live_hyperparameters)} of the capture forever; construct Muon(..., capturable=True)"
            )
        else:
            # The same fill as sync_hyperparameters, so both modes compute with the same bits.
            device = group["params"][0].device
            tensors = {name: torch.full((), value, dtype=torch.float32, device=device)
                       for key in self.live_hyperparameters for name, value in _device_values(group, key).items()}
        lr = tensors["lr"]
        found_inf = getattr(self, "found_inf", None)
        return StepScalars(lr=lr, decay=1 - lr * tensors["weight_decay"], momentum=tensors["momentum"],
                           beta1=tensors["beta1"], beta2=tensors["beta2"],
                           one_minus_beta1=tensors["one_minus_beta1"], one_minus_beta2=tensors["one_minus_beta2"],
                           skip=None if found_inf is None else found_inf != 0)

    # ----------------------------------------------------------------------------------------
    # Step
    # ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        capturing = _stream_capturing()
        if not capturing:
            # Under capture the host values must not be baked in: the wrapper syncs before replays.
            self.sync_hyperparameters()
        muon_groups: list[tuple[dict, list[torch.Tensor], StepScalars]] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Muon does not support sparse gradients; use dense embeddings")
            scalars = self._step_scalars(index, group, capturing)
            if group["use_muon"]:
                muon_groups.append((group, params, scalars))
            else:
                for p in params:
                    self.adamw_update(p, p.grad, self.state[p], group, scalars)
        if muon_groups:
            # all Muon groups at once: their matrices of equal shape share a batched Newton-Schulz
            self.muon_step(muon_groups)
        return loss

    def muon_step(self, groups: list[tuple[dict, list[torch.Tensor], StepScalars]]) -> None:
        """One Muon step of each (group, its params that have grads, its scalars), in place."""
        updates = [[self.muon_momentum(p, p.grad, self.state[p], group, scalars) for p in params]
                   for group, params, scalars in groups]
        directions = self.directions([(group, group_updates) for (group, _, _), group_updates in zip(groups, updates)])
        for (group, params, scalars), group_directions in zip(groups, directions):
            for p, direction in zip(params, group_directions):
                if _kept_update(scalars.skip, p, scalars.decay, direction, scalars.lr, -1):
                    continue
                if scalars.skip is None:
                    p.mul_(scalars.decay)
                    p.sub_(direction * scalars.lr)
                else:  # the same ops; on a skip p * 1 - (+0.0), which is p, -0.0 included
                    p.mul_(torch.where(scalars.skip, 1.0, scalars.decay))
                    p.sub_(torch.where(scalars.skip, 0.0, direction * scalars.lr))

    def muon_momentum(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict,
                      scalars: StepScalars) -> torch.Tensor:
        """Advance p's momentum in place; return the matrix to orthogonalise (Nesterov's or the buffer)."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        if not _kept_update(scalars.skip, buf, scalars.momentum, grad, None, 1):
            if scalars.skip is None:
                buf.mul_(scalars.momentum).add_(grad)
            else:  # the same ops; on a skip buf * 1 + (-0.0), which is buf, -0.0 included (a NaN grad never enters)
                buf.mul_(torch.where(scalars.skip, 1.0, scalars.momentum)).add_(torch.where(scalars.skip, -0.0, grad))
        return grad.addcmul(buf, scalars.momentum) if group["nesterov"] else buf

    def split_blocks(self, update: torch.Tensor, group: dict) -> list[torch.Tensor]:
        """The blocks of update (views) that are orthogonalised on their own, in order, each as
        the layer's [out, in]: the whole matrix without a split; a 3-D update's matrices one
        after another, each split alike."""
        matrices = update.unbind(0) if update.dim() == 3 else (update,)
        sizes, dim = group["split_sizes"], group["split_dim"]
        if sizes is None:
            blocks = list(matrices)
        elif group["split_interleaved"]:  # block k: rows (columns) k, k + n, k + 2n, ...
            n = len(sizes)
            blocks = [matrix.unflatten(dim, (sizes[0], n)).select(dim + 1, k) for matrix in matrices for k in range(n)]
        else:
            blocks = [block for matrix in matrices for block in matrix.split(sizes, dim=dim)]
        # stored [in, out]: the scale must read the layer's out x in
        return [block.mT for block in blocks] if group["transposed"] else blocks

    def join_blocks(self, directions: list[torch.Tensor], update: torch.Tensor, group: dict) -> torch.Tensor:
        """split_blocks' inverse: the blocks' directions as one of update's shape."""
        if not directions:  # a stack of no matrices
            return torch.zeros_like(update)
        if group["transposed"]:
            directions = [direction.mT for direction in directions]
        if len(directions) == 1:
            return directions[0] if update.dim() == 2 else directions[0].unsqueeze(0)
        per_matrix = len(directions) // (update.shape[0] if update.dim() == 3 else 1)
        dim = group["split_dim"]
        if per_matrix == 1:
            matrices = directions
        elif group["split_interleaved"]:
            matrices = [torch.stack(directions[i:i + per_matrix], dim=dim + 1).flatten(dim, dim + 1)
                        for i in range(0, len(directions), per_matrix)]
        else:
            matrices = [torch.cat(directions[i:i + per_matrix], dim=dim) for i in range(0, len(directions), per_matrix)]
        return torch.stack(matrices) if update.dim() == 3 else matrices[0]

    def directions(self, work: list[tuple[dict, list[torch.Tensor]]]) -> list[list[torch.Tensor]]:
        """For each (group, updates), each update's direction, of its shape: every block orthogonalised
        and scaled on its own. Matrices that agree in shape, dtype, device, ns_steps and scale rule
        are orthogonalised as one batch, across groups, in order: groups, params, blocks. A
        parameter is joined as soon as its last block is done, and its blocks let go, so a batch's
        output is freed once every parameter in it is joined (a split or stacked one is a copy)."""
        blocks = [[self.split_blocks(update, group) for update in updates] for group, updates in work]
        oriented = [[[None] * len(parts) for parts in group_blocks] for group_blocks in blocks]
        waiting = [[len(parts) for parts in group_blocks] for group_blocks in blocks]
        joined = [[self.join_blocks([], update, group) if not parts else None for parts, update in zip(group_blocks, updates)]
                  for group_blocks, (group, updates) in zip(blocks, work)]

        def done(g: int, i: int, j: int, direction: torch.Tensor) -> None:
            oriented[g][i][j] = direction
            waiting[g][i] -= 1
            if waiting[g][i] == 0:
                group, updates = work[g]
                joined[g][i] = self.join_blocks(oriented[g][i], updates[i], group)
                oriented[g][i] = None

        batches: dict[tuple, list[tuple[int, int, int]]] = {}
        for g, (group, _) in enumerate(work):
            for i, parts in enumerate(blocks[g]):
                for j, block in enumerate(parts):
                    if group["batch_ns"]:
                        key = (block.shape, block.dtype, block.device, group["ns_steps"], group["scale"])
                        batches.setdefault(key, []).append((g, i, j))
                    else:
                        done(g, i, j, self.orthogonalize(block, group))
        for members in batches.values():
            g, i, j = members[0]
            per_batch = max(1, self.max_batch_elements // blocks[g][i][j].numel())
            for start in range(0, len(members), per_batch):
                chunk = members[start:start + per_batch]
                # stack copies: every matrix enters the bmm contiguous, whatever view it came from;
                # the members' groups agree on everything orthogonalize reads
                stacked = torch.stack([blocks[g][i][j] for g, i, j in chunk])
                batch = self.orthogonalize(stacked, work[chunk[0][0]][0])
                del stacked  # freed before the joins below copy out of the batch
                for k, (g, i, j) in enumerate(chunk):
                    done(g, i, j, batch[k])
                del batch  # freed before the next chunk's stack, unless a param still holds a view
        return joined

    def orthogonalize(self, update: torch.Tensor, group: dict) -> torch.Tensor:
        """scale * newton_schulz(update), a new tensor, for a matrix or a 3-D batch of equal-shaped
        ones: the direction a Muon step takes, scaled by the matrix's own shape."""
        rows, cols = update.shape[-2:]
        return newton_schulz(update, group["ns_steps"]).mul_(muon_scale(rows, cols, group["scale"]))

    def adamw_update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict,
                     scalars: StepScalars) -> None:
        """One AdamW step of p, in place; bias correction is computed on the device."""
        if not state:
            # A device step count in both modes: the same bias-correction kernels, captured or not.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
        skip = scalars.skip
        if skip is None:
            step.add_(1)
            new_p, new_avg, new_sq = p, exp_avg, exp_avg_sq
        else:  # the same ops on copies, kept only where the step is not skipped; the count stays
            step.add_((~skip).to(step.dtype))
            new_p, new_avg, new_sq = p.clone(), exp_avg.clone(), exp_avg_sq.clone()
        new_p.mul_(scalars.decay)
        new_avg.lerp_(grad, scalars.one_minus_beta1)
        # addcmul_'s factor is a host number (a tensor one is read back with item()), so scale a copy
        new_sq.mul_(scalars.beta2).addcmul_(grad, grad * scalars.one_minus_beta2)
        bias_correction1 = 1 - scalars.beta1**step
        bias_correction2 = 1 - scalars.beta2**step
        denom = (new_sq.sqrt() / bias_correction2.sqrt()).add_(group["eps"])
        new_p.sub_(new_avg.div(denom).mul_(scalars.lr / bias_correction1))
        if skip is not None:
            for kept, new in ((p, new_p), (exp_avg, new_avg), (exp_avg_sq, new_sq)):
                _keep_unless(skip, kept, new)

    # ----------------------------------------------------------------------------------------
    # Checkpoints
    # ----------------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_state_shapes(state_dict)
        kept = [{key: group[key] for key in self.kept_on_load} for group in self.param_groups]
        super().load_state_dict(state_dict)
        for index, (group, values) in enumerate(zip(self.param_groups, kept)):
            group.update(values)
            self._resolve_group(index, group)
        # The base class moves "step" to the param's device only for groups saved as capturable;
        # both modes compute bias correction there.
        for p, state in self.state.items():
            if "step" in state:
                state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def _check_state_shapes(self, state_dict: dict) -> None:
        """Each saved momentum or moment the shape of the param it goes to, checked before anything
        loads: saved from another model, it would otherwise fail at the next step, mid-update.
        Other mismatches (group counts and sizes) are the base class's to name."""
        saved_groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            return
        saved_state = state_dict.get("state", {})
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            ids = saved.get("params", []) if isinstance(saved, dict) else []
            if len(ids) != len(group["params"]):
                return
            for position, (key, p) in enumerate(zip(ids, group["params"])):
                for name, value in saved_state.get(key, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape != p.shape:
                        raise ValueError(
                            f"Muon.load_state_dict: the saved {name} for param group {index}'s "
                            f"{param_label(group, position)} is {tuple(value.shape)}: the state was saved for "
                            f"another model or another parameter order; nothing was loaded"
                        )
