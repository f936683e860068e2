"""Arm against reference: bitwise or within a tolerance tied to a float64 truth.

Anti-cheat is part of every check: the arm's fresh allocations are poisoned (NaN for
floats) so an unwritten element cannot pass as a zero, its inputs are hashed before and
after, and it runs twice to prove it is deterministic unless the gate says why it is not.
Every failure names the check that found it (results.Check), which is what a saboteur
declares it must trip.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import torch

from suite.errors import CouldNotRun
from suite.harness.gate import Buffers, Gate, Outputs, Preset, Tolerance
from suite.harness.results import Check, Failure, ParityResult, TensorCheck

CHUNK_ELEMENTS = 1 << 24  # bounds the float64 temporaries on large tensors
# a truth row this far below the largest truth value is float64 rounding noise (fp32 resolves 6e-8)
NOISE = 1e-12
# A row can lose its whole value to rounding alone where its truth is within a few roundings of
# the tensor's scale (a sum of large terms that cancels): rows below this many epsilons of the
# working dtype x the RMS row norm are left to the error checks, not counted as lost.
ROUNDING_ROWS = 8

_BITS_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


@contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Fill every uninitialised allocation (torch.empty and friends) with NaN / max-int.

    torch does this only in deterministic mode, which we enable warn-only. That mode can pick
    other implementations for a few ops (index_add_, scatter_add_, CUDA cumsum), so only the
    first arm run (and the reference) is poisoned: the second, the determinism check, runs in
    normal mode and must give the same bits, which exposes any such difference.
    """
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic.*")
            yield
    finally:
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill


_POSITION_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device, n: int) -> torch.Tensor:
    """(position % 65521) + 1 for positions 0..n-1, kept per device: a multi-step gate checksums
    every parameter at every step, and rebuilding the weights cost three launches each time."""
    weights = _POSITION_WEIGHTS.get(device)
    if weights is None or weights.numel() < n:
        size = min(CHUNK_ELEMENTS, max(n, 1 << 20))
        weights = torch.arange(size, device=device, dtype=torch.int64) % 65521 + 1
        _POSITION_WEIGHTS[device] = weights
    return weights[:n]


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 sum of a tensor's bit patterns, as a 0-d tensor on its device
    (no host sync): any changed bit, or two swapped values, moves it."""
    flat = t.detach().reshape(-1)
    words = flat.view(_WORDS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), CHUNK_ELEMENTS):
        chunk = words[start : start + CHUNK_ELEMENTS].to(torch.int64)
        if start == 0:  # most tensors fit in one chunk
            weights = _position_weights(flat.device, chunk.numel())
        else:
            weights = torch.arange(start, start + chunk.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
        total += (chunk * weights).sum()
    return total


STACKED_BYTES = 1 << 28  # bounds the int64 products of one stack in bits_checksums


def bits_checksums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """bits_checksum of each tensor, the same integers, in a few launches instead of five a
    tensor: tensors of one device, word size and length (a model's layers repeat their shapes)
    are stacked and summed together. A step of a 216-tensor optimizer gate checksummed one by
    one was over a thousand launches."""
    sums: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if 0 < t.numel() <= CHUNK_ELEMENTS:
            groups.setdefault((t.device, t.element_size(), t.numel()), []).append(i)
        else:
            sums[i] = bits_checksum(t)
    for (device, size, n), members in groups.items():
        weights = _position_weights(device, n)
        per_stack = max(1, STACKED_BYTES // (8 * n))
        for start in range(0, len(members), per_stack):
            part = members[start : start + per_stack]
            words = torch.stack([tensors[i].detach().reshape(-1).view(_WORDS[size]) for i in part])
            # int64 products and sums, wrapping as bits_checksum's do: the same integers
            for i, total in zip(part, (words * weights).sum(dim=1).unbind()):
                sums[i] = total
    return sums


def _input_digests(buffers: Buffers) -> dict[str, tuple]:
    sums = bits_checksums(list(buffers.values()))
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    values = [0] * len(sums)
    for members in by_device.values():  # one host read per device, not one per buffer
        for i, v in zip(members, torch.stack([sums[i] for i in members]).tolist()):
            values[i] = v
    return {name: (t.dtype, tuple(t.shape), values[i]) for i, (name, t) in enumerate(buffers.items())}


def _ordered(bits: torch.Tensor, nbits: int) -> torch.Tensor:
    """Map sign-magnitude float bit patterns to integers in numeric order (ULP steps)."""
    wide = bits.to(torch.int64)
    magnitude = wide & ((1 << (nbits - 1)) - 1)
    return torch.where(wide < 0, -magnitude, magnitude)


def _same_layout(name: str, arm: torch.Tensor, other: torch.Tensor, what: str) -> Failure | None:
    if arm.shape != other.shape:
        return Failure(check=Check.OUTPUTS, message=f"{name} has shape {list(arm.shape)}, the {what} has {list(other.shape)}")
    if arm.dtype != other.dtype:
        return Failure(check=Check.OUTPUTS, message=f"{name} has dtype {arm.dtype}, the {what} has {other.dtype}")
    return None


def bitwise_check(name: str, arm: torch.Tensor, ref: torch.Tensor) -> TensorCheck:
    """Compare bit patterns: -0.0 vs 0.0 and differing NaN payloads count as differences."""
    base = dict(name=name, shape=list(ref.shape), dtype=str(ref.dtype), mode="bitwise")
    layout = _same_layout(name, arm, ref, "reference")
    if layout:
        return TensorCheck(**base, passed=False, problems=[layout])
    view = _BITS_VIEW.get(ref.dtype)
    differing, first, max_ulp, unwritten = 0, None, 0, 0
    flat_arm, flat_ref = arm.reshape(-1), ref.reshape(-1)
    for start in range(0, flat_ref.numel(), CHUNK_ELEMENTS):
        a, r = flat_arm[start : start + CHUNK_ELEMENTS], flat_ref[start : start + CHUNK_ELEMENTS]
        if view is not None:
            ab, rb = a.view(view), r.view(view)
            unwritten += int((torch.isnan(a) & ~torch.isnan(r)).sum())
        else:
            ab, rb = a, r
        diff = ab != rb
        count = int(diff.sum())
        if not count:
            continue
        if first is None:
            first = start + int(diff.nonzero()[0, 0])
        differing += count
        if view is not None:
            nbits = ref.element_size() * 8
            distance = (_ordered(ab[diff], nbits).double() - _ordered(rb[diff], nbits).double()).abs()
        else:
            distance = (ab[diff].double() - rb[diff].double()).abs()
        max_ulp = max(max_ulp, int(min(distance.max().item(), 2**62)))
    if not differing:
        return TensorCheck(**base, passed=True, differing=0, max_ulp=0)
    index = list(torch.unravel_index(torch.tensor(first), ref.shape)) if ref.dim() else []
    first_index = [int(i) for i in index]
    problems = [Failure(check=Check.PARITY, message=(
        f"{name}: {differing} of {ref.numel()} elements differ, first at {first_index}, max {max_ulp} ULP"))]
    if unwritten:
        problems.insert(0, Failure(check=Check.POISON, message=(
            f"{name}: {unwritten} elements NaN where the reference is not (unwritten output)")))
    return TensorCheck(
        **base, passed=False, differing=differing, first_index=first_index, max_ulp=max_ulp, problems=problems
    )


class _Errors(NamedTuple):
    whole: float  # the whole tensor's relative L2 error
    worst_row: float  # the worst row's relative L2 error
    zero_rows: float  # the largest error norm of a row whose truth is all zero
    row_diff: torch.Tensor  # per row: the squared error norm
    row_truth: torch.Tensor  # per row: the truth's squared norm


def _relative_errors(out: torch.Tensor, truth: torch.Tensor, finite: torch.Tensor, row_floor: float = 0.0) -> _Errors:
    """The errors of `out` against the truth over finite positions, whole and per row.

    A row's error is relative to its truth's norm, floored at `row_floor` x the RMS of the
    rows' norms: where a row's truth cancels to near zero its relative error is a ratio of
    rounding noise, and the worst row's becomes a draw, not a measure. Rows with nothing to be
    relative to (all-zero truth, no floor) are measured apart, by their error's own norm."""
    cols = truth.shape[-1] if truth.dim() > 1 else max(truth.numel(), 1)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(cols, 1))
    o2, t2, f2 = (x.reshape(-1, cols) for x in (out, truth, finite))
    row_diff = torch.zeros(t2.shape[0], dtype=torch.float64, device=t2.device)
    row_truth = torch.zeros_like(row_diff)
    for start in range(0, t2.shape[0], rows_per_chunk):
        sl = slice(start, start + rows_per_chunk)
        keep = f2[sl]
        t = torch.where(keep, t2[sl].double(), 0.0)
        d = torch.where(keep, o2[sl].double(), 0.0) - t
        row_diff[sl] = d.square().sum(dim=1)
        row_truth[sl] = t.square().sum(dim=1)
    diff_sq, truth_sq = float(row_diff.sum()), float(row_truth.sum())
    whole = math.sqrt(diff_sq / truth_sq) if truth_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
    if row_diff.numel() == 0:
        return _Errors(whole, 0.0, 0.0, row_diff, row_truth)
    scale = row_truth.clamp_min(row_floor**2 * truth_sq / row_truth.numel())
    measured = scale > 0
    row_rel = torch.where(measured, (row_diff / scale.clamp_min(1e-300)).sqrt(), 0.0)
    zero_rows = torch.where(measured, 0.0, row_diff.sqrt())
    return _Errors(whole, float(row_rel.max()), float(zero_rows.max()), row_diff, row_truth)


def _is_constant(t: torch.Tensor, finite: torch.Tensor) -> bool:
    values = t[finite]
    return values.numel() > 1 and bool(values.min() == values.max())


def tolerance_check(
    name: str, arm: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, k: float, floor: float,
    row_floor: float = 0.0, noise: float = 0.0, rounding: float = 0.0,
) -> TensorCheck:
    """Arm's error against the float64 truth must be within k x the reference's own + floor.

    A row whose error is as large as its truth has lost its whole value (an all-zero output
    where x*x overflowed to Inf in an rsqrt). Where the reference loses it too, the buffers lie
    beyond the working dtype, counted with `overflowed` (judge_arm refuses them); where only the
    arm does, it fails. Only rows whose truth stands above rounding are counted either way: rows
    of norm at most `noise` (float64 noise around an exact zero), or below the larger of
    `row_floor` and ROUNDING_ROWS x `rounding` (the working dtype's epsilon) of the RMS row
    norm, can be lost to rounding by either side at random; which ones is noise, and the
    whole-tensor and worst-row errors judge them."""
    base = dict(name=name, shape=list(ref.shape), dtype=str(ref.dtype), mode="tolerance", k=k, floor=floor,
                row_floor=row_floor)
    layout = _same_layout(name, arm, ref, "reference")
    if layout is None and truth.shape != ref.shape:
        layout = Failure(check=Check.OUTPUTS, message=(
            f"{name}: the truth has shape {list(truth.shape)}, the reference has {list(ref.shape)}"))
    if layout:
        return TensorCheck(**base, passed=False, problems=[layout])
    if ref.numel() == 0:
        return TensorCheck(**base, passed=True, compared=0, nonfinite_match=True, arm_rel_l2=0.0, ref_rel_l2=0.0)
    problems = []
    # Where the float64 truth is finite but the reference is not, the buffers overflow the
    # working dtype: NaN/Inf of the arm there is the input's fault, not the arm's (judge_arm
    # says so). Everywhere else the arm's NaN/Inf positions must be the truth's.
    overflow = torch.isfinite(truth) & ~torch.isfinite(ref) & ~torch.isfinite(arm)
    nan_a, nan_t = torch.isnan(arm) & ~overflow, torch.isnan(truth)
    unwritten = int((nan_a & ~nan_t).sum())
    nonfinite_match = bool(torch.equal(nan_a, nan_t)) and all(
        torch.equal(kind(arm) & ~overflow, kind(truth)) for kind in (torch.isposinf, torch.isneginf))
    if unwritten:
        problems.append(Failure(check=Check.POISON, message=(
            f"{name}: {unwritten} elements NaN where the truth is finite (unwritten output)")))
    elif not nonfinite_match:
        problems.append(Failure(check=Check.NONFINITE, message=f"{name}: NaN/Inf positions differ from the truth's"))
    finite = torch.isfinite(truth) & torch.isfinite(arm) & torch.isfinite(ref)
    arm_l2, arm_row, arm_zero, arm_diff, row_truth = _relative_errors(arm, truth, finite, row_floor)
    ref_l2, ref_row, ref_zero, ref_diff, _ = _relative_errors(ref, truth, finite, row_floor)
    limit_l2, limit_row = k * ref_l2 + floor, k * ref_row + floor
    rounding = max(rounding, *(torch.finfo(t.dtype).eps for t in (arm, ref) if t.is_floating_point()))
    above_rounding = max(row_floor, ROUNDING_ROWS * rounding) ** 2 * float(row_truth.mean())
    counted = row_truth > max(noise**2, above_rounding)
    arm_lost, ref_lost = counted & (arm_diff >= row_truth), counted & (ref_diff >= row_truth)
    lost_by_arm = int((arm_lost & ~ref_lost).sum())
    lost_by_both = int((arm_lost & ref_lost).sum()) * (ref.numel() // max(row_truth.numel(), 1))
    if lost_by_arm:
        problems.append(Failure(check=Check.PARITY, message=(
            f"{name}: {lost_by_arm} rows lose their whole value (an error as large as the truth) where the "
            "reference's do not")))
    if arm_l2 > limit_l2:
        problems.append(Failure(check=Check.PARITY, message=(
            f"{name}: relative error {arm_l2:.3e} > limit {limit_l2:.3e} (reference {ref_l2:.3e})")))
    if arm_row > limit_row:
        problems.append(Failure(check=Check.PARITY, message=(
            f"{name}: worst-row relative error {arm_row:.3e} > limit {limit_row:.3e} (reference {ref_row:.3e})")))
    # where the truth is all zero: exact zeros if the reference gives them, else its noise x k
    if arm_zero > k * ref_zero:
        problems.append(Failure(check=Check.PARITY, message=(
            f"{name}: on rows whose truth is all zero, an error of norm {arm_zero:.3e} > {k:g} x the "
            f"reference's {ref_zero:.3e}")))
    # where the reference gives the same constant, the truth's variation is its rounding noise
    # around an exact constant (the gradient of probabilities renormalised over one expert)
    if _is_constant(arm, finite) and not _is_constant(truth, finite) and not _is_constant(ref, finite):
        problems.append(Failure(check=Check.DEGENERATE, message=f"{name} is constant where the truth is not"))
    return TensorCheck(
        **base,
        passed=not problems,
        problems=problems,
        compared=int(finite.sum()),
        arm_rel_l2=arm_l2,
        ref_rel_l2=ref_l2,
        limit_rel_l2=limit_l2,
        arm_rel_max=arm_row,
        ref_rel_max=ref_row,
        limit_rel_max=limit_row,
        arm_zero_rows=arm_zero,
        ref_zero_rows=ref_zero,
        nonfinite_match=nonfinite_match,
        overflowed=int(overflow.sum()) + lost_by_both,
    )


@dataclass
class Expected:
    """What the arm is judged against, computed once per buffer set."""

    reference: Outputs
    truth: Outputs | None
    input_digests: dict[str, tuple]
    # the largest finite |value| of any output's truth: a row whose truth is below NOISE of it is
    # rounding noise around an exact zero, not a value an output can lose
    truth_scale: float = 0.0
    # the epsilon of the narrowest floating dtype among the inputs: an fp32 output computed from
    # bf16 operands carries bf16's rounding
    rounding: float = 0.0


def expected_outputs(gate: Gate, preset: Preset, buffers: Buffers) -> Expected:
    digests = _input_digests(buffers)
    # the reference runs in the same (poisoned) mode as the arm's judged run
    reference = _run_poisoned(gate.reference, buffers, preset)
    truth = None
    if any(isinstance(gate.parity_for(name), Tolerance) for name in reference):
        truth = {n: t.detach() for n, t in gate.truth(buffers, preset).items()}
    if _input_digests(buffers) != digests:
        raise RuntimeError(f"gate {gate.name!r}: its reference or truth modified the input buffers")
    _require_something_to_compare(reference, truth)
    scale = max((_finite_amax(t) for t in (truth or {}).values() if t.is_floating_point()), default=0.0)
    rounding = max((torch.finfo(t.dtype).eps for t in buffers.values() if t.is_floating_point()), default=0.0)
    return Expected(reference=reference, truth=truth, input_digests=digests, truth_scale=scale, rounding=rounding)


def _finite_amax(t: torch.Tensor) -> float:
    flat = t.detach().reshape(-1)
    found = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS].double()
        found = torch.maximum(found, torch.where(torch.isfinite(chunk), chunk.abs(), 0.0).amax())
    return float(found)


def _any_finite(ref: torch.Tensor, truth: torch.Tensor | None) -> torch.Tensor:
    """A 0-d bool on the device: whether some element of ref (and of truth) is finite."""
    if not ref.is_floating_point():
        return torch.tensor(ref.numel() > 0, device=ref.device)
    found = torch.zeros((), dtype=torch.bool, device=ref.device)
    flat_ref = ref.reshape(-1)
    flat_truth = truth.reshape(-1) if truth is not None and truth.shape == ref.shape else None
    for start in range(0, flat_ref.numel(), CHUNK_ELEMENTS):
        finite = torch.isfinite(flat_ref[start : start + CHUNK_ELEMENTS])
        if flat_truth is not None:
            finite &= torch.isfinite(flat_truth[start : start + CHUNK_ELEMENTS])
        found |= finite.any()
    return found


def _require_something_to_compare(reference: Outputs, truth: Outputs | None) -> None:
    """Refuse buffers on which parity would pass vacuously: an empty output has nothing an arm
    could get wrong, and neither do outputs that are all NaN/Inf. An output that is all NaN/Inf
    beside others with finite values is still judged, by its NaN/Inf positions."""
    empty = [name for name, ref in reference.items() if ref.numel() == 0]
    found = [_any_finite(ref, (truth or {}).get(name)) for name, ref in reference.items()]
    if empty:
        problem = f"{_preview(empty)} are empty"
    elif found and not torch.stack([f.to(found[0].device) for f in found]).any():  # one host sync
        problem = f"every output ({_preview(list(reference))}) is all NaN/Inf"
    else:
        return
    raise CouldNotRun(
        f"nothing finite to compare: on these buffers {problem}, so parity would pass without checking "
        "a value; look for NaN/Inf or zero-size tensors in the inputs"
    )


def _changed_inputs(buffers: Buffers, digests: dict[str, str]) -> list[str]:
    now = _input_digests(buffers)
    return [name for name in buffers if now[name] != digests[name]]


def _run_poisoned(arm: Callable[[Buffers, Preset], Outputs], buffers: Buffers, preset: Preset) -> Outputs:
    with poisoned_allocations():
        return {n: t.detach() for n, t in arm(buffers, preset).items()}


# A multi-step gate judges tens of thousands of outputs; the report keeps every check up to this
# many, else the first failing ones, and at most KEPT_FAILURES per-output failure messages.
KEPT_CHECKS = 64
KEPT_FAILURES = 20


def _preview(names: list[str], shown: int = 8) -> str:
    """A list of output names short enough for a report line."""
    if len(names) <= shown:
        return str(names)
    return f"{names[:shown]} and {len(names) - shown} more"


def _trimmed(checks: list[TensorCheck]) -> tuple[list[TensorCheck], dict[str, int]]:
    if len(checks) <= KEPT_CHECKS:
        return checks, {}
    failing = [c for c in checks if not c.passed]
    counts = {"outputs_checked": len(checks), "outputs_passed": len(checks) - len(failing)}
    return failing[:KEPT_CHECKS], counts


def _check(gate: Gate, name: str, output: torch.Tensor, expected: Expected) -> TensorCheck:
    mode = gate.parity_for(name)
    output = output.to(expected.reference[name].device)  # an arm may leave a host-side output on the CPU
    if isinstance(mode, Tolerance):
        return tolerance_check(name, output, expected.reference[name], expected.truth[name], mode.k, mode.floor,
                               mode.row_floor, noise=NOISE * expected.truth_scale, rounding=expected.rounding)
    return bitwise_check(name, output, expected.reference[name])


def _compare(gate: Gate, outputs: Outputs, expected: Expected) -> tuple[list[TensorCheck], list[Failure]]:
    failures = []
    missing = sorted(set(expected.reference) - set(outputs))
    extra = sorted(set(outputs) - set(expected.reference))
    if missing or extra:
        failures.append(Failure(check=Check.OUTPUTS, message=(
            f"the arm lacks {_preview(missing)} and adds {_preview(extra)} (against the reference's "
            f"{len(expected.reference)} outputs)")))
    # in the reference's order: a multi-step gate lists its outputs step by step, so the first
    # failing check is the first divergence
    checks = [_check(gate, name, outputs[name], expected) for name in expected.reference if name in outputs]
    failing = [c for c in checks if not c.passed]
    for check in failing[:KEPT_FAILURES]:
        failures.extend(check.problems)
    if len(failing) > KEPT_FAILURES:
        failures.append(Failure(check=failing[KEPT_FAILURES].problems[0].check, message=(
            f"{len(failing) - KEPT_FAILURES} more outputs fail (first {KEPT_FAILURES} listed)")))
    return checks, failures


def _mode(checks: list[TensorCheck]) -> str:
    modes = {c.mode for c in checks}
    return modes.pop() if len(modes) == 1 else "mixed"


def judge_arm(
    gate: Gate,
    preset: Preset,
    buffers: Buffers,
    expected: Expected,
    arm: Callable[[Buffers, Preset], Outputs] | None = None,
    nondeterministic: str | None = None,
    second_run: bool = True,
) -> tuple[ParityResult, Outputs]:
    """Run the arm (or a saboteur) poisoned, judge it, prove it deterministic. Returns its outputs.

    second_run=False leaves the determinism run to `second_run()`, which the runner calls after
    the bench: there one run both proves the arm deterministic and rechecks it after timing.
    """
    arm = arm or gate.arm
    outputs = _run_poisoned(arm, buffers, preset)
    changed = _changed_inputs(buffers, expected.input_digests)
    checks, failures = _compare(gate, outputs, expected)
    if changed:
        failures.append(Failure(check=Check.INPUTS, message=f"the arm modified its input buffers {changed}"))
    deterministic = None
    if nondeterministic is None and second_run:
        again = {n: t.detach() for n, t in arm(buffers, preset).items()}  # normal mode: what is timed
        deterministic, failure = _same_bits(outputs, again)
        failures.extend(failure)
    overflowed = [c for c in checks if c.overflowed]
    if overflowed and not failures:
        raise CouldNotRun(_overflow_message(overflowed))
    first = next((c for c in checks if not c.passed), None)
    kept, counts = _trimmed(checks)
    result = ParityResult(
        mode=_mode(checks) if checks else gate.parity.kind,
        passed=not failures,
        tensors=kept,
        **counts,
        inputs_unchanged=not changed,
        deterministic=deterministic,
        nondeterministic_reason=nondeterministic,
        first_divergence=None if first is None else first.message,
        failures=failures,
    )
    return result, outputs


def _overflow_message(checks: list[TensorCheck]) -> str:
    # the narrowest dtype overflowed first: wider outputs are NaN only downstream of it
    dtypes = {c.dtype.removeprefix("torch.") for c in checks}
    narrowest = min(dtypes, key=lambda name: torch.finfo(getattr(torch, name)).max)
    where = "; ".join(f"{c.name}: {c.overflowed} elements" for c in checks[:KEPT_FAILURES])
    return (f"the buffers overflow {narrowest}: the reference and the arm both lose the value (NaN/Inf, or an "
            f"error as large as the value) where the float64 truth is finite ({where}); parity cannot judge "
            "values the working dtype cannot hold. Record inputs scaled into its range, or in a wider dtype")


def _same_bits(first: Outputs, again: Outputs, cause: str = "") -> tuple[bool, list[Failure]]:
    """The determinism check: every output of the first run reproduced bit for bit by the
    second (one it lacks differs)."""
    unequal = [n for n in sorted(first) if n not in again or not bitwise_check(n, again[n], first[n]).passed]
    if not unequal:
        return True, []
    message = f"two runs on the same inputs differ in {_preview(unequal)}{cause}"
    return False, [Failure(check=Check.DETERMINISM, message=message)]


def second_run(
    gate: Gate, preset: Preset, buffers: Buffers, expected_digests: dict[str, tuple], first: Outputs,
    verdict: ParityResult, after_timing: bool,
) -> None:
    """The determinism run judge_arm(second_run=False) left for after the bench, recorded in
    `verdict`. A fresh run (normal mode: what is timed) must reproduce the judged outputs bit
    for bit; after timing it is also the recheck that timing left the inputs and the arm's state
    intact. A nondeterministic arm is judged after timing with a tolerance rebuilt from the
    reference and truth, and not run at all without timing.
    """
    failures = []
    changed = _changed_inputs(buffers, expected_digests) if after_timing else []
    if changed:
        failures.append(Failure(check=Check.INPUTS, message=f"timing left the input buffers {changed} modified"))
    elif gate.nondeterministic is None:
        outputs = {n: t.detach() for n, t in gate.arm(buffers, preset).items()}
        cause = " (the second after timing: the arm is nondeterministic, or timing changed its state)"
        verdict.deterministic, failure = _same_bits(first, outputs, cause if after_timing else "")
        failures.extend(failure)
    elif after_timing:
        outputs = {n: t.detach() for n, t in gate.arm(buffers, preset).items()}
        _, more = _compare(gate, outputs, expected_outputs(gate, preset, buffers))
        failures.extend(Failure(check=f.check, message=f"{f.message} (after timing)") for f in more)
    if after_timing:
        verdict.recheck_after_timing = not failures
        verdict.second_run_after_timing = gate.nondeterministic is None and not changed
    verdict.failures.extend(failures)
    verdict.passed = verdict.passed and not failures
