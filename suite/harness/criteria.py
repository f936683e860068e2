"""A bench's criteria: small objects that say where they apply, check what they name against
the gate that declares them, and judge the rounds of one bench case in one timing mode.

Each is decided by its CI against the noise floor (`stats.reaches` / `stays_within`): a pass
where the CI reaches the bar within the floor, a fail where the CI and the figure fall beyond
both, else undecided, and the bench times more rounds (docs/judging.md). An aim (`Target`) is
reported met or missed and never fails a bench nor asks for rounds. The bars' figures and why
each is where it is: docs/tuning.md.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import numpy as np

from suite.harness.results import BenchResult, CeilingKind, Ceilings, Comparison, TimingMode
from suite.harness.stats import Decision, median_ratio, reaches, stays_within, throughput


@dataclass
class Rounds:
    """What a bench's criteria are judged on: its rounds so far."""

    case: str
    ceiling: CeilingKind
    nbytes: float | None
    flops: float | None
    reference: str
    arm: str
    series: Mapping[str, Sequence[float]]  # each timed contender's figure a round, ms
    comparisons: Mapping[str, Comparison]  # the arm against each other contender, by its name
    floor_log: float  # the reference's A/A floor, log space
    unavailable: Mapping[str, str]  # contenders that cannot run on this device, and why
    dropped: Mapping[str, str]  # peers that failed here (first call or capture), and why
    busy: Mapping[str, float]  # device-busy ms a call, where the case measures it
    ceilings: Ceilings | None
    graph: BenchResult | None  # in eager mode, the same case's graph-mode result
    n_boot: int
    ci_level: float
    seed: int

    def ratio(self, num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float]:
        # same figures and seed, same intervals
        return median_ratio(num, den, self.n_boot, self.ci_level, np.random.default_rng(self.seed))


@dataclass(frozen=True, kw_only=True)
class Criterion(ABC):
    """Where a criterion applies: the presets, bench cases and timing modes it names (None:
    every one). It applies on each combination of them."""

    presets: tuple[str, ...] | None = None
    cases: tuple[str, ...] | None = None
    modes: tuple[TimingMode, ...] | None = None
    aim: ClassVar[bool] = False

    def applies(self, preset: str, case: str, mode: TimingMode) -> bool:
        return all(names is None or name in names
                   for name, names in ((preset, self.presets), (case, self.cases), (mode, self.modes)))

    def against(self, reference: str) -> str | None:
        """The contender this criterion compares the arm with, if any."""
        return None

    @abstractmethod
    def title(self, reference: str, ceiling: str) -> str:
        """What the report calls it, given the case's reference and ceiling kind."""

    @abstractmethod
    def judge(self, rounds: Rounds) -> tuple[Decision, str]:
        """Its decision on the rounds so far, and the detail the report prints."""

    def problems(self, presets: set[str], modes_of: Mapping[str, tuple[str, ...]],
                 peers_of: Mapping[str, set[str]]) -> list[str]:
        """What this criterion names that the gate does not have: `modes_of` maps each bench
        case to the modes it is timed in, `peers_of` to the contenders timed in it other than
        the arm. Found when the gate is declared, not after minutes of timing."""
        found = [f"{self!r}: no preset {p!r}" for p in self.presets or () if p not in presets]
        found += [f"{self!r}: no bench case {c!r}" for c in self.cases or () if c not in modes_of]
        cases = [c for c in self.cases or modes_of if c in modes_of]
        found += [f"{self!r}: no case it names is timed in mode {m!r}" for m in self.modes or ()
                  if not any(m in modes_of[c] for c in cases)]
        return found


class _AgainstPeer(Criterion):
    """The arm's speedup over one contender (`peer`; None: the case's reference) reaches
    `least`. The subclasses declare the two."""

    peer: str | None
    least: float

    def against(self, reference: str) -> str:
        return self.peer or reference

    def problems(self, presets, modes_of, peers_of) -> list[str]:
        found = super().problems(presets, modes_of, peers_of)
        if self.peer is not None:
            cases = [c for c in self.cases or modes_of if c in modes_of]
            timed = [self.peer in peers_of[c] for c in cases]
            # named everywhere: judged in the cases that time it; named for cases: timed in each
            if not (any(timed) if self.cases is None else all(timed)):
                found.append(f"{self!r}: {self.peer} (not a contender timed in {', '.join(cases)} other than the arm)")
        return found

    def judge(self, rounds: Rounds) -> tuple[Decision, str]:
        name = self.against(rounds.reference)
        reason = rounds.dropped.get(name) or rounds.unavailable.get(name)
        if reason is not None:
            # a peer that cannot run on this device is skipped; where the bar is against it, one
            # that failed here leaves the bar unjudged: no pass. An aim unjudged is not met.
            skipped = name not in rounds.dropped or isinstance(self, NotSlowerThan)
            decision: Decision = "pass" if skipped and not self.aim else "fail"
            return decision, f"{'skipped' if skipped else 'not judged'}: {name} unavailable ({reason})"
        c = rounds.comparisons[name]
        decision = reaches(c.speedup, c.ci_low, c.ci_high, self.least, math.log1p(c.noise_floor))
        said = c.verdict if isinstance(self, NotSlowerThan) else f"needs >= {self.least:g}x within the floor"
        return decision, (f"arm vs {name}: speedup {c.speedup:.3f}x (CI {c.ci_low:.3f}-{c.ci_high:.3f}), "
                          f"floor {c.noise_floor:.2%}: {said}")


@dataclass(frozen=True)
class NotSlowerThan(_AgainstPeer):
    """Never slower than the peer (None: the reference) beyond the noise floor. A `SpeedupOver`
    the same peer where both apply replaces it (the narrower claim)."""

    peer: str | None = None
    least: ClassVar[float] = 1.0

    def title(self, reference: str, ceiling: str) -> str:
        return f"not slower than {self.against(reference)}"


@dataclass(frozen=True)
class SpeedupOver(_AgainstPeer):
    """The arm's speedup over the peer (None: the reference) at least `least`: 1.5 is "1.5x
    faster", 0.9 "at most 10% slower"."""

    least: float
    peer: str | None = None

    def title(self, reference: str, ceiling: str) -> str:
        return f"speedup over {self.against(reference)} >= {self.least:g}x"


@dataclass(frozen=True)
class Target(_AgainstPeer):
    """An aim an issue sets against a peer, judged as a `SpeedupOver` and reported met or
    missed; a miss leaves the bench passed (its figures can still be a baseline), and a bar
    against the same peer where both apply outranks it."""

    least: float
    peer: str
    aim: ClassVar[bool] = True

    def title(self, reference: str, ceiling: str) -> str:
        return f"target: speedup over {self.against(reference)} >= {self.least:g}x"


@dataclass(frozen=True)
class BusyBound(Criterion):
    """The arm's time at most `bound` times the reference's device-busy time (`gpu_busy`
    cases): a captured step must recover the host's share of the eager one, whatever that
    share is on this machine."""

    bound: float

    def title(self, reference: str, ceiling: str) -> str:
        return f"within {self.bound:g}x of {reference}'s device-busy time"

    def problems(self, presets, modes_of, peers_of) -> list[str]:
        return super().problems(presets, modes_of, peers_of) + (
            [f"{self!r}: name the cases it bounds"] if self.cases is None else [])

    def judge(self, rounds: Rounds) -> tuple[Decision, str]:
        busy = rounds.busy.get(rounds.reference)
        if not busy:  # None, or a profile that saw no kernel
            return "fail", f"case {rounds.case!r} measured no device-busy time for {rounds.reference}"
        arm = rounds.series[rounds.arm]
        ratio, low, high = rounds.ratio(arm, [busy])
        ref_ms = float(np.median(rounds.series[rounds.reference]))
        return stays_within(ratio, low, high, self.bound, rounds.floor_log), (
            f"arm {float(np.median(arm)):.4g} ms / {rounds.reference} busy {busy:.4g} ms = {ratio:.3f} "
            f"(CI {low:.3f}-{high:.3f}); needs <= {self.bound:g} within the floor {math.expm1(rounds.floor_log):.2%} "
            f"(the eager step's own wall/busy: {ref_ms / busy:.3f})")


@dataclass(frozen=True)
class CeilingFraction(Criterion):
    """The arm's throughput at least `least` of the case's ceiling measured in the same run."""

    least: float

    def title(self, reference: str, ceiling: str) -> str:
        return f"{ceiling} ceiling fraction >= {self.least:g}"

    def problems(self, presets, modes_of, peers_of) -> list[str]:
        return super().problems(presets, modes_of, peers_of) + (
            [f"{self!r}: name the cases it holds for"] if self.cases is None else [])

    def judge(self, rounds: Rounds) -> tuple[Decision, str]:
        if rounds.ceilings is None:
            return "fail", "no ceilings were measured in this run"
        arm = rounds.series[rounds.arm]
        median_ms = float(np.median(arm))
        gbps, tflops, fraction = throughput(rounds.nbytes, rounds.flops, median_ms, rounds.ceilings, rounds.ceiling)
        if fraction is None:
            counted = "flops" if rounds.ceiling == "gemm" else "bytes"
            return "fail", f"case {rounds.case!r} declares no {counted} or no ceiling"
        # the fraction goes as 1 / time: its CI is that of the median time, inverted
        _, low, high = rounds.ratio([fraction * median_ms], arm)
        if rounds.ceiling == "gemm":
            rate = f"{tflops:.1f} TFLOP/s of {rounds.ceilings.gemm_bf16_tflops:.1f}"
        else:
            rate = f"{gbps:.1f} GB/s of {rounds.ceilings.copy_gbps:.1f}"
        return reaches(fraction, low, high, self.least, rounds.floor_log), (
            f"arm {rate} = {fraction:.3f} (CI {low:.3f}-{high:.3f}); needs >= {self.least:g} within the floor "
            f"{math.expm1(rounds.floor_log):.2%}")


@dataclass(frozen=True)
class EagerOverGraph(Criterion):
    """The arm's eager calls at most `bound` times its graph replays of the same case (host
    dispatch must not eat a kernel's win); judged in eager mode, on cases timed both ways."""

    bound: float

    def applies(self, preset: str, case: str, mode: TimingMode) -> bool:
        return mode == "eager" and super().applies(preset, case, mode)

    def title(self, reference: str, ceiling: str) -> str:
        return f"eager calls within {self.bound:g}x of graph replays"

    def problems(self, presets, modes_of, peers_of) -> list[str]:
        found = super().problems(presets, modes_of, peers_of)
        if self.cases is None or self.modes is not None:
            found.append(f"{self!r}: name the cases it bounds, and no modes (it compares two)")
        return found + [f"{self!r}: case {c!r} is not timed in both the graph and the eager mode"
                        for c in self.cases or () if c in modes_of and not {"graph", "eager"} <= set(modes_of[c])]

    def judge(self, rounds: Rounds) -> tuple[Decision, str]:
        """Two series timed apart, so the ratio's CI resamples each, and the floor is the wider
        of the two modes'."""
        graph = rounds.graph
        graph_arm = next((t for t in graph.contenders if t.role == "arm"), None) if graph else None
        if graph_arm is None:
            return "fail", "no graph replays of this case were timed before its eager calls"
        if graph_arm.method or not graph_arm.round_medians_ms:
            return "fail", f"the graph mode timed no replays: {graph_arm.method or 'no figures'}"
        eager = rounds.series[rounds.arm]
        ratio, low, high = rounds.ratio(eager, graph_arm.round_medians_ms)
        floor_log = max(rounds.floor_log, math.log1p(graph.noise_floor))
        return stays_within(ratio, low, high, self.bound, floor_log), (
            f"arm eager {float(np.median(eager)):.4g} ms / graph {graph_arm.median_ms:.4g} ms = {ratio:.3f} "
            f"(CI {low:.3f}-{high:.3f}); needs <= {self.bound:g} within the floor {math.expm1(floor_log):.2%}")


def applicable(criteria: Sequence[Criterion], preset: str, case: str, mode: TimingMode, reference: str,
               timed: set[str]) -> list[Criterion]:
    """The criteria judged on one bench, in their declared order: a bar against a peer replaces
    not-slower and outranks an aim against it there, and a peer not timed in the case is not
    judged in it."""
    here = [c for c in criteria if c.applies(preset, case, mode)
            and (c.against(reference) is None or c.against(reference) in timed)]
    barred = {c.against(reference) for c in here if isinstance(c, SpeedupOver)}
    return [c for c in here if not (isinstance(c, (NotSlowerThan, Target)) and c.against(reference) in barred)]


def problems(criteria: Sequence[Criterion], presets: set[str], modes_of: Mapping[str, tuple[str, ...]],
             peers_of: Mapping[str, set[str]]) -> list[str]:
    """Every criterion's problems, and two bars of one kind against one peer that both apply
    somewhere (which would hold is a guess)."""
    found = [p for c in criteria for p in c.problems(presets, modes_of, peers_of)]
    for i, a in enumerate(criteria):
        for b in criteria[i + 1:]:
            if type(a) is type(b) and a.against("") == b.against("") and _overlap(a, b, presets, modes_of):
                found.append(f"{a!r} and {b!r} both apply at one place")
    return found


def _overlap(a: Criterion, b: Criterion, presets: set[str], modes_of: Mapping[str, tuple[str, ...]]) -> bool:
    return any(a.applies(p, c, m) and b.applies(p, c, m)
               for p in presets for c, modes in modes_of.items() for m in modes)
