"""The experts' activation, a gated linear unit act(gate) * up: SwiGLU, silu(gate) * up, and
the clamped SwiGLU some models train with (DeepSeek-V4, HY-V4, GLM-5, Step-3, Bailing): with a
limit L, up is clamped to [-L, L] and the gate to at most L, either before silu (clamp="gate")
or silu's output after it (clamp="silu"). A clamped value passes no gradient, as torch's clamp
passes none past a bound (at the bound it passes it). GeGLU, gelu(gate) * up with gelu's tanh
form (Gemma 4's experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CLAMPS = ("gate", "silu")


@dataclass(frozen=True)
class SwiGLU:
    """limit: None for plain SwiGLU, else the clamp's bound (a finite float > 0); clamp: what
    the gate's bound applies to, "gate" (silu(min(g, L))) or "silu" (min(silu(g), L))."""

    limit: float | None = None
    clamp: str = "gate"

    def __post_init__(self):
        if self.clamp not in CLAMPS:
            raise ValueError(f"SwiGLU: clamp must be one of {CLAMPS}, not {self.clamp!r}")
        if self.limit is None:
            return
        if isinstance(self.limit, bool) or not isinstance(self.limit, (int, float)):
            raise TypeError(f"SwiGLU: limit must be a float or None, got {type(self.limit).__name__}")
        if not (math.isfinite(self.limit) and self.limit > 0):
            raise ValueError(f"SwiGLU: limit must be finite and > 0 (or None for no clamp), not {self.limit}")
        object.__setattr__(self, "limit", float(self.limit))

    @property
    def mode(self) -> int:
        """The kernels' ACT: 0 no clamp, 1 the gate clamped before silu, 2 silu's output."""
        return 0 if self.limit is None else 1 + CLAMPS.index(self.clamp)

    @property
    def kernel_limit(self) -> float:
        """The kernels' LIMIT: the bound, read by none of them without a clamp (then 0)."""
        return 0.0 if self.limit is None else self.limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activation in torch ops (any dtype; autograd through torch's clamp and silu)."""
        if self.limit is None:
            return F.silu(gate) * up
        up = up.clamp(-self.limit, self.limit)
        if self.clamp == "gate":
            return F.silu(gate.clamp(max=self.limit)) * up
        return F.silu(gate).clamp(max=self.limit) * up

    def backward(self, d_a: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate, d up) in closed form, no autograd (the float64 truth's); torch's clamp
        gradient: passed where the value is within its bounds, the bounds included."""
        if self.limit is None:
            sig = torch.sigmoid(gate)
            return d_a * up * sig * (1 + gate * (1 - sig)), d_a * gate * sig
        limit, zero = self.limit, torch.zeros((), dtype=d_a.dtype, device=d_a.device)
        up_passes = (up >= -limit) & (up <= limit)
        up = up.clamp(-limit, limit)
        if self.clamp == "gate":
            gate_passes, gate = gate <= limit, gate.clamp(max=limit)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        if self.clamp == "silu":
            gate_passes, silu = silu <= limit, silu.clamp(max=limit)
        d_gate = torch.where(gate_passes, d_a * up * sig * (1 + gate * (1 - sig)), zero)
        return d_gate, torch.where(up_passes, d_a * silu, zero)


# gelu's tanh form, x * sigmoid(2 z) with z = sqrt(2 / pi) * (x + 0.044715 x^3): the same
# function as 0.5 x (1 + tanh(z)), without a tanh the kernels lack
GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715


@dataclass(frozen=True)
class GeGLU:
    """gelu(gate, approximate="tanh") * up: transformers' "gelu_pytorch_tanh" and "gelu_new"."""

    limit = None  # never clamped

    @property
    def mode(self) -> int:
        """The kernels' ACT."""
        return 3

    @property
    def kernel_limit(self) -> float:
        return 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh") * up

    def backward(self, d_a: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d gate, d up) in closed form, no autograd (the float64 truth's)."""
        inner = GELU_TANH_SCALE * (gate + GELU_TANH_CUBIC * gate ** 3)
        tanh = torch.tanh(inner)
        d_inner = GELU_TANH_SCALE * (1 + 3 * GELU_TANH_CUBIC * gate ** 2)
        d_gelu = 0.5 * (1 + tanh) + 0.5 * gate * (1 - tanh ** 2) * d_inner
        return d_a * up * d_gelu, d_a * 0.5 * gate * (1 + tanh)


GatedActivation = SwiGLU | GeGLU
PLAIN = SwiGLU()
GELU_TANH = GeGLU()


def activation_of(mode: int, limit: float) -> GatedActivation:
    """The activation whose kernels' `mode` this is, with this limit (the custom ops carry
    the two)."""
    if mode == GELU_TANH.mode:
        return GELU_TANH
    return PLAIN if mode == 0 else SwiGLU(limit, CLAMPS[mode - 1])


def as_activation(activation, fn: str) -> GatedActivation:
    """activation as the experts take it: None is plain SwiGLU; anything else not a SwiGLU or
    GeGLU is a TypeError."""
    if activation is None:
        return PLAIN
    if not isinstance(activation, (SwiGLU, GeGLU)):
        raise TypeError(f"{fn}: activation must be a suite.arms.moe.SwiGLU or GeGLU (or None), got "
                        f"{type(activation).__name__}")
    return activation
