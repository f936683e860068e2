"""What a gate declares: presets, buffers, reference, arm, truth, parity per output, saboteurs,
contenders, bench cases and the performance criterion.

A gate file (gates/<name>.py) builds one `Gate` from these pieces; the harness reads only this
data, so adding an arm never touches the harness. Every timed implementation is one
`Contender`, declared once: its name is what criteria, reports and baselines call it.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch

from suite.errors import UsageError
from suite.harness.criteria import Criterion
from suite.harness.criteria import problems as criteria_problems
from suite.harness.results import CeilingKind, Check, Role, TimingMode

Buffers = dict[str, torch.Tensor]
Outputs = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Preset:
    """A named shape. `where="any"` presets run anywhere (the CPU included, Triton interpreted)."""

    name: str
    params: Mapping[str, Any]
    where: Literal["any", "cuda"] = "cuda"
    standard: bool = True  # run when no --preset is given on a device that can run it
    # False: a standard preset that a run of every gate (`suite run`, `gate all`) leaves out, to
    # stay within the CI budget; `suite gate/bench NAME` still runs it
    in_all: bool = True
    memory_bytes: int = 0  # peak device memory the gate needs for this preset, bench included
    note: str = ""


@dataclass(frozen=True)
class Bitwise:
    """The arm must reproduce the reference bit for bit (integers: value for value)."""

    kind: Literal["bitwise"] = "bitwise"


@dataclass(frozen=True)
class Tolerance:
    """Arm error vs a float64 truth <= k x the reference's own error + floor.

    Two relative errors are judged: over the whole tensor (L2 norm of the difference over
    the truth's norm) and for the worst row (the same ratio per row of the last dimension),
    so an error confined to small-magnitude rows is not hidden by the large ones.

    row_floor: a row's error is taken relative to at least row_floor x the RMS of the truth's
    row norms. For outputs whose rows are a few dot products (MoE's probability gradient,
    [T, k]) some rows cancel to near zero, where the arm's and the reference's relative errors
    are two independent draws of rounding noise over a tiny number; 0 judges every row by its
    own norm.
    """

    k: float = 2.0
    floor: float = 1e-6
    row_floor: float = 0.0
    kind: Literal["tolerance"] = "tolerance"


Parity = Bitwise | Tolerance


@dataclass(frozen=True)
class Saboteur:
    """A known-bad variant of the arm. The gate must fail it, by the check `caught_by` names."""

    name: str
    description: str
    fn: Callable[[Buffers, Preset], Outputs]
    caught_by: Check = Check.PARITY
    # presets on which the sabotage can show at all (a no-op there proves nothing)
    applies: Callable[[Preset], bool] = lambda preset: True


@dataclass(frozen=True)
class BenchCase:
    """What one timed call is, how it is timed, and how much it must move and compute.

    Modes: "graph" times replays of the call captured in a CUDA graph (device time, one call
    per event pair, the L2 flushed before each when cold); "eager" times windows of `window`
    back-to-back plain calls per event pair (what an eager loop pays, the host's dispatch
    included; a cold case rotates through copies of the inputs instead of flushing); "wall"
    times windows with the host's clock, for arms that are not CUDA kernels (any machine).
    """

    name: str  # e.g. "fwd", "fwd+bwd", "step"
    description: str
    bytes: Callable[[Preset], int]  # fewest bytes through device memory per call
    flops: Callable[[Preset], int] = lambda preset: 0
    ceiling: CeilingKind = "copy"  # what fraction-of-ceiling figures are of
    l2: Literal["cold", "warm"] = "cold"
    modes: tuple[TimingMode, ...] = ("graph", "eager")
    window: int = 5  # calls per timed window in eager and wall modes
    gpu_busy: bool = False  # also report the GPU's busy time per call (host-bound steps)
    calls_per_round: int | None = None  # timings a round, overriding the run's policy (long steps)
    # the most rounds, overriding the run's policy: calls of seconds (a 5 GB save) cannot afford
    # the extension to 40; a comparison still ambiguous at the cap is reported so, never a pass
    max_rounds: int | None = None
    cold_calls: int = 1  # calls the cold figure covers (a captured step captures on call 4)
    # each contender's build timed, with the device memory it holds at its peak: a build that runs
    # the first calls itself (compile, capture) reports them apart from the timed calls
    setup: bool = False
    # a recommendation per contender: faster than its baseline beyond the noise floor, or not
    recommend: bool = False
    presets: tuple[str, ...] | None = None  # the presets it is timed at (None: every one)
    # built and timed on a CUDA stream of its own: a backward whose forward ran at build time runs
    # on that forward's stream, so building it there keeps each eager backward on the stream its
    # timing's events are on, as a user's loop keeps it (crossing from the legacy default stream
    # each call left the device idle between kernels: docs/judging.md, "A stream of its own")
    own_stream: bool = False


@dataclass(frozen=True)
class Contender:
    """One implementation timed in a gate's benches, declared once.

    `build(case, buffers, preset)` returns a zero-argument callable: one timed call (it may
    carry a `note` attribute, a string the report prints beside its timing: what its setup saw).
    `unavailable(device)` returns None when it can run there, else why not. `baseline`: the
    contender a recommendation judges it against (None: the reference).
    """

    name: str
    role: Role
    build: Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]
    unavailable: Callable[[torch.device], str | None] = lambda device: None
    note: str = ""
    cases: tuple[str, ...] | None = None  # the bench cases it is timed in (None: all)
    baseline: str | None = None
    # presets it is not timed at: where a model per contender would not fit beside the others
    skip_presets: tuple[str, ...] = ()

    def timed_in(self, case: BenchCase, preset: Preset | None = None) -> bool:
        return ((self.cases is None or case.name in self.cases)
                and (preset is None or preset.name not in self.skip_presets))


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
    parity: Parity  # every output's mode unless parity_by_output names it
    # fnmatch pattern of output names -> its mode (exact routing integers beside tolerance-judged
    # gradients); the first matching pattern wins
    parity_by_output: Mapping[str, Parity] = field(default_factory=dict)
    required_buffers: tuple[str, ...] = ()  # names make_buffers produces and loaded buffers must hold
    # the preset params that follow from loaded buffers themselves (shapes, dtypes)
    buffer_params: Callable[[Buffers], dict[str, Any]] = lambda buffers: {}
    # float64 truth, required when any output is judged in tolerance mode
    truth: Callable[[Buffers, Preset], Outputs] | None = None
    saboteurs: tuple[Saboteur, ...] = ()
    contenders: tuple[Contender, ...] = ()
    benches: tuple[BenchCase, ...] = ()
    criteria: tuple[Criterion, ...] = ()  # suite.harness.criteria: what a bench must show
    # a preset (tiny shape) on which every contender's host time per call is measured
    host_probe: str | None = None
    nondeterministic: str | None = None  # why the arm may differ run to run, if it may
    # why this installation cannot run the gate (an optional extra missing), else None: `suite
    # run` lists it as skipped, a run that names it says it could not run
    missing: Callable[[], str | None] = lambda: None

    def preset(self, name: str) -> Preset:
        for p in self.presets:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.presets)
        raise UsageError(f"gate {self.name!r} has no preset {name!r}; its presets are: {known}")

    def default_presets(self, device: torch.device, all_gates: bool = False) -> list[Preset]:
        """The presets run without --preset: the standard ones; of those, with all_gates (every
        gate in one run), the ones that fit the CI budget."""
        where = "cuda" if device.type == "cuda" else "any"
        chosen = [p for p in self.presets if p.where == where and p.standard]
        return [p for p in chosen if p.in_all] if all_gates else chosen

    def runnable_presets(self, device: torch.device) -> list[Preset]:
        """Every preset this device can run, smallest first (by declared memory, then order)."""
        ok = [p for p in self.presets if p.where == "any" or device.type == "cuda"]
        return sorted(ok, key=lambda p: p.memory_bytes)

    def parity_for(self, output: str) -> Parity:
        for pattern, mode in self.parity_by_output.items():
            if fnmatch.fnmatchcase(output, pattern):
                return mode
        return self.parity

    def contenders_for(self, case: BenchCase, preset: Preset | None = None) -> list[Contender]:
        """The contenders timed in `case`, at `preset` when given."""
        return [c for c in self.contenders if c.timed_in(case, preset)]

    def __post_init__(self) -> None:
        where = f"gate {self.name!r}"
        modes = [self.parity, *self.parity_by_output.values()]
        if any(isinstance(m, Tolerance) for m in modes) and self.truth is None:
            raise ValueError(f"{where}: tolerance parity needs a float64 truth")
        names = [c.name for c in self.contenders]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: contender names must be unique, got {names}")
        for c in self.contenders:
            if c.baseline is not None and (c.baseline not in names or c.baseline == c.name):
                raise ValueError(f"{where}: contender {c.name!r} has baseline {c.baseline!r}, not another contender")
        presets = {p.name for p in self.presets}
        for case in self.benches:
            if case.presets is not None and not set(case.presets) <= presets:
                raise ValueError(f"{where}: bench case {case.name!r} names presets the gate lacks: {case.presets}")
        for c in self.contenders:
            if not set(c.skip_presets) <= presets:
                raise ValueError(f"{where}: contender {c.name!r} skips presets the gate lacks: {c.skip_presets}")
        if self.host_probe is not None and self.host_probe not in presets:
            raise ValueError(f"{where}: host_probe names no preset: {self.host_probe!r}")
        for case in self.benches:
            for preset in (None, *self.presets):  # every preset's contenders, and a recorded one's
                timed = self.contenders_for(case, preset)
                for role in ("reference", "arm"):
                    if sum(c.role == role for c in timed) != 1:
                        at = f" at preset {preset.name!r}" if preset is not None else ""
                        raise ValueError(f"{where}: bench case {case.name!r} needs exactly one {role} contender{at}")
            if case.window < 1 or case.cold_calls < 1:
                raise ValueError(f"{where}: bench case {case.name!r} needs window and cold_calls >= 1")
        modes_of = {b.name: b.modes for b in self.benches}
        peers_of = {b.name: {c.name for c in self.contenders_for(b) if c.role != "arm"} for b in self.benches}
        unknown = criteria_problems(self.criteria, presets, modes_of, peers_of)
        if unknown:  # a typo found at import, not after minutes of timing
            raise ValueError(f"{where}: the criterion names what the gate does not have: {', '.join(unknown)}")
