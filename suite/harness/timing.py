"""The bench driver: cold call, warm-up until steady, ABBA rounds, A/A noise floor, bootstrap
verdicts, the criteria, and the card's ceilings.

docs/DESIGN.md "Timing". `measure_bench` drives a `Timer` (`suite.harness.timers`: CUDA events
on the GPU, the host clock for arms that are not CUDA kernels, a fake in tests) and turns the
figures into the report's `BenchResult`, one per timing mode: CUDA-graph replays (device time)
and eager calls (the host's dispatch included); the statistics are `suite.harness.stats`.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from suite.harness.criteria import Criterion, Rounds, applicable
from suite.harness.gate import BenchCase, Preset
from suite.harness.stats import compare, copy_size, noise_floor, round_order, steady, throughput
from suite.harness.timers import CudaTimer, Timer
from suite.harness.results import (
    BenchResult,
    Ceilings,
    ContenderTiming,
    CriterionCheck,
    Recommendation,
    Role,
    TimingMode,
    bench_passed,
)


@dataclass
class Timed:
    """A contender made ready for one bench: its timed call, or why it cannot be timed."""

    name: str
    role: Role
    call: Callable[[], Any] | None
    unavailable: str | None = None
    host_us: float | None = None  # host time per call on the gate's host-probe shape
    baseline: str | None = None  # what a recommendation judges it against (None: the reference)
    setup_s: float | None = None  # BenchCase.setup: its build's seconds and peak device memory
    setup_peak_bytes: int | None = None
    note: str = ""


class Rotation:
    """One call per input set, used in turn: back-to-back calls then miss the L2 like a loop
    over fresh activations does, without an L2 flush between them (which would hide the
    host's dispatch behind the flush kernel)."""

    def __init__(self, calls: Sequence[Callable[[], Any]]) -> None:
        if not calls:
            raise ValueError("a rotation needs at least one call")
        self.calls = list(calls)
        self.next = 0

    def __call__(self) -> Any:
        call = self.calls[self.next]
        self.next = (self.next + 1) % len(self.calls)
        return call()


@dataclass(frozen=True)
class TimingPolicy:
    calls_per_round: int = 10
    min_rounds: int = 10
    max_rounds: int = 40
    round_step: int = 10  # rounds added each time a deciding comparison is ambiguous
    # a slow contender (milliseconds a call) gets fewer timings a round, so that its share of a
    # round stays near round_budget_ms, never under min_calls_per_round; its eager windows shrink
    # to one call from long_call_ms, where the event pair's own cost is below the noise
    round_budget_ms: float = 60.0
    min_calls_per_round: int = 3
    long_call_ms: float = 1.0
    # A timing without an L2 flush starts behind one untimed call of its contender's own
    # (CudaTimer), as a call in a loop starts behind the previous one. An idle start can add at
    # most the device work a call still has queued when it returns to the host (its tail), so a
    # contender whose call takes lead_in_below_ms or more and whose tail is under idle_tail_share
    # of it times without the lead-in, which doubled the cost of the slowest contenders'
    # timings. A captured step launched in one graph keeps it: its tail is the whole step
    # (docs/judging.md gives the figures).
    lead_in_below_ms: float = 5.0
    idle_tail_share: float = 0.0025
    warmup_tolerance: float = 0.02  # steady when two consecutive batch medians differ by <= this
    warmup_cap_s: float = 2.0  # wall-clock cap on one contender's warm-up
    floor_quantile: float = 0.95
    # the smallest relative difference we are willing to call real, however quiet the A/A is
    min_floor: float = 0.005
    n_boot: int = 2000
    ci_level: float = 0.95
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_calls_per_round <= self.calls_per_round:
            raise ValueError("need 1 <= min_calls_per_round <= calls_per_round")
        if self.round_budget_ms <= 0 or self.long_call_ms <= 0 or self.lead_in_below_ms <= 0:
            raise ValueError("round_budget_ms, long_call_ms and lead_in_below_ms must be > 0")
        if not 0 <= self.idle_tail_share < 1:
            raise ValueError("idle_tail_share must be in [0, 1)")
        # one round gives no spread: no floor, no confidence interval
        if not 2 <= self.min_rounds <= self.max_rounds:
            raise ValueError("need 2 <= min_rounds <= max_rounds")
        if self.round_step < 1:
            raise ValueError("round_step must be >= 1")
        if not 0 < self.floor_quantile <= 1 or not 0 < self.ci_level < 1:
            raise ValueError("floor_quantile must be in (0, 1], ci_level in (0, 1)")
        if self.min_floor < 0 or self.warmup_tolerance < 0 or self.warmup_cap_s < 0:
            raise ValueError("min_floor, warmup_tolerance and warmup_cap_s must be >= 0")
        if self.n_boot < 1:
            raise ValueError("n_boot must be >= 1")


# ---- driving a bench ---------------------------------------------------------------------


def _warm_up(
    timer: Timer, fn: Callable[[], Any], policy: TimingPolicy, flush_l2: bool, window: int, batch_size: int
) -> tuple[int, float]:
    """Batches of `batch_size` timings until two consecutive medians agree, or the cap; returns
    the calls made and the last batch's median (ms a call)."""
    t0 = time.perf_counter()
    calls = 0
    previous: float | None = None
    while True:
        batch = timer.time_calls(fn, batch_size, flush_l2=flush_l2, window=window)
        calls += len(batch) * window
        current = statistics.median(batch)
        if previous is not None and steady(previous, current, policy.warmup_tolerance):
            return calls, current
        if time.perf_counter() - t0 >= policy.warmup_cap_s:
            return calls, current
        previous = current


def round_shape(
    policy: TimingPolicy, call_ms: dict[str, float], window: int, mode: str, shared: Sequence[str] = ()
) -> tuple[int, dict[str, int]]:
    """(timings a round per contender, calls a window per contender) for contenders taking
    call_ms a call. In eager and wall modes a call of long_call_ms or more times one call a
    window (the event pair's own cost is noise there), a faster one the case's window (it needs
    it to hide that cost); the contenders in `shared`, those whose ratios are judged, share one
    window, of one call only when even the fastest of them is long, so no judged ratio mixes
    two methods. Fewer timings a round when the slowest window is slow, so a round costs about
    the budget."""

    def calls_a_window(ms: float) -> int:
        return 1 if mode != "graph" and ms >= policy.long_call_ms else window

    judged = [name for name in shared if name in call_ms]
    together = calls_a_window(min(call_ms[name] for name in judged)) if judged else window
    windows = {name: together if name in judged else calls_a_window(ms) for name, ms in call_ms.items()}
    slowest = max(ms * windows[name] for name, ms in call_ms.items())
    fit = int(policy.round_budget_ms // max(slowest, 1e-9))
    return max(policy.min_calls_per_round, min(policy.calls_per_round, fit)), windows


def measure_bench(
    case: BenchCase,
    mode: TimingMode,
    contenders: list[Timed],
    preset: Preset,
    criteria: Sequence[Criterion],
    ceilings: Ceilings | None,
    policy: TimingPolicy,
    timer: Timer,
    progress: Callable[[str], None] | None = None,
    rotation: int = 1,
    host_probe: str | None = None,
    graph: BenchResult | None = None,
) -> BenchResult:
    """Time the arm against the reference and the available peers in one mode, and judge
    the `criteria` that apply to it. `rotation` says how many input sets the eager calls cycle through;
    `graph`, in eager mode, is the same case's graph-mode result, which an eager-over-graph
    bound judges the arm's eager calls against.

    `progress` gets short status lines ("round 3/10"); the caller adds which bench it is.
    The steps, in order: cold calls, capture (graph mode), warm-up, the device's busy time
    (cases that ask for it), each contender's memory a call (eager mode, on CUDA), rounds until
    every criterion is decided, the figures, the checks.
    """
    bench = _Bench(case, mode, contenders, preset, criteria, policy, timer, progress or (lambda message: None),
                   ceilings, graph)
    bench.cold_calls()
    if mode == "graph":
        bench.capture()
    bench.warm_up()
    bench.measure_busy()
    bench.measure_peaks()
    bench.rounds()
    timings = bench.figures()
    checks = bench.checks()
    ambiguous = any(check.ambiguous and not check.target for check in checks)
    nbytes, flops = case.bytes(preset), case.flops(preset)
    return BenchResult(
        case=case.name, description=case.description, mode=mode, l2=case.l2, ceiling=case.ceiling,
        window=max(bench.windows.values()), rotation=rotation, bytes=nbytes, flops=flops,
        warmup_calls=bench.warmup_calls, rounds=len(bench.first[bench.ref_name]),
        calls_per_round=bench.calls_per_round, noise_floor=math.expm1(bench.floor_log),
        aa_log_ratios=bench.aa[bench.ref_name], peer_aa_log_ratios={name: bench.aa[name] for name in bench.judged},
        contenders=timings, comparisons=bench.comparisons, criteria=checks,
        passed=bench_passed(checks, ambiguous), ambiguous=ambiguous,
        host_probe=host_probe, recommendations=bench.recommendations() if case.recommend else [],
        duration_s=time.perf_counter() - bench.started)


class _Bench:
    """One bench case in one timing mode, step by step (`measure_bench` runs the steps)."""

    def __init__(self, case: BenchCase, mode: TimingMode, contenders: list[Timed], preset: Preset,
                 criteria: Sequence[Criterion], policy: TimingPolicy, timer: Timer, say: Callable[[str], None],
                 ceilings: Ceilings | None = None, graph: BenchResult | None = None):
        self.started = time.perf_counter()
        self.case, self.mode, self.contenders, self.preset = case, mode, contenders, preset
        self.policy, self.timer, self.say = policy, timer, say
        self.ceilings, self.graph = ceilings, graph
        by_role = {role: [c for c in contenders if c.role == role] for role in ("reference", "arm")}
        if len(by_role["reference"]) != 1 or len(by_role["arm"]) != 1:
            raise ValueError("measure_bench needs exactly one reference and one arm")
        for c in contenders:
            if c.call is None and c.role != "peer":
                raise ValueError(f"the {c.role} {c.name!r} is unavailable ({c.unavailable}); nothing to bench")
            if c.call is None and not c.unavailable:
                raise ValueError(f"contender {c.name!r} has no call and no reason")
        self.ref_name, self.arm_name = by_role["reference"][0].name, by_role["arm"][0].name
        self.criteria = applicable(criteria, preset.name, case.name, mode, self.ref_name, {c.name for c in contenders})
        if len({c.name for c in contenders}) != len(contenders):
            raise ValueError("contender names must be unique")
        self.fns = {c.name: c.call for c in contenders if c.call is not None}
        self.roles = {c.name: c.role for c in contenders}
        # graph replays are device time: the L2 is flushed before each; eager and wall windows are
        # back-to-back calls, rotated over input sets instead
        self.flush_l2 = case.l2 == "cold" and mode == "graph"
        self.window = 1 if mode == "graph" else case.window
        self.dropped: dict[str, str] = {}  # peers that failed on their first call or capture, and why
        self.cold: dict[str, float] = {}
        self.methods = {name: "" for name in self.fns}
        self.busy: dict[str, float] = {}
        self.peaks: dict[str, int] = {}

    def _drop(self, name: str, what: str, exc: Exception) -> None:
        if self.roles[name] != "peer":
            raise exc
        self.dropped[name] = f"{what} failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        del self.fns[name]
        self.methods.pop(name, None)

    def cold_calls(self) -> None:
        """Each contender's first call, timed: compile and autotune are its cost."""
        cold_calls = self.case.cold_calls
        for name in list(self.fns):
            self.say(f"cold call of {name}")
            fn = self.fns[name]
            try:
                # cold_calls > 1 when the first-use cost comes after some calls (a capture after warm-up)
                self.cold[name] = self.timer.time_cold(
                    fn if cold_calls == 1 else lambda fn=fn: [fn() for _ in range(cold_calls)])
            except Exception as exc:  # a peer that cannot run here (a graph break under fullgraph) is reported
                self._drop(name, "its first call", exc)

    def capture(self) -> None:
        """Graph mode: each call captured in a CUDA graph. A peer that cannot be is dropped; if
        the reference or the arm cannot be, every contender is timed as eager calls."""
        eager = dict(self.fns)
        for name in list(self.fns):
            self.say(f"capturing {name} in a CUDA graph")
            try:
                self.fns[name] = self.timer.capture(self.fns[name])
            except Exception as exc:
                if self.roles[name] == "peer":
                    self._drop(name, "CUDA-graph capture", exc)
                    continue
                # the reference or the arm cannot be captured: everyone is timed eagerly, one call a timing
                why = f"{name}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
                self.fns = {n: eager[n] for n in self.fns}
                self.methods = {n: f"eager calls (capture failed for {why})" for n in self.fns}
                break

    def warm_up(self) -> None:
        """Who is judged (timed twice a round), the warm-up until steady, the shape of a round,
        and which contenders need an untimed lead-in call before each timing."""
        policy, fns, mode = self.policy, self.fns, self.mode
        # a peer the arm is judged against is timed twice a round, like the reference: where the
        # reference runs at another scale (a device-bound eager reference beside host-bound calls),
        # its A/A says nothing of the noise between the arm and that peer
        self.judged = list(dict.fromkeys(name for c in self.criteria if (name := c.against(self.ref_name))
                                         in fns and name != self.ref_name))
        shared = (self.ref_name, self.arm_name, *self.judged)
        # one timed call each sizes the warm-up batches (a slow eager reference timed in full
        # batches of full windows spent seconds a batch); the warm medians then size the rounds
        first_ms = {name: self.timer.time_calls(fns[name], 1, flush_l2=self.flush_l2, window=1)[0] for name in fns}
        batch_size, warm_windows = round_shape(policy, first_ms, self.window, mode, shared)
        self.warmup_calls, warm_ms = len(fns), {}
        for name in fns:
            self.say(f"warming up {name}")
            calls, warm_ms[name] = _warm_up(self.timer, fns[name], policy, self.flush_l2, warm_windows[name],
                                            batch_size)
            self.warmup_calls += calls
        self.calls_per_round, self.windows = round_shape(policy, warm_ms, self.window, mode, shared)
        # eager calls only: a graph replay's tail is its whole call, and a wall timing waits for it
        tails = {name: self.timer.tail_ms(fns[name]) for name, ms in warm_ms.items()
                 if mode == "eager" and not self.flush_l2 and ms >= policy.lead_in_below_ms}
        self.idle_start = {name: tail for name, tail in tails.items() if tail <= policy.idle_tail_share * warm_ms[name]}
        self.lead_in = {name: name not in self.idle_start for name in fns}

    def _round(self, index: int, target: int) -> None:
        """Each slot's figure is the median of its calls_per_round timings. The slots take turns
        timing by timing (forward, then backward), so a change in the host's state (clocks,
        other load, the autograd thread's core) falls on every contender of the round alike
        instead of on whichever one's batch it hit: timed in batches, eager windows of two
        calls into the same kernel drift apart round by round (docs/judging.md)."""
        self.say(f"round {index + 1}/{target}")
        order = round_order(self.ref_name, self.judged, self.others, index)
        slots: list[list[float]] = [[] for _ in order]
        for turn in range(self.calls_per_round):
            for slot in (range(len(order)) if turn % 2 == 0 else reversed(range(len(order)))):
                name = order[slot]
                slots[slot] += self.timer.time_calls(self.fns[name], 1, flush_l2=self.flush_l2,
                                                     window=self.windows[name], lead_in=self.lead_in[name])
        twice = len(self.judged) + 1
        for slot, name in enumerate(order):
            ms = statistics.median(slots[slot])
            if name in self.per_round:
                self.per_round[name].append(ms)
            else:
                (self.first if slot < twice else self.second)[name].append(ms)

    def rounds(self) -> None:
        """ABBA rounds, min_rounds first and more (up to max_rounds) while a judged comparison
        is undecided; the A/A noise floors, each round's figure and the comparisons."""
        policy, ref_name, judged = self.policy, self.ref_name, self.judged
        self.others = [name for name in self.fns if name != ref_name and name not in judged]
        self.first = {name: [] for name in (ref_name, *judged)}
        self.second = {name: [] for name in (ref_name, *judged)}
        self.per_round = {name: [] for name in self.others}
        target = policy.min_rounds
        while True:
            while len(self.first[ref_name]) < target:
                self._round(len(self.first[ref_name]), target)
            self.aa = {name: [math.log(a / b) for a, b in zip(self.first[name], self.second[name])]
                       for name in self.first}
            self.floor_log = noise_floor(self.aa[ref_name], policy.floor_quantile, policy.min_floor)
            floors = {name: max(self.floor_log, noise_floor(self.aa[name], policy.floor_quantile, policy.min_floor))
                      for name in judged}
            floors[ref_name] = self.floor_log
            # a figure for a round of what is timed twice: the mean of its two timings in that round
            self.series = {**{n: [(a + b) / 2 for a, b in zip(self.first[n], self.second[n])] for n in self.first},
                           **{n: self.per_round[n] for n in self.others}}
            rng = np.random.default_rng(policy.seed)  # same figures and seed, same intervals
            self.comparisons = [
                compare(name, self.series[name], self.series[self.arm_name], floors.get(name, self.floor_log),
                        policy.n_boot, policy.ci_level, rng)
                for name in self.fns if name != self.arm_name
            ]
            self.evidence = self._rounds()
            # more rounds only for what can fail (an aim cannot)
            undecided = [self._title(c) for c in self.criteria if not c.aim and c.judge(self.evidence)[0] == "undecided"]
            if not undecided or target >= policy.max_rounds:
                return
            target = min(target + policy.round_step, policy.max_rounds)
            self.say(f"undecided: {'; '.join(undecided)}; extending to {target} rounds")

    def recommendations(self) -> list[Recommendation]:
        """Each timed contender but the reference against its baseline, round by round, judged
        with the reference's A/A floor (the baseline's own where it was timed twice and is wider)."""
        rng = np.random.default_rng(self.policy.seed)
        found = []
        for c in self.contenders:
            against = c.baseline or self.ref_name
            if c.name == self.ref_name or c.name not in self.fns or against not in self.fns:
                continue
            floor = self.floor_log
            if against in self.aa:
                floor = max(floor, noise_floor(self.aa[against], self.policy.floor_quantile, self.policy.min_floor))
            cmp = compare(against, self.series[against], self.series[c.name], floor, self.policy.n_boot,
                          self.policy.ci_level, rng)
            found.append(Recommendation(contender=c.name, **cmp.model_dump()))
        return found

    def measure_busy(self) -> None:
        """Eager `gpu_busy` cases: each contender's device-busy time per call, measured before
        the rounds so a bound on it is decided by them."""
        if self.case.gpu_busy and self.mode == "eager" and hasattr(self.timer, "busy_ms"):
            for name, fn in self.fns.items():
                self.say(f"device busy time of {name}")
                self.busy[name] = self.timer.busy_ms(fn, self.windows[name])

    def measure_peaks(self) -> None:
        """Eager mode: the device memory each contender's warm call holds at its peak (a graph
        replay's comes from the graph's own pool, allocated at capture)."""
        if self.mode == "eager" and hasattr(self.timer, "peak_bytes"):
            for name, fn in list(self.fns.items()):
                self.say(f"memory of a call of {name}")
                try:
                    self.peaks[name] = self.timer.peak_bytes(fn)
                except Exception as exc:  # a peer whose call fails here is reported, as at its first call
                    self._drop(name, "a call measured for its memory", exc)

    def figures(self) -> list[ContenderTiming]:
        """Each contender's figures (median over rounds, throughput, share of the ceiling), and
        the GPU's busy time per call where the case asks for it."""
        nbytes, flops = self.case.bytes(self.preset), self.case.flops(self.preset)
        timings = []
        for c in self.contenders:
            if c.call is None or c.name in self.dropped:
                timings.append(ContenderTiming(name=c.name, role=c.role, unavailable=c.unavailable or self.dropped[c.name],
                                               host_us=c.host_us))
                continue
            median_ms = float(np.median(self.series[c.name]))
            gbps, tflops, fraction = throughput(nbytes, flops, median_ms, self.ceilings, self.case.ceiling)
            timings.append(ContenderTiming(
                name=c.name, role=c.role, method=self.methods[c.name], cold_ms=self.cold[c.name], median_ms=median_ms,
                round_medians_ms=list(self.series[c.name]), gbps=gbps, tflops=tflops,
                ceiling_fraction=fraction, host_us=c.host_us, window=self.windows[c.name],
                idle_start_tail_ms=self.idle_start.get(c.name), setup_s=c.setup_s,
                setup_peak_bytes=c.setup_peak_bytes, call_peak_bytes=self.peaks.get(c.name), note=c.note,
                gpu_busy_ms=self.busy.get(c.name)))
        return timings

    # ---- the criteria, each decided by its CI against the floor --------------------------

    def _title(self, criterion: Criterion) -> str:
        return criterion.title(self.ref_name, self.case.ceiling)

    def _rounds(self) -> Rounds:
        return Rounds(
            case=self.case.name, ceiling=self.case.ceiling, nbytes=self.case.bytes(self.preset),
            flops=self.case.flops(self.preset), reference=self.ref_name, arm=self.arm_name, series=self.series,
            comparisons={c.against: c for c in self.comparisons}, floor_log=self.floor_log,
            unavailable={c.name: c.unavailable for c in self.contenders if c.call is None}, dropped=self.dropped,
            busy=self.busy, ceilings=self.ceilings, graph=self.graph, n_boot=self.policy.n_boot,
            ci_level=self.policy.ci_level, seed=self.policy.seed)

    def checks(self) -> list[CriterionCheck]:
        """Each criterion's decision on the rounds, as the report prints it."""
        checks = []
        for criterion in self.criteria:
            decision, detail = criterion.judge(self.evidence)
            if decision == "undecided":
                detail += " (undecided at the round cap; never a pass)"
            checks.append(CriterionCheck(name=self._title(criterion), passed=decision == "pass", target=criterion.aim,
                                         detail=detail, ambiguous=decision == "undecided"))
        return checks


# ---- ceilings ----------------------------------------------------------------------------

_CEILINGS: dict[tuple[str, int], Ceilings] = {}
GEMM_N = 8192


def steady_median_ms(timer: Timer, fn: Callable[[], Any], n_calls: int = 20) -> float:
    """One call alone (allocator, cuBLAS handle and heuristics), warm-up to a steady median,
    then the median of n_calls single-call timings: a ceiling's figure."""
    policy = TimingPolicy()
    fn()
    _warm_up(timer, fn, policy, flush_l2=False, window=1, batch_size=policy.calls_per_round)
    return statistics.median(timer.time_calls(fn, n_calls, flush_l2=False, window=1))


def measure_ceilings(device: torch.device | str | int, timer: Timer | None = None) -> Ceilings:
    """Device copy bandwidth (bytes read + written) and bf16 GEMM rate, each the median of
    event-timed calls after warm-up; measured once per device per process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"ceilings are measured on a CUDA device, not {device}")
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key in _CEILINGS:
        return _CEILINGS[key]
    timer = timer or CudaTimer(device)

    free, _ = torch.cuda.mem_get_info(device)
    src_bytes = copy_size(free)
    # random bits, not zeros: nothing may short-cut the data
    src = torch.randint(-(2**31), 2**31 - 1, (src_bytes // 4,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    copy_ms = steady_median_ms(timer, lambda: dst.copy_(src))
    del src, dst

    a = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    b = torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    out = torch.empty(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device)
    gemm_ms = steady_median_ms(timer, lambda: torch.matmul(a, b, out=out))
    del a, b, out
    torch.cuda.empty_cache()  # hand the buffers back so later free-memory checks see them

    result = Ceilings(
        copy_gbps=2 * src_bytes / copy_ms / 1e6,
        copy_bytes=2 * src_bytes,
        gemm_bf16_tflops=2 * GEMM_N**3 / gemm_ms / 1e9,
        gemm_n=GEMM_N,
    )
    _CEILINGS[key] = result
    return result
