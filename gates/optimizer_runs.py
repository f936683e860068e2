"""The runs the optimizer gates share: a training loop over saved gradient sets, its scenarios, and a
float64 Muon to judge against. Not a gate itself (gates/__init__.py lists those).

train() runs K steps from saved initial parameters through K saved gradient sets, stepping the
optimizer eagerly (the reference) or through a wrapper (the arm, e.g. CapturedOptimizer), and
reduces each step's parameters to a position-weighted checksum of their bits, so the first output
that differs names the step and tensor where two runs diverged; the final parameters are kept
whole, for the index and ULP distance.

Scenarios:
- constant: a constant lr.
- schedule: warm-up + cosine lr (an 8x swing) through LambdaLR on the stepper (the wrapper).
- wd-change: weight decay raised tenfold at K/2.
- resume: state_dict at K/2 loaded into fresh optimizers, then continued.
- onecycle: OneCycleLR with cycle_momentum=True on the stepper: lr and momentum change every step.
  Muon's defaults hold "betas", so it cycles betas[0] of every group (read by the AdamW group).
- onecycle-lr: OneCycleLR with cycle_momentum=False: lr only.

torch's AdamW reads weight_decay and betas as host numbers, which a captured step cannot follow
(CapturedOptimizer refuses the change; the tests prove it), so its kinds run neither wd-change nor
onecycle: their one-cycle scenario is onecycle-lr.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from suite.arms.muon import NS_COEFFICIENTS, Muon
from suite.harness.gate import Buffers, Outputs
from suite.harness.parity import bits_checksums

MUON_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 3e-4, 0.01
ADAMW_BETAS = (0.9, 0.95)
SCENARIOS = {
    "muon": ("constant", "schedule", "wd-change", "resume", "onecycle"),
    "adamw": ("constant", "schedule", "resume", "onecycle-lr"),
    "adamw-fused": ("constant", "schedule", "resume", "onecycle-lr"),
}

# (optimizer, params by name) -> what train() steps: the optimizer wrapped, e.g. CapturedOptimizer.
Wrap = Callable[[torch.optim.Optimizer, dict[str, torch.Tensor]], torch.optim.Optimizer]


def param_names(buffers: Buffers) -> list[str]:
    return [k.removeprefix("param/") for k in buffers if k.startswith("param/")]


def fresh_params(buffers: Buffers) -> dict[str, torch.Tensor]:
    """A copy of the saved initial parameters, by name, that an optimizer may step."""
    return {n: buffers[f"param/{n}"].clone().requires_grad_() for n in param_names(buffers)}


def set_saved_grads(params: dict[str, torch.Tensor], buffers: Buffers, step: int) -> None:
    """Step `step`'s gradients from the stacked sets `grads/<name>`, taken in turn (a large preset
    saves a few), written in place once a grad exists: a captured step reads the grad tensors it
    saw at capture."""
    for name, p in params.items():
        sets = buffers[f"grads/{name}"]
        if p.grad is None:
            p.grad = sets[step % sets.shape[0]].clone()
        else:
            p.grad.copy_(sets[step % sets.shape[0]])


def flat_params(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every parameter in one flat tensor: one bitwise output for a whole run."""
    return torch.cat([p.detach().reshape(-1) for p in params.values()])


def make_optimizer(kind: str, params: dict[str, torch.Tensor], capturable: bool) -> torch.optim.Optimizer:
    """Muon on the matrices with AdamW on the vectors ("muon"), or torch AdamW ("adamw": foreach,
    torch's default; "adamw-fused")."""
    matrices = [p for p in params.values() if p.dim() == 2]
    vectors = [p for p in params.values() if p.dim() == 1]
    if kind == "muon":
        return Muon([{"params": matrices, "use_muon": True}, {"params": vectors, "use_muon": False, "lr": ADAMW_LR}],
                    lr=MUON_LR, weight_decay=WEIGHT_DECAY, betas=ADAMW_BETAS, capturable=capturable)
    # eager and captured AdamW differ only in the graph: both capturable, both with a tensor lr
    lr = torch.tensor(ADAMW_LR, device=matrices[0].device)
    implementation = {"adamw": dict(foreach=True), "adamw-fused": dict(fused=True)}[kind]
    return torch.optim.AdamW(matrices + vectors, lr=lr, weight_decay=WEIGHT_DECAY, betas=ADAMW_BETAS,
                             capturable=True, **implementation)


def lambda_schedule(steps: int) -> Callable[[int], float]:
    """The schedule scenario's lr factor: 1/8 -> 1 over a warm-up of steps/4, then cosine back to 1/8."""
    warm = max(1, steps // 4)

    def factor(step: int) -> float:
        if step < warm:
            return 0.125 + 0.875 * step / warm
        progress = (step - warm) / max(1, steps - warm)
        return 0.125 + 0.875 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_scheduler(scenario: str, stepper: torch.optim.Optimizer, steps: int):
    """The scenario's LR scheduler on `stepper`, or None."""
    lr_scheduler = torch.optim.lr_scheduler
    if scenario == "schedule":
        return lr_scheduler.LambdaLR(stepper, lambda_schedule(steps))
    if scenario in ("onecycle", "onecycle-lr"):
        # each group peaks at its own configured lr (float() of a tensor lr reads it once, here)
        max_lr = [float(group["lr"]) for group in stepper.param_groups]
        return lr_scheduler.OneCycleLR(stepper, max_lr=max_lr, total_steps=steps,
                                       cycle_momentum=scenario == "onecycle")
    return None


def train(kind: str, scenario: str, buffers: Buffers, steps: int, wrap: Wrap | None = None,
          swap_grads: bool = False) -> Outputs:
    """`steps` steps from the saved initial params; wrap=None steps the optimizer eagerly.
    swap_grads: a fresh grad tensor each step (as zero_grad(set_to_none=True) + backward)."""
    params = {n: buffers[f"param/{n}"].clone().requires_grad_() for n in param_names(buffers)}
    for p in params.values():
        p.grad = torch.zeros_like(p)

    def build():
        optimizer = make_optimizer(kind, params, capturable=wrap is not None)
        stepper = optimizer if wrap is None else wrap(optimizer, params)
        return stepper, make_scheduler(scenario, stepper, steps)

    stepper, scheduler = build()
    prefix = f"{kind}-{scenario}"
    outputs: Outputs = {}
    for step in range(steps):
        for n, p in params.items():
            grad = buffers[f"grad{step:02d}/{n}"]
            if swap_grads:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
        stepper.step()
        if scheduler is not None:
            scheduler.step()
        for n, checksum in zip(params, bits_checksums(list(params.values()))):
            outputs[f"{prefix}/step{step:02d}/{n}"] = checksum
        if step == steps // 2 - 1 and scenario == "wd-change":
            for group in stepper.param_groups:
                group["weight_decay"] = 10 * WEIGHT_DECAY
        if step == steps // 2 - 1 and scenario == "resume":
            state = stepper.state_dict()
            stepper, scheduler = build()
            stepper.load_state_dict(state)
    for n, p in params.items():
        outputs[f"{prefix}/final/{n}"] = p.detach()
    return outputs


# ---- a float64 Muon: the truth the optimizer gates' tolerance parity and the tests judge against ----


def newton_schulz_float64(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Jordan's quintic iteration in float64 on the Frobenius-normalised G (tall G: on its transpose)."""
    a, b, c = NS_COEFFICIENTS
    X = G.double() / G.double().norm()
    if X.shape[0] > X.shape[1]:
        return newton_schulz_float64(G.T, steps).T
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X


def muon_float64(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, momentum: float, nesterov: bool,
                 weight_decay: float, rule: str, ns_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """len(grads) Muon steps of the matrix p0 in float64: (final params, momentum buffer)."""
    p = p0.double().clone()
    m = torch.zeros_like(p)
    rows, cols = p.shape
    scale = max(1, rows / cols) ** 0.5 if rule == "spectral" else 0.2 * max(rows, cols) ** 0.5
    for g in grads:
        g = g.double()
        m = momentum * m + g
        u = g + momentum * m if nesterov else m
        p = p * (1 - lr * weight_decay) - lr * scale * newton_schulz_float64(u, ns_steps)
    return p, m
