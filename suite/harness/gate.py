"""What a gate declares: presets, buffers, reference, arm, truth, peers, benches, saboteurs.

A gate file (gates/<name>.py) builds one `Gate` from these pieces; the harness reads only
this data, so adding an arm never touches the harness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch

from suite.errors import UsageError

Buffers = dict[str, torch.Tensor]
Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Preset:
    """A named shape. `tiny` presets run anywhere (the CPU included, Triton interpreted)."""

    name: str
    params: Mapping[str, Any]
    where: Literal["any", "cuda"] = "cuda"
    standard: bool = True  # run when no --preset is given on a device that can run it
    memory_bytes: int = 0  # peak device memory the gate needs for this preset, bench included
    note: str = ""


@dataclass(frozen=True)
class Bitwise:
    """Arm must reproduce the reference bit for bit."""

    kind: Literal["bitwise"] = "bitwise"


@dataclass(frozen=True)
class Tolerance:
    """Arm error vs a float64 truth <= k x the reference's own error + floor, per output.

    Two relative errors are judged: over the whole tensor (L2 norm of the difference over
    the truth's norm) and for the worst row (the same ratio per row of the last dimension),
    so an error confined to small-magnitude rows is not hidden by the large ones.
    """

    k: float = 2.0
    floor: float = 1e-6
    kind: Literal["tolerance"] = "tolerance"


Parity = Bitwise | Tolerance


@dataclass(frozen=True)
class Saboteur:
    """A known-bad variant of the arm. The gate must fail it; `caught_by` says which check."""

    name: str
    description: str
    fn: Callable[[Buffers, Preset], Outputs]
    caught_by: Literal["parity", "determinism", "poison", "inputs"] = "parity"
    # presets on which the sabotage can show at all (a no-op there proves nothing)
    applies: Callable[[Preset], bool] = lambda preset: True


@dataclass(frozen=True)
class Peer:
    """An implementation a user would pick instead of the arm.

    `unavailable(device)` returns None when the peer can run there, else the reason.
    """

    name: str
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    note: str = ""


@dataclass(frozen=True)
class BenchCase:
    """What one timed call is, and how much it must move and compute."""

    name: str  # e.g. "fwd", "fwd+bwd", "step"
    description: str
    bytes: Callable[[Preset], int]  # fewest bytes through device memory per call
    flops: Callable[[Preset], int] = lambda preset: 0
    l2: Literal["cold", "warm"] = "cold"
    host_bound: bool = False  # time a window of calls with one event pair (dispatch included)
    window: int = 1
    # time CUDA-graph replays of the call: device time, without the host's dispatch gaps
    # (kernel benches whose Python launch cost would otherwise be what is measured)
    graph: bool = False
    calls_per_round: int | None = None  # overrides the run's policy (long host-bound steps)
    cold_calls: int = 1  # calls the cold figure covers (a captured step captures on call 4)
    peers: tuple[str, ...] | None = None  # the gate's peers timed in this case (None: all)


@dataclass(frozen=True)
class PerfCriterion:
    """When a bench passes: never slower than the reference or the named peers beyond the
    noise floor, at least the given fraction of the measured ceiling, at least the given
    speedup over the reference.

    `min_ceiling_fraction` maps (preset name, case name) to the fraction of copy bandwidth
    (memory-bound cases) or bf16 GEMM rate (compute-bound cases) the arm must reach.
    """

    not_slower_than: tuple[str, ...] = ("reference",)
    min_ceiling_fraction: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # (preset name, case name) -> the least median speedup of the arm over the reference
    min_speedup: Mapping[tuple[str, str], float] = field(default_factory=dict)
    ceiling: Literal["copy", "gemm"] = "copy"


@dataclass(frozen=True)
class Gate:
    name: str
    summary: str
    arm_name: str
    needs_cuda: bool
    presets: tuple[Preset, ...]
    make_buffers: Callable[[Preset, int, torch.device], Buffers]
    reference: Callable[[Buffers, Preset], Outputs]
    arm: Callable[[Buffers, Preset], Outputs]
    parity: Parity
    required_buffers: tuple[str, ...] = ()  # names make_buffers produces and loaded buffers must hold
    # the preset params that follow from loaded buffers themselves (shapes, dtypes)
    buffer_params: Callable[[Buffers], dict[str, Any]] = lambda buffers: {}
    # float64 truth, required by Tolerance parity
    truth: Callable[[Buffers, Preset], Outputs] | None = None
    saboteurs: tuple[Saboteur, ...] = ()
    peers: tuple[Peer, ...] = ()
    benches: tuple[BenchCase, ...] = ()
    # (case, implementation name, buffers, preset) -> a zero-argument callable, one timed call.
    # implementation name is "reference", "arm" or a peer's name.
    bench_callable: Callable[[BenchCase, str, Buffers, Preset], Callable[[], Any]] | None = None
    perf: PerfCriterion = field(default_factory=PerfCriterion)
    nondeterministic: str | None = None  # why the arm may differ run to run, if it may

    def preset(self, name: str) -> Preset:
        for p in self.presets:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.presets)
        raise UsageError(f"gate {self.name!r} has no preset {name!r}; its presets are: {known}")

    def default_presets(self, device: torch.device) -> list[Preset]:
        if device.type == "cuda":
            return [p for p in self.presets if p.where == "cuda" and p.standard]
        return [p for p in self.presets if p.where == "any" and p.standard]

    def __post_init__(self) -> None:
        if isinstance(self.parity, Tolerance) and self.truth is None:
            raise ValueError(f"gate {self.name!r}: tolerance parity needs a float64 truth")
        if self.benches and self.bench_callable is None:
            raise ValueError(f"gate {self.name!r}: benches declared without bench_callable")
