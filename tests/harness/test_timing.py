"""Timing statistics and the bench driver, on synthetic timings with known answers.

A fake Timer draws each contender's call times from its own seeded lognormal, so every figure
here is reproducible on the CPU; only the `cuda`-marked test touches real timings.
"""

from __future__ import annotations

import contextlib
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from suite.harness.criteria import (
    BusyBound,
    CeilingFraction,
    EagerOverGraph,
    NotSlowerThan,
    SpeedupOver,
    Target,
)
from suite.harness.gate import BenchCase, Preset
from suite.harness import render, stats, timers, timing
from suite.harness.results import Ceilings
from suite.harness.stats import bootstrap_ci, copy_size, judge, noise_floor, round_order, steady
from suite.harness.timers import CudaTimer, WallTimer
from suite.harness.timing import Rotation, Timed, TimingPolicy, measure_bench, measure_ceilings

PRESET = Preset(name="small", params={}, where="any")
# cap 0: one warm-up batch per contender, so the draws (and so the figures) never depend on
# how fast this machine is
# the fakes' calls take about a millisecond: the round's shape stays fixed for them here, and
# round_shape is tested on its own below
POLICY = TimingPolicy(warmup_cap_s=0.0, long_call_ms=1e9, round_budget_ms=1e9)
COLD_MS = 1000.0


class FakeFn:
    """A contender the fake timer recognises by name; never actually called."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self) -> None:
        raise AssertionError("the fake timer does not call")


class FakeTimer:
    """Per-contender times base_ms * lognormal(0, sigma) from seeded generators. The first call
    a contender ever gets, through either method, costs COLD_MS. Logs what it was asked."""

    def __init__(self, dists: dict[str, tuple[float, float]], log: list | None = None,
                 tails: dict[str, float] | None = None) -> None:
        self.dists = dists
        self.tails = tails or {}  # ms queued at return; by default the whole call (device-bound)
        self.rngs = {name: np.random.default_rng([7, i]) for i, name in enumerate(dists)}
        self.log = [] if log is None else log
        self.seen: set[str] = set()

    def _draw(self, name: str, n: int) -> list[float]:
        base, sigma = self.dists[name]
        times = list(base * self.rngs[name].lognormal(0.0, sigma, n))
        if name not in self.seen:
            self.seen.add(name)
            times[0] = COLD_MS
        return times

    def time_calls(self, fn, n, *, flush_l2, window, lead_in=True):
        self.log.append(("calls", fn.name, flush_l2, window, lead_in))
        return self._draw(fn.name, n)

    def time_cold(self, fn):
        self.log.append(("cold", fn.name))
        return self._draw(fn.name, 1)[0]

    def tail_ms(self, fn):
        self.log.append(("tail", fn.name))
        return self.tails.get(fn.name, self.dists[fn.name][0])


def make_case(**kw) -> BenchCase:
    kw.setdefault("bytes", lambda preset: 400_000_000)
    return BenchCase(name="fwd", description="synthetic", **kw)


def make_contenders(*peers: str, unavailable: dict[str, str] | None = None) -> list[Timed]:
    rows = [Timed("reference", "reference", FakeFn("reference")), Timed("arm", "arm", FakeFn("arm"))]
    rows += [Timed(p, "peer", FakeFn(p)) for p in peers]
    rows += [Timed(p, "peer", None, why) for p, why in (unavailable or {}).items()]
    return rows


NOT_SLOWER = (NotSlowerThan(),)


def bench(dists, criterion=NOT_SLOWER, *, case=None, contenders=None, ceilings=None,
          policy=POLICY, log=None, progress=None, mode="graph", tails=None):
    timer = FakeTimer(dists, log, tails)
    result = measure_bench(case or make_case(), mode, contenders or make_contenders(), PRESET,
                           criterion, ceilings, policy, timer, progress)
    return result, timer


def against(result, name):
    return next(c for c in result.comparisons if c.against == name)


# ---- verdicts ----------------------------------------------------------------------------


def test_arm_twice_as_fast_is_faster():
    result, _ = bench({"reference": (1.0, 0.01), "arm": (0.5, 0.01)})
    c = against(result, "reference")
    assert c.verdict == "faster"
    assert c.speedup == pytest.approx(2.0, rel=0.02)
    assert c.ci_low <= 2.0 <= c.ci_high
    assert result.rounds == POLICY.min_rounds  # decided at once: no escalation
    assert result.passed and not result.ambiguous
    assert [k.passed for k in result.criteria] == [True]
    assert "faster" in result.criteria[0].detail and "2.0" in result.criteria[0].detail


def test_equal_distributions_are_same():
    result, _ = bench({"reference": (1.0, 0.01), "arm": (1.0, 0.01)})
    c = against(result, "reference")
    assert c.verdict == "same"
    assert math.exp(-math.log1p(result.noise_floor)) <= c.ci_low <= c.ci_high
    assert c.ci_high <= 1 + result.noise_floor
    assert result.passed


def test_slower_arm_fails_not_slower_than():
    result, _ = bench({"reference": (1.0, 0.01), "arm": (1.5, 0.01)})
    c = against(result, "reference")
    assert c.verdict == "slower"
    assert c.speedup == pytest.approx(1 / 1.5, rel=0.02)
    check = result.criteria[0]
    assert check.name == "not slower than reference" and not check.passed
    assert "slower" in check.detail
    assert not result.passed and not result.ambiguous


def test_heavy_noise_small_difference_is_ambiguous_at_the_round_cap():
    messages: list[str] = []
    log: list = []
    result, _ = bench({"reference": (1.0, 0.01), "arm": (0.99, 1.0)}, log=log,
                      progress=messages.append)
    assert against(result, "reference").verdict == "ambiguous"
    assert result.rounds == POLICY.max_rounds
    assert len(result.aa_log_ratios) == POLICY.max_rounds
    arm = next(t for t in result.contenders if t.name == "arm")
    assert len(arm.round_medians_ms) == POLICY.max_rounds
    # escalated in steps of round_step
    assert [m.rsplit(" ", 2)[-2] for m in messages if "extending" in m] == ["20", "30", "40"]
    assert result.ambiguous and not result.passed
    assert not result.criteria[0].passed and "ambiguous" in result.criteria[0].detail


def test_ambiguous_against_an_unnamed_peer_does_not_escalate():
    result, _ = bench({"reference": (1.0, 0.01), "arm": (0.5, 0.01), "noisy": (0.5, 0.5)},
                      contenders=make_contenders("noisy"))
    assert against(result, "noisy").verdict == "ambiguous"
    assert result.rounds == POLICY.min_rounds
    assert result.passed and not result.ambiguous


@pytest.mark.parametrize(
    "median, low, high, floor, verdict",
    [
        (2.0, 1.9, 2.1, math.log(1.01), "faster"),
        (0.5, 0.45, 0.55, math.log(1.01), "slower"),
        (1.0, 0.995, 1.004, math.log(1.01), "same"),
        (1.0, 0.95, 1.05, math.log(1.01), "ambiguous"),  # CI wider than the floor
        (1.004, 1.001, 1.02, math.log(1.005), "ambiguous"),  # clear of 1 but within the floor
        (0.996, 0.98, 0.999, math.log(1.005), "ambiguous"),
    ],
)
def test_judge(median, low, high, floor, verdict):
    assert judge(median, low, high, floor) == verdict


# ---- statistics --------------------------------------------------------------------------


def test_noise_floor_is_the_quantile_of_absolute_log_ratios():
    # |x| = 0.001 .. 0.020; linear 95th percentile: position 0.95 * 19 = 18.05 between the 19th
    # and 20th smallest, 0.019 + 0.05 * 0.001
    series = [(-1) ** i * 0.001 * (i + 1) for i in range(20)]
    assert noise_floor(series, 0.95, 0.005) == pytest.approx(0.01905)
    assert noise_floor(series, 1.0, 0.005) == pytest.approx(0.020)


def test_noise_floor_respects_the_minimum():
    assert noise_floor([0.001, -0.001, 0.0], 0.95, 0.005) == pytest.approx(math.log(1.005))


def test_reported_floor_is_relative():
    result, _ = bench({"reference": (1.0, 0.0), "arm": (0.5, 0.0)})
    assert result.aa_log_ratios == [0.0] * POLICY.min_rounds
    assert result.noise_floor == pytest.approx(POLICY.min_floor)


def test_bootstrap_ci_collapses_on_constant_ratios():
    low, high = bootstrap_ci([1.7] * 12, 2000, 0.95, np.random.default_rng(0))
    assert low == pytest.approx(1.7) and high == pytest.approx(1.7)


def test_bootstrap_ci_is_reproducible_under_a_seed():
    ratios = np.random.default_rng(1).lognormal(0.0, 0.1, 25)
    first = bootstrap_ci(ratios, 2000, 0.95, np.random.default_rng(3))
    again = bootstrap_ci(ratios, 2000, 0.95, np.random.default_rng(3))
    assert first == again
    assert first[0] < np.median(ratios) < first[1]


def test_bench_figures_are_reproducible():
    dists = {"reference": (1.0, 0.05), "arm": (0.9, 0.05)}
    first, again = bench(dists)[0], bench(dists)[0]
    assert first.model_copy(update={"duration_s": 0}) == again.model_copy(update={"duration_s": 0})


def test_steady():
    assert steady(1.0, 1.019, 0.02)
    assert steady(1.0, 0.981, 0.02)
    assert not steady(1.0, 1.021, 0.02)


def test_copy_size():
    assert copy_size(100 << 30) == 1 << 30  # plenty free: the default
    assert copy_size(4 << 30) == 512 << 20  # capped to 1/8 of free
    assert copy_size((4 << 30) + 12345) == 512 << 20  # whole MiB


# ---- ceilings ----------------------------------------------------------------------------

CEILINGS = Ceilings(copy_gbps=1000.0, copy_bytes=2 << 30, gemm_bf16_tflops=500.0, gemm_n=8192)
EXACT = {"reference": (1.0, 0.0), "arm": (0.5, 0.0)}  # arm: exactly 0.5 ms per call


@pytest.mark.parametrize("need, passed", [(0.8, True), (0.803, True), (0.81, False)])
def test_copy_ceiling_fraction_boundary(need, passed):
    """400 MB in 0.5 ms = 800 GB/s = 0.8 of 1000 GB/s, judged within the noise floor (0.5%
    here): 0.8 and 0.803 pass, 0.81 fails."""
    criterion = (NotSlowerThan(), CeilingFraction(need, presets=("small",), cases=("fwd",)))
    result, _ = bench(EXACT, criterion, ceilings=CEILINGS)
    arm = next(t for t in result.contenders if t.name == "arm")
    assert arm.gbps == pytest.approx(800.0) and arm.ceiling_fraction == pytest.approx(0.8)
    check = result.criteria[1]
    assert check.passed is passed and not check.ambiguous
    assert "800.0 GB/s" in check.detail and "0.800 (CI 0.800-0.800)" in check.detail
    assert result.passed is passed


def test_a_ceiling_fraction_inside_the_noise_is_decided_by_more_rounds():
    """A noisy arm whose fraction sits a little under the bar: neither a clear pass nor a clear
    fail on ten rounds, so rounds are added; a fraction far under the bar fails at once."""
    criterion = (CeilingFraction(0.81, presets=("small",), cases=("fwd",)),)
    result, _ = bench({"reference": (1.0, 0.001), "arm": (0.5, 0.08)}, criterion, ceilings=CEILINGS)
    assert result.rounds > POLICY.min_rounds
    far = (CeilingFraction(0.95, presets=("small",), cases=("fwd",)),)
    result, _ = bench({"reference": (1.0, 0.001), "arm": (0.5, 0.01)}, far, ceilings=CEILINGS)
    assert result.rounds == POLICY.min_rounds and not result.passed and not result.ambiguous


@pytest.mark.parametrize("need, passed", [(0.6, True), (0.61, False)])
def test_gemm_ceiling_fraction_boundary(need, passed):
    # 150 GFLOP in 0.5 ms = 300 TFLOP/s = 0.6 of 500 TFLOP/s
    criterion = (NotSlowerThan(), CeilingFraction(need, presets=("small",), cases=("fwd",)))
    case = make_case(flops=lambda preset: 150_000_000_000, ceiling="gemm")
    result, _ = bench(EXACT, criterion, case=case, ceilings=CEILINGS)
    arm = next(t for t in result.contenders if t.name == "arm")
    assert arm.tflops == pytest.approx(300.0) and arm.ceiling_fraction == pytest.approx(0.6)
    assert result.criteria[1].passed is passed


@pytest.mark.parametrize("least, passed", [(2.0, True), (2.009, True), (2.02, False)])
def test_min_speedup_boundary(least, passed):
    """The arm is exactly 2x: a least of 2.0 passes, 2.009 too (within the 0.5% floor), 2.02 fails."""
    criterion = (SpeedupOver(least, presets=("small",), cases=("fwd",)),)
    result, _ = bench(EXACT, criterion)
    check = next(c for c in result.criteria if c.name.startswith("speedup over reference"))
    assert check.passed is passed and "2.000x" in check.detail and not check.ambiguous
    assert result.passed is passed


@pytest.mark.parametrize("bar, passed", [(0.8, True), (0.803, True), (0.81, False)])
def test_min_speedup_over_a_peer_boundary(bar, passed):
    """A target that is a fraction of a peer, judged within the noise floor (0.5% here): the
    arm at exactly 0.8x of the peer passes 0.8 and 0.803 and fails 0.81; the reference's own
    criterion is untouched."""
    dists = {**EXACT, "peer": (0.4, 0.0)}  # arm 0.5 ms, peer 0.4 ms: 0.8x
    criterion = (NotSlowerThan(), SpeedupOver(bar, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, criterion, contenders=make_contenders("peer"))
    check = next(c for c in result.criteria if c.name == f"speedup over peer >= {bar:g}x")
    assert check.passed is passed and "0.800x" in check.detail
    assert result.passed is passed


def test_a_bar_against_a_peer_replaces_not_slower_for_it_where_declared():
    """NotSlowerThan names the peer for every case; a bar for one (preset, case) is that
    case's claim against it instead: judged alone, the arm at 0.8x passes a 0.75 bar there."""
    dists = {**EXACT, "peer": (0.4, 0.0)}  # arm 0.5 ms, peer 0.4 ms: 0.8x
    criterion = (NotSlowerThan(), NotSlowerThan("peer"), SpeedupOver(0.75, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, criterion, contenders=make_contenders("peer"))
    assert [c.name for c in result.criteria if "peer" in c.name] == ["speedup over peer >= 0.75x"]
    assert result.passed
    elsewhere = (NotSlowerThan(), NotSlowerThan("peer"), SpeedupOver(0.75, "peer", presets=("other",), cases=("fwd",)))
    result, _ = bench(dists, elsewhere, contenders=make_contenders("peer"))
    assert [c.name for c in result.criteria if "peer" in c.name] == ["not slower than peer"]
    assert not result.passed


def test_rounds_extend_only_for_the_demands_judged():
    """A peer tied with the arm within noise keeps not-slower undecided; where a 0.75 bar
    replaces not-slower for it, that bar is decided at once and no round is added for the
    claim that is no longer made."""
    dists = {"reference": (1.0, 0.001), "arm": (0.5, 0.05), "peer": (0.5, 0.001)}
    tied = (NotSlowerThan(), NotSlowerThan("peer"))
    result, _ = bench(dists, tied, contenders=make_contenders("peer"))
    assert result.rounds > POLICY.min_rounds
    barred = (NotSlowerThan(), NotSlowerThan("peer"), SpeedupOver(0.75, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, barred, contenders=make_contenders("peer"))
    assert result.rounds == POLICY.min_rounds and result.passed


def test_a_judged_peer_is_timed_twice_and_its_own_noise_floors_its_comparison():
    """A quiet (device-bound) reference says nothing of the noise between two host-bound
    calls: the peer judged against gets an A/A of its own, and its comparison is judged
    against the wider floor; a peer not judged keeps the reference's."""
    dists = {"reference": (1.0, 0.001), "arm": (0.5, 0.05), "peer": (0.5, 0.05), "bystander": (0.5, 0.05)}
    log: list = []
    result, _ = bench(dists, (NotSlowerThan(), NotSlowerThan("peer")),
                      contenders=make_contenders("peer", "bystander"), log=log)
    assert list(result.peer_aa_log_ratios) == ["peer"] and len(result.peer_aa_log_ratios["peer"]) == result.rounds
    turns = sum(entry[:2] == ("calls", "peer") for entry in log) - 2  # less its sizing call and warm-up batch
    assert turns == 2 * result.rounds * result.calls_per_round
    peer, bystander = against(result, "peer"), against(result, "bystander")
    assert peer.noise_floor > 0.02 and bystander.noise_floor == against(result, "reference").noise_floor == result.noise_floor
    assert peer.verdict == "same" and result.passed and result.rounds == POLICY.min_rounds
    assert f"floor {peer.noise_floor:.2%}" in next(c.detail for c in result.criteria if c.name == "not slower than peer")


def test_a_slower_arm_still_fails_against_a_noisy_peer():
    dists = {"reference": (1.0, 0.001), "arm": (0.65, 0.05), "peer": (0.5, 0.05)}
    result, _ = bench(dists, (NotSlowerThan(), NotSlowerThan("peer")), contenders=make_contenders("peer"))
    check = next(c for c in result.criteria if c.name == "not slower than peer")
    assert against(result, "peer").verdict == "slower" and not check.passed and not result.passed


def test_min_speedup_over_one_is_not_slower_a_tie_passes():
    """Bar 1.0 is "not slower than the peer": a tie within the noise passes, as NotSlowerThan
    would, instead of running to the round cap for a CI that straddles 1."""
    dists = {"reference": (1.0, 0.01), "arm": (0.5, 0.01), "peer": (0.5, 0.01)}
    criterion = (SpeedupOver(1.0, "peer", presets=("small",), cases=("fwd",)),)
    result, _ = bench(dists, criterion, contenders=make_contenders("peer"))
    assert result.passed and not result.ambiguous and result.rounds == POLICY.min_rounds


def test_min_speedup_over_a_peer_that_failed_here_is_not_judged_so_no_pass():
    """The target is the peer: one declared unavailable on this device skips the check, one
    that failed its first call leaves the bar unjudged, which must not read as met."""
    criterion = (SpeedupOver(1.0, "broken", presets=("small",), cases=("fwd",)),)
    timer = FailingTimer(EXACT, {"broken"})
    result = measure_bench(make_case(), "eager", make_contenders("broken"), PRESET, criterion, None, POLICY, timer)
    check = next(c for c in result.criteria if c.name.startswith("speedup over broken"))
    assert not check.passed and check.detail.startswith("not judged: broken unavailable (its first call failed")
    assert not result.passed


def test_min_speedup_over_an_unavailable_peer_is_skipped_and_named():
    criterion = (SpeedupOver(1.0, "peer", presets=("small",), cases=("fwd",)),)
    result, _ = bench(EXACT, criterion, contenders=make_contenders(unavailable={"peer": "no such kernel here"}))
    check = next(c for c in result.criteria if c.name.startswith("speedup over peer"))
    assert check.passed and "no such kernel here" in check.detail


class _Counted(FakeFn):
    """A fake contender that counts the calls made outside the timer."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_ceilings_figure_is_the_steady_median_after_a_first_call_and_warm_up():
    """measure_ceilings' timing, on the CPU with the fake timer (a GPU alone runs the rest):
    one untimed first call, warm-up batches, then the median of single-call timings."""
    from suite.harness.timing import steady_median_ms

    log: list = []
    fn = _Counted("copy")
    assert steady_median_ms(FakeTimer({"copy": (2.0, 0.0)}, log), fn, n_calls=20) == pytest.approx(2.0)
    assert fn.calls == 1 and len(log) >= 3  # two warm-up batches at least, then the timing
    assert all(entry == ("calls", "copy", False, 1, True) for entry in log)


def test_ceiling_fraction_without_ceilings_fails():
    criterion = (NotSlowerThan(), CeilingFraction(0.1, presets=("small",), cases=("fwd",)))
    result, _ = bench(EXACT, criterion, ceilings=None)
    assert not result.criteria[1].passed and "no ceilings" in result.criteria[1].detail
    assert next(t for t in result.contenders if t.name == "arm").ceiling_fraction is None


def test_ceiling_fraction_for_another_case_is_not_checked():
    criterion = (NotSlowerThan(), CeilingFraction(0.99, presets=("small",), cases=("bwd",)))
    result, _ = bench(EXACT, criterion, ceilings=CEILINGS)
    assert len(result.criteria) == 1 and result.passed


# ---- contenders, cold call, order --------------------------------------------------------


def test_unavailable_peer_is_listed_and_not_timed():
    criterion = (NotSlowerThan(), NotSlowerThan("liger"))
    contenders = make_contenders(unavailable={"liger": "liger-kernel is not installed"})
    result, timer = bench(EXACT, criterion, contenders=contenders)
    liger = next(t for t in result.contenders if t.name == "liger")
    assert liger.unavailable == "liger-kernel is not installed"
    assert liger.cold_ms is None and liger.median_ms is None and liger.round_medians_ms == []
    assert all(entry[1] != "liger" for entry in timer.log)
    assert [c.against for c in result.comparisons] == ["reference"]
    check = next(k for k in result.criteria if k.name == "not slower than liger")
    assert check.passed and "skipped" in check.detail and "not installed" in check.detail
    assert result.passed


def test_cold_call_is_reported_alone_and_kept_out_of_the_medians():
    result, timer = bench({"reference": (1.0, 0.01), "arm": (0.5, 0.01)})
    for t in result.contenders:
        assert t.cold_ms == COLD_MS
        assert max(t.round_medians_ms) < 2.0
    assert against(result, "reference").speedup == pytest.approx(2.0, rel=0.02)
    # each contender's cold call comes before anything else it is asked to do
    for name in ("reference", "arm"):
        first = next(entry for entry in timer.log if entry[1] == name)
        assert first[0] == "cold"
    assert sum(entry[0] == "cold" for entry in timer.log) == 2


def test_rounds_are_abba():
    log: list = []
    dists = {"reference": (1.0, 0.01), "arm": (0.5, 0.01), "p1": (0.8, 0.01), "p2": (0.9, 0.01)}
    result, _ = bench(dists, contenders=make_contenders("p1", "p2"), log=log,
                      progress=lambda message: log.append(("progress", message)))
    marks = [i for i, entry in enumerate(log) if entry[0] == "progress" and "round" in entry[1]
             and "extending" not in entry[1]]
    assert len(marks) == result.rounds
    forward, backward = ["reference", "arm", "p1", "p2", "reference"], ["reference", "p2", "p1", "arm", "reference"]
    for index, (start, stop) in enumerate(zip(marks, marks[1:] + [len(log)])):
        calls = [entry for entry in log[start + 1:stop] if entry[0] == "calls"]
        # one timing a call, the contenders taking turns: forward, then backward
        turns = [[entry[1] for entry in calls[i:i + 5]] for i in range(0, len(calls), 5)]
        assert len(turns) == result.calls_per_round
        first = forward if index % 2 == 0 else backward
        assert turns == [first if t % 2 == 0 else first[::-1] for t in range(len(turns))]
    assert [c.against for c in result.comparisons] == ["reference", "p1", "p2"]
    assert against(result, "p1").speedup == pytest.approx(1.6, rel=0.02)


class DriftingTimer(FakeTimer):
    """The host-bound contenders' timings are scaled by the host's state at that moment (clocks,
    other load), the same for each of them: a level that holds for a while, then jumps to
    another (a seeded walk; `switch` is the chance per timing). The others (a device-bound
    reference) do not see it, so the A/A floor does not either."""

    def __init__(self, dists, host_bound: set[str], switch: float) -> None:
        super().__init__(dists)
        self.walk = np.random.default_rng(2)
        self.host_bound, self.switch, self.level = host_bound, switch, 1.0

    def time_calls(self, fn, n, *, flush_l2, window, lead_in=True):
        times = []
        for ms in self._draw(fn.name, n):
            if self.walk.random() < self.switch:
                self.level = float(self.walk.lognormal(0.0, 0.15))
            times.append(ms * self.level if fn.name in self.host_bound else ms)
        return times


def test_a_drift_of_the_host_falls_on_every_contender_of_a_round_alike():
    # arm and twin are the same call; only the host's state jumps about. Timed in batches, each
    # would catch a different state and the tie read as ambiguous; taking turns timing by
    # timing, they see the same states and tie within the floor
    timer = DriftingTimer({"reference": (1.0, 0.001), "arm": (0.1, 0.0), "twin": (0.1, 0.0)},
                          host_bound={"arm", "twin"}, switch=0.02)
    result = measure_bench(make_case(), "eager", make_contenders("twin"), PRESET,
                           (NotSlowerThan("twin"),), None, POLICY, timer)
    twin = against(result, "twin")
    assert twin.verdict == "same", twin
    assert 1 - result.noise_floor <= twin.ci_low <= twin.ci_high <= 1 + result.noise_floor
    assert result.passed


def test_round_order():
    assert round_order("ref", [], ["a", "b"], 0) == ["ref", "a", "b", "ref"]
    assert round_order("ref", [], ["a", "b"], 3) == ["ref", "b", "a", "ref"]
    # the judged peers mirrored inside the reference's pair, the others reversing on odd rounds
    assert round_order("ref", ["p", "q"], ["a", "b"], 1) == ["ref", "p", "q", "b", "a", "q", "p", "ref"]


@pytest.mark.parametrize("l2, flush", [("cold", True), ("warm", False)])
def test_l2_flush_follows_the_case(l2, flush):
    _, timer = bench(EXACT, case=make_case(l2=l2))
    assert {entry[2] for entry in timer.log if entry[0] == "calls"} == {flush}


def test_a_long_call_with_a_short_tail_times_without_the_lead_in():
    # a 40 ms host-bound reference has 0.05 ms queued when it returns (under 0.25% of its call):
    # an idle start adds at most that, so it pays no untimed call before its timings. A 40 ms
    # step captured in one graph has all of it queued and keeps its lead-in, as the 0.1 ms arm does
    log: list = []
    result, _ = bench({"reference": (40.0, 0.01), "arm": (0.1, 0.01), "captured": (40.0, 0.01)},
                      mode="eager", log=log, contenders=make_contenders("captured"),
                      tails={"reference": 0.05})
    assert {e[1] for e in log if e[0] == "tail"} == {"reference", "captured"}  # 5 ms and more only
    without = [e for e in log if e[0] == "calls" and e[4] is False]
    assert without and {e[1] for e in without} == {"reference"}
    # one a round per turn: every round timing of the reference, none of its warm-up's
    assert len(without) == 2 * result.rounds * result.calls_per_round
    tails = {t.name: t.idle_start_tail_ms for t in result.contenders}
    assert tails == {"reference": 0.05, "arm": None, "captured": None}
    assert "timed from an idle device (no lead-in call; 0.050 ms queued at return)" in "\n".join(render._bench_section(result))


@pytest.mark.parametrize("mode, l2", [("graph", "warm"), ("graph", "cold"), ("wall", "warm")])
def test_graph_replays_and_wall_timings_never_ask_for_a_tail(mode, l2):
    # a replay's tail is its whole call (and a cold one's flush is its lead-in); a wall timing
    # waits for its work. Eager calls ask, cold-L2 ones too: they rotate inputs, they flush nothing
    log: list = []
    bench({"reference": (40.0, 0.01), "arm": (40.0, 0.01)}, mode=mode, log=log, tails={"reference": 0.0},
          case=make_case(l2=l2, modes=(mode,)))
    assert not [e for e in log if e[0] == "tail"] and all(e[4] for e in log if e[0] == "calls")


class ScriptedTimer:
    """Batch k of a contender has every call at script[k]; past the script, 1.0 ms."""

    def __init__(self, script: list[float]) -> None:
        self.script = script
        self.batches: dict[str, int] = {}
        self.windows: set[int] = set()

    def time_calls(self, fn, n, *, flush_l2, window, lead_in=True):
        k = self.batches.get(fn.name, 0)
        self.batches[fn.name] = k + 1
        self.windows.add(window)
        return [self.script[k] if k < len(self.script) else 1.0] * n

    def time_cold(self, fn):
        return 5.0


def test_warm_up_runs_until_two_batch_medians_agree():
    # one sizing call (4.0), then medians 3, 2, 1.5, 1.0, 1.01: steady at the 5th batch (within
    # 2% of the 4th)
    timer = ScriptedTimer([4.0, 3.0, 2.0, 1.5, 1.0, 1.01, 9.0])
    case = make_case(modes=("eager",), window=4, l2="warm")
    policy = TimingPolicy(warmup_cap_s=60.0, long_call_ms=1e9, round_budget_ms=1e9)
    result = measure_bench(case, "eager", make_contenders(), PRESET, (), None, policy, timer)
    # 2 contenders x (1 sizing call + 5 batches x 10 timings x 4 calls a window)
    assert result.warmup_calls == 2 * (1 + 5 * 10 * 4)
    assert timer.windows == {1, 4} and result.window == 4 and result.mode == "eager"  # 1: the sizing call
    assert all(t.median_ms == 1.0 for t in result.contenders)  # the 9.0 batch was never used


def test_warm_up_stops_at_the_cap():
    timer = ScriptedTimer([1.0, 2.0] * 100_000)  # never steady
    policy = TimingPolicy(warmup_cap_s=0.05)
    result = measure_bench(make_case(), "graph", make_contenders(), PRESET, (), None,
                           policy, timer)
    assert 2 * 2 * 10 <= result.warmup_calls < 2 * 200_000 * 10


def test_round_shape_gives_slow_calls_fewer_timings_and_one_call_windows():
    policy = TimingPolicy(calls_per_round=10, min_calls_per_round=3, round_budget_ms=60.0, long_call_ms=1.0)
    assert timing.round_shape(policy, {"a": 0.05}, 5, "eager") == (10, {"a": 5})  # fast: as configured
    assert timing.round_shape(policy, {"a": 2.0}, 5, "eager") == (10, {"a": 1})  # 1 ms and more: one call
    assert timing.round_shape(policy, {"a": 12.0}, 5, "eager") == (5, {"a": 1})  # 60 ms a round
    assert timing.round_shape(policy, {"a": 500.0}, 5, "eager") == (3, {"a": 1})  # never under the minimum
    assert timing.round_shape(policy, {"a": 12.0}, 1, "graph") == (5, {"a": 1})
    assert timing.round_shape(policy, {"a": 2.0}, 5, "wall") == (10, {"a": 1})
    # unjudged, a slow contender beside a fast one: each its own window
    assert timing.round_shape(policy, {"ref": 3.0, "arm": 0.2}, 5, "eager") == (10, {"ref": 1, "arm": 5})
    assert timing.round_shape(policy, {"ref": 20.0, "arm": 0.2}, 5, "eager") == (3, {"ref": 1, "arm": 5})
    # judged against each other they share the fast one's window: no ratio mixes two methods
    shared = ("ref", "arm")
    assert timing.round_shape(policy, {"ref": 3.0, "arm": 0.2}, 5, "eager", shared) == (4, {"ref": 5, "arm": 5})
    assert timing.round_shape(policy, {"ref": 3.0, "arm": 2.9}, 5, "eager", shared) == (10, {"ref": 1, "arm": 1})
    assert timing.round_shape(policy, {"ref": 0.8, "arm": 0.4, "slow peer": 22.0}, 5, "eager", shared) == (
        3, {"ref": 5, "arm": 5, "slow peer": 1})


def test_a_slow_peer_times_one_call_a_window_beside_a_fast_arm():
    # a 22 ms for-loop AdamW beside a 0.4 ms arm: its 5-call windows cost 110 ms each (most of
    # graph-capture's adamw-step bench at dispatch-bound) and hid nothing an event pair costs.
    # A 1.2 ms reference judged against the 0.4 ms arm keeps the arm's window
    policy = TimingPolicy(warmup_cap_s=0.0, long_call_ms=1.0, round_budget_ms=60.0)
    log: list = []
    result, _ = bench({"reference": (1.2, 0.01), "arm": (0.4, 0.01), "for-loop": (22.0, 0.01)},
                      contenders=make_contenders("for-loop"), policy=policy, mode="eager", log=log,
                      case=make_case(window=5))
    windows = {t.name: t.window for t in result.contenders}
    assert windows == {"reference": 5, "arm": 5, "for-loop": 1} and result.window == 5
    assert {e[3] for e in log if e[0] == "calls" and e[1] == "for-loop"} == {1}
    assert "windows of 5 back-to-back calls (one call for for-loop: a millisecond or more a call)" in \
        "\n".join(render._bench_section(result))


def test_a_slow_contender_shrinks_the_round_and_the_report_says_so():
    timer = FakeTimer({"reference": (40.0, 0.01), "arm": (20.0, 0.01)})
    result = measure_bench(make_case(window=5), "eager", make_contenders(), PRESET, (), None,
                           TimingPolicy(warmup_cap_s=0.0), timer)
    assert result.calls_per_round == 3 and result.window == 1
    assert {entry[3] for entry in timer.log if entry[0] == "calls"} == {1}  # sized by the first call
    assert result.warmup_calls == 2 * (1 + 3)  # a sizing call, then one batch of 3 (no warm-up cap)


class BusyTimer(FakeTimer):
    busy = {"reference": 5.0, "arm": 5.0}

    def busy_ms(self, fn, window):
        return self.busy[fn.name]


class PeakTimer(FakeTimer):
    held = {"reference": 3 << 30, "arm": 1 << 30, "peer": 2 << 30}

    def peak_bytes(self, fn):
        self.log.append(("peak", fn.name))
        return self.held[fn.name]


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_each_contenders_memory_a_call_is_measured_in_eager_mode_and_reported(mode):
    """Beside its time, the memory a warm call of each contender holds (its outputs and
    temporaries): eager mode only, where a call allocates (a replay's memory is its graph's pool)."""
    log = []
    timer = PeakTimer({"reference": (2.0, 0.01), "arm": (1.0, 0.01), "peer": (1.5, 0.01)}, log)
    result = measure_bench(make_case(), mode, make_contenders("peer"), PRESET, NOT_SLOWER, None, POLICY, timer)
    held = {c.name: c.call_peak_bytes for c in result.contenders}
    text = "\n".join(render._bench_section(result))
    if mode == "graph":
        assert held == dict.fromkeys(held) and not [e for e in log if e[0] == "peak"]
        assert "at its peak" not in text
        return
    assert held == PeakTimer.held
    # one block after every warm-up, before the rounds: each round times every contender again
    peaks = [i for i, e in enumerate(log) if e[0] == "peak"]
    assert peaks == list(range(peaks[0], peaks[0] + 3))
    warmed = [e[1] for e in log[:peaks[0]] if e[0] == "calls"]
    assert all(warmed.count(name) >= 2 for name in held)  # the sizing call, then a warm-up batch
    rounds = [e[1] for e in log[peaks[-1] + 1:] if e[0] == "calls"]
    assert len(rounds) >= result.rounds * result.calls_per_round * 3
    assert "a call holds 1.000 GiB at its peak" in text and "a call holds 3.000 GiB at its peak" in text


def test_a_peer_whose_call_fails_when_its_memory_is_measured_is_dropped_with_the_error():
    class FailingPeer(PeakTimer):
        def peak_bytes(self, fn):
            if fn.name == "peer":
                raise RuntimeError("CUDA out of memory")
            return super().peak_bytes(fn)

    timer = FailingPeer({"reference": (2.0, 0.01), "arm": (1.0, 0.01), "peer": (1.5, 0.01)})
    result = measure_bench(make_case(), "eager", make_contenders("peer"), PRESET, NOT_SLOWER, None, POLICY, timer)
    peer = next(c for c in result.contenders if c.name == "peer")
    assert peer.unavailable == "a call measured for its memory failed: RuntimeError: CUDA out of memory"
    assert result.passed


def test_a_busy_bound_without_a_busy_time_fails_rather_than_divides_by_zero():
    case = make_case(modes=("eager",), gpu_busy=True, l2="warm")
    criterion = (BusyBound(1.05, presets=(PRESET.name,), cases=("fwd",)),)
    timer = BusyTimer({"reference": (10.0, 0.01), "arm": (5.0, 0.01)})
    timer.busy = {"reference": 0.0, "arm": 0.0}  # a profile that saw no kernel
    result = measure_bench(case, "eager", make_contenders(), PRESET, criterion, None, POLICY, timer)
    assert not result.passed and "measured no device-busy time" in result.criteria[0].detail


@pytest.mark.parametrize("arm_ms, passed", [(5.2, True), (6.0, False)])
def test_a_capture_must_come_within_the_bound_of_the_eager_steps_device_time(arm_ms, passed):
    # the eager reference: 10 ms of wall time, 5 of them busy on the device
    case = make_case(modes=("eager",), gpu_busy=True, l2="warm")
    criterion = (BusyBound(1.05, presets=(PRESET.name,), cases=("fwd",)),)
    timer = BusyTimer({"reference": (10.0, 0.01), "arm": (arm_ms, 0.01)})
    result = measure_bench(case, "eager", make_contenders(), PRESET, criterion, None, POLICY, timer)
    check, = result.criteria
    assert check.passed is passed and result.passed is passed
    assert "reference busy 5 ms" in check.detail and "wall/busy: 1.99" in check.detail


# ---- misuse ------------------------------------------------------------------------------


def _eager_over(graph_ms: float, graph_floor: float, eager: tuple[float, float], bound: float = 1.1,
                method: str = "", policy: TimingPolicy = POLICY):
    """The eager bench of a case whose graph mode timed the arm at graph_ms a call, with the
    eager-over-graph bound declared; `eager` is the arm's (ms, sigma) in eager calls."""
    from factories import make_bench

    graph = make_bench("fwd", mode="graph", reference_ms=2 * graph_ms, arm_ms=graph_ms, noise_floor=graph_floor)
    graph.contenders = [c.model_copy(update={"method": method}) if c.role == "arm" else c for c in graph.contenders]
    criterion = (EagerOverGraph(bound, presets=("small",), cases=("fwd",)),)
    timer = FakeTimer({"reference": (3 * graph_ms, eager[1]), "arm": eager})
    result = measure_bench(make_case(), "eager", make_contenders(), PRESET, criterion, None, policy, timer,
                           graph=graph)
    return result, next(c for c in result.criteria if c.name == f"eager calls within {bound:g}x of graph replays")


@pytest.mark.parametrize("eager_ms, passed", [(10.8, True), (11.5, False)])
def test_eager_calls_must_stay_within_the_bound_of_graph_replays(eager_ms, passed):
    result, check = _eager_over(10.0, 0.005, (eager_ms, 0.001))
    assert check.passed is passed and result.passed is passed and not check.ambiguous
    assert f"= {eager_ms / 10:.3f} (CI" in check.detail and "needs <= 1.1 within the floor" in check.detail
    assert result.rounds == POLICY.min_rounds  # clear either way: no round added


def test_a_bound_inside_the_eager_noise_is_not_failed_on_one_pair_of_medians():
    """The case `suite run` failed on: eager 1.156x graph against a bound of 1.1, with eager
    calls whose A/A floor was about 19%. The ratio is inside the noise, so it is no clear fail:
    within the floor of the bound it passes; a ratio clear beyond bound and floor still fails."""
    noisy = (1.335, 0.3)  # the arm's eager calls; the reference is as noisy
    result, check = _eager_over(1.155, 0.01, noisy)
    assert 0.1 < result.noise_floor < 0.3
    assert check.passed and not check.ambiguous and result.passed
    result, check = _eager_over(1.155, 0.01, (2.0, 0.3))  # 1.73x graph
    assert not check.passed and not check.ambiguous and not result.passed


def test_an_undecided_eager_over_graph_adds_rounds_then_stays_ambiguous():
    """Quiet reference, wildly noisy arm right at the bound's edge: the CI straddles the bound
    beyond the floor on every count of rounds, so rounds are added to the cap and the check
    ends ambiguous (exit 4), never a pass and never a fail."""
    messages: list[str] = []
    from factories import make_bench

    graph = make_bench("fwd", mode="graph", reference_ms=2.0, arm_ms=1.0, noise_floor=0.005)
    criterion = (EagerOverGraph(1.1, presets=("small",), cases=("fwd",)),)
    timer = FakeTimer({"reference": (3.0, 0.001), "arm": (1.16, 0.6)})
    result = measure_bench(make_case(), "eager", make_contenders(), PRESET, criterion, None, POLICY, timer,
                           progress=messages.append, graph=graph)
    check = result.criteria[-1]
    assert result.rounds == POLICY.max_rounds and check.ambiguous and not check.passed
    assert result.ambiguous and not result.passed and "never a pass" in check.detail
    assert any("undecided: eager calls within 1.1x of graph replays" in m for m in messages)


def test_a_graph_mode_that_timed_no_replays_cannot_vouch_for_eager():
    result, check = _eager_over(10.0, 0.005, (10.0, 0.001), method="eager calls (capture failed for reference: ...)")
    assert not result.passed and not check.passed and "timed no replays" in check.detail


def test_an_eager_bound_with_no_graph_figures_fails_rather_than_goes_unjudged():
    criterion = (EagerOverGraph(1.1, presets=("small",), cases=("fwd",)),)
    result = measure_bench(make_case(), "eager", make_contenders(), PRESET, criterion, None, POLICY,
                           FakeTimer(EXACT))
    check, = result.criteria
    assert not check.passed and not result.passed and "no graph replays" in check.detail


def test_unavailable_arm_is_refused():
    contenders = [Timed("reference", "reference", FakeFn("reference")), Timed("arm", "arm", None, "no triton")]
    with pytest.raises(ValueError, match="no triton"):
        measure_bench(make_case(), "graph", contenders, PRESET, (), None, POLICY,
                      FakeTimer(EXACT))


def test_policy_refuses_a_single_round():
    with pytest.raises(ValueError):
        TimingPolicy(min_rounds=1)


def test_cuda_timer_sequence_on_stand_ins(monkeypatch):
    """CudaTimer's control flow with stand-ins for CUDA (the real run is the cuda test)."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self) -> None:
            log.append("record")

        def elapsed_time(self, end: "Event") -> float:
            return 6.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    timer = CudaTimer("cuda")
    monkeypatch.setattr(timer, "_flush_buffer",
                        lambda: SimpleNamespace(zero_=lambda: log.append("flush")))

    # 6 ms over a window of 3 calls: 2 ms per call
    assert timer.time_calls(lambda: log.append("fn"), 2, flush_l2=True, window=3) == [2.0, 2.0]
    one_pair = ["flush", "record", "fn", "fn", "fn", "record"]
    assert log == ["sync", *one_pair, *one_pair, "sync"]

    log.clear()
    # no flush: one untimed call first, so the pair starts behind work of the call's own
    timer.time_calls(lambda: log.append("fn"), 2, flush_l2=False, window=1)
    assert log == ["sync", "fn", "record", "fn", "record", "record", "fn", "record", "sync"]

    log.clear()
    assert timer.time_cold(lambda: log.append("fn")) >= 0
    assert log == ["sync", "fn", "sync"]


# ---- the real thing ----------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_single_copy_beats_double_copy_and_ceilings_are_plausible():
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    assert 0 < ceilings.copy_gbps < 100_000 and ceilings.copy_bytes > 0
    assert 0 < ceilings.gemm_bf16_tflops < 100_000 and ceilings.gemm_n == 8192
    assert measure_ceilings(device) is ceilings  # measured once per device

    src = torch.randint(-(2**31), 2**31 - 1, (16 << 20,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)  # 64 MB each

    def once():
        dst.copy_(src)

    def twice():
        dst.copy_(src)
        dst.copy_(src)

    contenders = [Timed("reference", "reference", twice), Timed("arm", "arm", once)]
    case = BenchCase(name="copy", description="64 MB copy", bytes=lambda preset: 2 * src.nbytes)
    preset = Preset(name="copy64", params={})
    result = measure_bench(case, "graph", contenders, preset, NOT_SLOWER, ceilings, TimingPolicy(),
                           CudaTimer(device))
    assert against(result, "reference").verdict == "faster"
    assert result.passed
    arm = next(t for t in result.contenders if t.name == "arm")
    assert arm.cold_ms > 0 and arm.gbps > 0 and 0 < arm.ceiling_fraction < 2


def _cmp(speedup, low, high, floor_log):
    from suite.harness.results import Comparison

    return Comparison(against="x", speedup=speedup, ci_low=low, ci_high=high,
                      verdict=stats.judge(speedup, low, high, floor_log), noise_floor=math.expm1(floor_log))


def test_not_slower_is_one_sided():
    """Not slower is at least 1x within the floor: one-sided, where the verdict is two-sided."""
    floor = math.log1p(0.02)
    for c, decision in ((_cmp(1.03, 0.999, 1.10, floor), "pass"),  # ambiguous two-sided
                        (_cmp(1.0, 0.97, 1.03, floor), "undecided"), (_cmp(0.90, 0.88, 0.92, floor), "fail")):
        assert stats.reaches(c.speedup, c.ci_low, c.ci_high, 1.0, floor) == decision


def test_reaches_and_stays_within_are_three_way_against_the_floor():
    """Every criterion's decision: a clear pass (the CI within the floor of the bar), a clear
    fail (the CI beyond the bar and the figure beyond the floor), else undecided."""
    floor = math.log1p(0.02)
    assert stats.reaches(2.0, 1.97, 2.1, 2.0, floor) == "pass"
    assert stats.reaches(1.9, 1.7, 2.1, 2.0, floor) == "undecided"
    assert stats.reaches(1.5, 1.4, 1.6, 2.0, floor) == "fail"
    assert stats.reaches(1.97, 1.9, 1.99, 2.0, floor) == "undecided"  # below the bar, inside the floor
    # at most: the mirror of at least
    assert stats.stays_within(1.156, 1.12, 1.19, 1.1, math.log1p(0.194)) == "pass"
    assert stats.stays_within(1.156, 1.12, 1.19, 1.1, math.log1p(0.01)) == "fail"
    assert stats.stays_within(1.10, 0.9, 1.4, 1.1, math.log1p(0.01)) == "undecided"


def test_median_ratio_of_two_series_timed_apart():
    rng = np.random.default_rng(0)
    ratio, low, high = stats.median_ratio([2.0] * 5, [1.0] * 7, 200, 0.95, rng)
    assert (ratio, low, high) == (2.0, 2.0, 2.0)
    num = list(np.random.default_rng(1).lognormal(np.log(2.0), 0.1, 20))
    ratio, low, high = stats.median_ratio(num, [1.0] * 20, 2000, 0.95, np.random.default_rng(0))
    assert low < ratio < high and 1.8 < low and high < 2.2


@pytest.mark.parametrize("enabled_before", [True, False])
def test_garbage_collector_is_off_inside_a_timed_window_and_restored_after(enabled_before):
    import gc

    (gc.enable if enabled_before else gc.disable)()
    try:
        with timers._collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled_before
        with pytest.raises(KeyError), timers._collector_paused():
            raise KeyError("a failing call inside the window")
        assert gc.isenabled() is enabled_before
    finally:
        gc.enable()


# ---- modes: graph replays, eager windows, the host's clock ---------------------------------


def test_eager_mode_times_windows_of_back_to_back_calls_without_a_flush():
    _, timer = bench(EXACT, case=make_case(window=7), mode="eager")
    calls = {(entry[2], entry[3]) for entry in timer.log if entry[0] == "calls"}
    assert calls == {(False, 1), (False, 7)}  # rotation, not a flush, keeps a cold case cold (1: sizing)
    _, timer = bench(EXACT, case=make_case(window=7), mode="graph")
    assert {(entry[2], entry[3]) for entry in timer.log if entry[0] == "calls"} == {(True, 1)}


def test_criteria_can_name_one_mode():
    criterion = (NotSlowerThan(modes=("graph",)),
                 CeilingFraction(0.99, presets=("small",), cases=("fwd",), modes=("graph",)))
    graph, _ = bench(EXACT, criterion, ceilings=CEILINGS, mode="graph")
    eager, _ = bench(EXACT, criterion, ceilings=CEILINGS, mode="eager")
    assert [c.name for c in graph.criteria] == ["not slower than reference", "copy ceiling fraction >= 0.99"]
    assert not graph.passed  # 0.8 of the copy ceiling
    assert eager.criteria == [] and eager.passed
    assert (graph.mode, eager.mode) == ("graph", "eager")


def test_a_named_contender_not_timed_in_a_case_is_not_judged_there():
    criterion = (NotSlowerThan(), NotSlowerThan("peer-of-another-case"))
    result, _ = bench(EXACT, criterion)
    assert [c.name for c in result.criteria] == ["not slower than reference"]


def test_rotation_uses_each_input_set_in_turn():
    used = []
    rotation = Rotation([lambda i=i: used.append(i) for i in range(3)])
    for _ in range(7):
        rotation()
    assert used == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        Rotation([])


def test_wall_timer_runs_a_bench_on_the_cpu():
    slow, fast = (lambda: sum(range(20000))), (lambda: sum(range(2000)))
    contenders = [Timed("reference", "reference", slow), Timed("arm", "arm", fast)]
    case = make_case(modes=("wall",), window=3, bytes=lambda preset: 0)
    result = measure_bench(case, "wall", contenders, PRESET, NOT_SLOWER, None,
                           TimingPolicy(warmup_cap_s=0.0, calls_per_round=3), WallTimer())
    assert result.mode == "wall" and result.window == 3
    assert against(result, "reference").speedup > 1
    assert all(t.median_ms > 0 and t.cold_ms > 0 for t in result.contenders)


def test_host_time_per_call_is_the_best_batch():
    syncs, calls = [], []
    us = timers.host_us_per_call(lambda: calls.append(1), lambda: syncs.append(1), calls=10, batches=3)
    assert 0 <= us < 1000
    # before and after each of an untimed and a sizing batch of 5 calls, then 3 batches of 10
    assert len(syncs) == 2 * 5 and len(calls) == 2 * 5 + 3 * 10


def test_a_slow_call_gets_batches_of_fewer_calls():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.004)

    us = timers.host_us_per_call(slow, lambda: None, calls=200, batches=2, batch_ms=20.0)
    assert us >= 4000 and len(calls) == 2 * 5 + 2 * 5  # 20 ms holds no more than 5 calls of 4+ ms


class FailingTimer(FakeTimer):
    """Raises on the first call of the named contenders, as a graph break under fullgraph does."""

    def __init__(self, dists, failing):
        super().__init__(dists)
        self.failing = failing

    def time_cold(self, fn):
        if fn.name in self.failing:
            raise RuntimeError(f"{fn.name} cannot run here\nsecond line")
        return super().time_cold(fn)


def test_a_peer_that_fails_its_first_call_is_reported_not_fatal():
    criterion = (NotSlowerThan(), NotSlowerThan("broken"))
    timer = FailingTimer({**EXACT, "fine": (0.7, 0.0)}, {"broken"})
    result = measure_bench(make_case(), "eager", make_contenders("broken", "fine"), PRESET, criterion, None,
                           POLICY, timer)
    broken = next(t for t in result.contenders if t.name == "broken")
    assert broken.unavailable == "its first call failed: RuntimeError: broken cannot run here"
    assert [c.against for c in result.comparisons] == ["reference", "fine"]
    assert result.passed and "skipped: broken unavailable" in result.criteria[1].detail
    with pytest.raises(RuntimeError):  # the arm failing is no peer's problem: it propagates
        measure_bench(make_case(), "eager", make_contenders(), PRESET, criterion, None, POLICY,
                      FailingTimer(EXACT, {"arm"}))


def test_rotation_sets_hold_twice_the_l2_and_stay_bounded():
    from suite.harness.runner import MAX_ROTATION, rotation_sets

    l2 = 50 << 20
    for set_bytes in (1 << 20, 32 << 20, 33 << 20, 256 << 20):
        n = rotation_sets(set_bytes, l2)
        assert n >= 1 and (n * set_bytes >= 2 * l2 or n == MAX_ROTATION)
    assert rotation_sets(256 << 20, l2) == 1  # one set already misses the L2
    assert rotation_sets(1 << 20, l2) == MAX_ROTATION


# ---- the runner's phases name the host probe's seconds --------------------------------------


def test_the_host_probe_is_a_phase_of_the_first_preset_that_needs_it(monkeypatch):
    """Host times are probed once a run, and their seconds are a phase of the preset that paid
    them (a report accounts for every second of a gate); later presets reuse the figures."""
    from types import SimpleNamespace

    from suite.harness import runner as runner_module
    from suite.harness.runner import RunOptions, Runner, Unit

    class ProbeTimer:
        def __init__(self, device):
            pass

        def host_us(self, fn):
            return 12.5

    monkeypatch.setattr(runner_module, "CudaTimer", ProbeTimer)
    contenders = [SimpleNamespace(name=n, role=r, unavailable=lambda device: None, build=lambda *a: (lambda: None))
                  for n, r in (("reference", "reference"), ("arm", "arm"))]
    gate = SimpleNamespace(name="toy", host_probe="probe", preset=lambda name: SimpleNamespace(name=name),
                           make_buffers=lambda preset, seed, device: {})
    run = Runner(RunOptions(device=torch.device("cuda")))
    case = SimpleNamespace(name="fwd", presets=None, own_stream=False)
    first, later = {}, {}
    unit = Unit(gate=gate, preset=SimpleNamespace(name="big"))
    assert run._host_times(unit, case, contenders, first) == {"reference": 12.5, "arm": 12.5}
    assert list(first) == ["host probe fwd"]
    assert run._host_times(unit, case, contenders, later) == {"reference": 12.5, "arm": 12.5}
    assert later == {}
    # a case timed only at other presets is never built at the probe's shape (moe-bwd's block)
    only_big = SimpleNamespace(name="block", presets=("big",), own_stream=False)
    assert run._host_times(unit, only_big, contenders, later) == {} and later == {}


def test_the_gates_peak_keeps_what_came_before_a_memory_measure_even_when_the_case_raises(monkeypatch):
    """A call measured for its memory resets the device's peak counter; the runner folds the
    peak before it into the gate's, after the bench and when the bench raises (an OOM in a
    round), so the gate's peak (parity's, usually the largest) is never lost."""
    from types import SimpleNamespace

    from suite.harness import runner as runner_module
    from suite.harness.runner import RunOptions, Runner

    class ResetTimer:
        def __init__(self, device):
            self.peak_before_reset = 7 << 30

    def raising(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(runner_module, "CudaTimer", ResetTimer)
    gate = SimpleNamespace(name="toy", host_probe=None, criteria=())
    case = make_case(l2="warm")
    run = Runner(RunOptions(device=torch.device("cuda")))
    for bench_returns in (lambda *a, **k: "timed", raising):
        monkeypatch.setattr(runner_module, "measure_bench", bench_returns)
        run._unit_peak = 1 << 30
        try:
            assert run._time_case(gate, case, "eager", [], {}, PRESET, {}) == "timed"
        except torch.cuda.OutOfMemoryError:
            assert bench_returns is raising
        assert run._unit_peak == 7 << 30


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("flush_l2, lead_in, calls", [(False, True, 1 + 3 * 2), (False, False, 3 * 2), (True, True, 3 * 2)])
def test_cuda_timings_start_behind_one_untimed_call_unless_flushed_or_told_not_to(flush_l2, lead_in, calls):
    made = []
    times = CudaTimer("cuda").time_calls(lambda: made.append(1), 3, flush_l2=flush_l2, window=2, lead_in=lead_in)
    assert len(times) == 3 and len(made) == calls


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tail_is_the_device_work_a_call_leaves_queued():
    timer = CudaTimer("cuda")
    spin = 50_000_000  # clock cycles: 12-25 ms at 2-4 GHz

    def synced():
        torch.cuda._sleep(spin)
        torch.cuda.synchronize()

    assert timer.tail_ms(lambda: torch.cuda._sleep(spin)) > 5.0  # returned at once, all of it queued
    assert timer.tail_ms(synced) < 1.0  # the host waited: nothing left


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_is_what_a_call_holds_above_what_it_found_and_keeps_the_peak_before():
    timer = CudaTimer("cuda")
    kept = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del kept  # a peak of 64 MiB before the measure, which the timer keeps for its caller
    held = timer.peak_bytes(lambda: torch.empty(32 << 20, dtype=torch.uint8, device="cuda").fill_(1))
    assert 32 << 20 <= held < 34 << 20
    assert timer.peak_before_reset >= 64 << 20


# ---- recommendations (BenchCase.recommend) -----------------------------------------------


def test_recommendations_judge_each_contender_against_its_baseline():
    contenders = make_contenders("slow peer", "captured")
    contenders.append(Timed("muon", "peer", FakeFn("muon")))
    contenders[-2].baseline = "muon"  # "captured" is judged against eager "muon", not the reference
    dists = {"reference": (1.0, 0.005), "arm": (1.0, 0.005), "slow peer": (1.3, 0.005), "captured": (1.5, 0.005),
             "muon": (2.0, 0.005)}
    result, _ = bench(dists, case=make_case(recommend=True), contenders=contenders, mode="eager")
    by = {r.contender: r for r in result.recommendations}
    assert set(by) == {"arm", "slow peer", "captured", "muon"}
    assert by["captured"].against == "muon" and by["captured"].speedup == pytest.approx(2.0 / 1.5, rel=0.02)
    assert (by["captured"].verdict, by["captured"].advice) == ("faster", "switch on")
    assert (by["slow peer"].verdict, by["slow peer"].advice) == ("slower", "leave off")
    assert by["arm"].verdict == "same" and by["arm"].advice == "no gain: leave off"
    plain, _ = bench(dists, contenders=make_contenders("slow peer"), mode="eager")
    assert plain.recommendations == []  # only where the case asks


@pytest.mark.parametrize("aim, met", [(0.8, True), (0.81, False)])
def test_a_speedup_target_is_reported_met_or_missed_and_never_fails_the_bench(aim, met):
    """An issue's aim against a peer is judged like a bar and reported, but a miss leaves the
    bench passed (its figures can still be a baseline); the bars beside it still decide."""
    dists = {**EXACT, "peer": (0.4, 0.0)}  # arm 0.5 ms, peer 0.4 ms: 0.8x
    criterion = (NotSlowerThan(), Target(aim, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, criterion, contenders=make_contenders("peer"))
    check = next(c for c in result.criteria if c.name == f"target: speedup over peer >= {aim:g}x")
    assert check.target and check.passed is met and "0.800x" in check.detail
    assert result.passed and not result.ambiguous
    slow_ref = (NotSlowerThan(), SpeedupOver(3.0, presets=("small",), cases=("fwd",)),
                Target(0.5, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, slow_ref, contenders=make_contenders("peer"))
    assert not result.passed and next(c for c in result.criteria if c.target).passed


def test_a_bar_outranks_an_aim_against_the_same_peer_and_aims_add_no_rounds():
    dists = {"reference": (1.0, 0.001), "arm": (0.5, 0.05), "peer": (0.5, 0.001)}
    both = (SpeedupOver(0.75, "peer", presets=("small",), cases=("fwd",)),
            Target(1.1, "peer", presets=("small",), cases=("fwd",)))
    result, _ = bench(dists, both, contenders=make_contenders("peer"))
    assert [c.name for c in result.criteria if "peer" in c.name] == ["speedup over peer >= 0.75x"]
    # tied with the peer within the noise: a 1.0 aim stays undecided, which adds no round
    aim = (Target(1.05, "peer", presets=("small",), cases=("fwd",)),)
    result, _ = bench(dists, aim, contenders=make_contenders("peer"))
    check = next(c for c in result.criteria if c.target)
    assert result.rounds == POLICY.min_rounds and result.passed and not result.ambiguous and not check.passed


def test_an_aim_against_an_unavailable_peer_is_not_met():
    criterion = (Target(1.0, "peer", presets=("small",), cases=("fwd",)),)
    result, _ = bench(EXACT, criterion, contenders=make_contenders(unavailable={"peer": "no such kernel here"}))
    check = next(c for c in result.criteria if c.target)
    assert not check.passed and "no such kernel here" in check.detail and result.passed
