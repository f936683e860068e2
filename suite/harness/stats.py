"""The statistics of a bench: pure functions of the per-round figures (A/A noise floor,
bootstrap CI of the median ratio, verdicts, the criteria's decisions, round order, throughput)."""

from __future__ import annotations

import math
from typing import Literal, Sequence

import numpy as np

from suite.harness.results import Ceilings, Comparison, Verdict


def noise_floor(aa_log_ratios: Sequence[float], quantile: float, min_floor: float) -> float:
    """Log-space floor: the `quantile` of |log(first / second)| over rounds (one contender
    timed twice a round), but never below log(1 + min_floor)."""
    spread = float(np.quantile(np.abs(np.asarray(aa_log_ratios, dtype=float)), quantile))
    return max(spread, math.log1p(min_floor))


def bootstrap_ci(
    ratios: Sequence[float], n_boot: int, level: float, rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile bootstrap CI of the median, resampling rounds with replacement."""
    r = np.asarray(ratios, dtype=float)
    idx = rng.integers(0, len(r), size=(n_boot, len(r)))
    medians = np.median(r[idx], axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return float(low), float(high)


def judge(median: float, ci_low: float, ci_high: float, floor_log: float) -> Verdict:
    """Faster/slower need a CI clear of 1 and a median beyond the floor; "same" needs the whole
    CI inside the floor; anything else is ambiguous."""
    if math.log(ci_low) > 0 and math.log(median) > floor_log:
        return "faster"
    if math.log(ci_high) < 0 and math.log(median) < -floor_log:
        return "slower"
    if -floor_log <= math.log(ci_low) and math.log(ci_high) <= floor_log:
        return "same"
    return "ambiguous"


Decision = Literal["pass", "fail", "undecided"]


def reaches(value: float, low: float, high: float, bar: float, floor_log: float) -> Decision:
    """One-sided, for a figure with its CI: it reaches `bar` when the CI's low end, over bar, is
    within the floor; it falls short when the CI's high end and the figure, over bar, are below
    1 and the floor; otherwise more rounds may decide. A bar tighter than the run's own noise is
    so never judged on one pair of medians."""
    if math.log(high / bar) < 0 and math.log(value / bar) < -floor_log:
        return "fail"
    return "pass" if math.log(low / bar) >= -floor_log else "undecided"


def stays_within(value: float, low: float, high: float, bound: float, floor_log: float) -> Decision:
    """The mirror of `reaches`: the figure stays at or below `bound` within the floor."""
    return reaches(1 / value, 1 / high, 1 / low, 1 / bound, floor_log)


def median_ratio(
    num_ms: Sequence[float], den_ms: Sequence[float], n_boot: int, level: float, rng: np.random.Generator
) -> tuple[float, float, float]:
    """median(num) / median(den) of two series timed apart (not round by round, so not paired),
    with a percentile bootstrap CI that resamples each series on its own."""
    num, den = np.asarray(num_ms, dtype=float), np.asarray(den_ms, dtype=float)
    ratio = float(np.median(num) / np.median(den))
    boot_num = np.median(num[rng.integers(0, len(num), size=(n_boot, len(num)))], axis=1)
    boot_den = np.median(den[rng.integers(0, len(den), size=(n_boot, len(den)))], axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(boot_num / boot_den, [tail, 1.0 - tail])
    return ratio, float(low), float(high)


def compare(
    against: str,
    other_ms: Sequence[float],
    arm_ms: Sequence[float],
    floor_log: float,
    n_boot: int,
    ci_level: float,
    rng: np.random.Generator,
) -> Comparison:
    """Speedup of the arm = median over rounds of other/arm, with its bootstrap CI and verdict."""
    ratios = np.asarray(other_ms, dtype=float) / np.asarray(arm_ms, dtype=float)
    median = float(np.median(ratios))
    low, high = bootstrap_ci(ratios, n_boot, ci_level, rng)
    return Comparison(against=against, speedup=median, ci_low=low, ci_high=high,
                      verdict=judge(median, low, high, floor_log), noise_floor=math.expm1(floor_log))


def round_order(reference: str, judged: Sequence[str], others: Sequence[str], round_index: int) -> list[str]:
    """ABBA: the reference opens and closes every round, and each peer the arm is judged
    against (`judged`) takes the mirrored pair of slots inside it, so each of them has an A/A of
    its own; the others (the arm among them) reverse on odd rounds so drift (clocks, heat) does
    not always favour the same position."""
    middle = list(others) if round_index % 2 == 0 else list(reversed(others))
    return [reference, *judged, *middle, *reversed(judged), reference]


def steady(previous_ms: float, current_ms: float, tolerance: float) -> bool:
    """Warm-up is over when two consecutive batch medians agree within `tolerance`."""
    return abs(current_ms - previous_ms) <= tolerance * previous_ms


def throughput(
    nbytes: int, flops: int, ms: float, ceilings: Ceilings | None, ceiling: str
) -> tuple[float | None, float | None, float | None]:
    """(GB/s, TFLOP/s, fraction of the case's ceiling); None where the case declares nothing."""
    gbps = nbytes / ms / 1e6 if nbytes else None
    tflops = flops / ms / 1e9 if flops else None
    fraction = None
    if ceilings is not None:
        if ceiling == "gemm" and tflops is not None:
            fraction = tflops / ceilings.gemm_bf16_tflops
        elif ceiling == "copy" and gbps is not None:
            fraction = gbps / ceilings.copy_gbps
    return gbps, tflops, fraction


def copy_size(free_bytes: int, default: int = 1 << 30) -> int:
    """Source bytes of the ceiling copy: the default, capped to 1/8 of free memory (source and
    destination then take a quarter), rounded down to 1 MiB."""
    return max(min(default, free_bytes // 8) >> 20 << 20, 1 << 20)
